"""Record formats: detection from keys, parsing into records, and errors naming file:line + field."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from shoestring.data.formats import ConcreteFormat, detect_format, parse_record
from shoestring.data.records import DataError, Record
from shoestring.data.sources import read_records, resolve_source

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def read_lines(tmp_path: Path, lines: list[Any], fmt: Any = "auto") -> list[Record]:
    p = tmp_path / "train.jsonl"
    p.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    records, _ = read_records(resolve_source(str(p), tmp_path / "cache"), fmt)
    return records


@pytest.mark.parametrize(
    "obj,fmt",
    [
        ({"text": "a"}, "text"),
        ({"prompt": "a", "completion": "b"}, "prompt_completion"),
        ({"messages": CHAT}, "messages"),
        ({"messages": CHAT, "prompt": "p", "text": "t"}, "messages"),  # messages wins
        ({"instruction": "i", "input": "", "output": "o"}, "alpaca"),
        ({"instruction": "i", "output": "o", "text": "rendered"}, "alpaca"),  # alpaca's text column
        ({"conversations": [{"from": "human", "value": "x"}]}, "sharegpt"),
    ],
)
def test_detect_format_from_keys(obj: dict[str, Any], fmt: ConcreteFormat) -> None:
    assert detect_format(obj, "f.jsonl:1") == fmt


def test_detect_format_names_keys_found_and_accepted_shapes() -> None:
    with pytest.raises(DataError) as e:
        detect_format({"question": "q", "answer": "a"}, "f.jsonl:4")
    msg = str(e.value)
    assert msg.startswith("f.jsonl:4: missing 'text' or 'prompt'+'completion'")
    assert "'messages'" in msg and "'conversations'" in msg and "'instruction'+'output'" in msg
    assert "keys found: ['answer', 'question']" in msg
    with pytest.raises(DataError, match=r"^f\.jsonl:2: expected a JSON object, got list$"):
        detect_format(["text"], "f.jsonl:2")
    with pytest.raises(
        DataError, match=r"^f:1: missing 'output' \(keys found: \['instruction'\]\)"
    ):
        detect_format({"instruction": "i"}, "f:1")


def test_text_and_prompt_completion_records() -> None:
    assert parse_record({"text": "abc"}, "w", "text") == Record("w", text="abc")
    pair = parse_record({"prompt": "", "completion": "c"}, "w", "prompt_completion")
    assert (pair.prompt, pair.completion, pair.kind) == ("", "c", "pair")


def test_messages_keep_known_keys_only_as_copies_with_tools() -> None:
    tool_call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    obj: dict[str, Any] = {
        "messages": [
            {"role": "system", "content": "be brief", "weight": 0},
            {"role": "user", "content": "add 1+1", "name": "ann"},
            {"role": "assistant", "tool_calls": [tool_call]},  # content absent: a pure tool call
            {"role": "tool", "content": "2", "tool_call_id": "c1", "name": "f"},
            {"role": "assistant", "content": "2", "tool_calls": None, "tool_call_id": None},
        ],
        "tools": [{"type": "function", "function": {"name": "f"}}],
    }
    rec = parse_record(obj, "w", "messages")
    assert rec.kind == "chat"
    assert rec.messages == (
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "add 1+1", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [tool_call]},
        {"role": "tool", "content": "2", "tool_call_id": "c1", "name": "f"},
        {"role": "assistant", "content": "2"},
    )
    assert rec.tools == ({"type": "function", "function": {"name": "f"}},)
    obj["messages"][1]["content"] = "changed"
    assert rec.messages is not None and rec.messages[1]["content"] == "add 1+1"
    assert parse_record({"messages": CHAT, "tools": []}, "w", "messages").tools is None
    as_string = parse_record({"messages": CHAT, "tools": '[{"name": "f"}]'}, "w", "messages")
    assert as_string.tools == ({"name": "f"},)


def test_alpaca_becomes_a_conversation() -> None:
    rec = parse_record({"instruction": "Sum", "input": "1 2", "output": "3"}, "w", "alpaca")
    assert rec.messages == (
        {"role": "user", "content": "Sum\n\n1 2"},
        {"role": "assistant", "content": "3"},
    )
    rec = parse_record(
        {"instruction": "Hi", "input": "", "output": "Yo", "system": "Be nice"}, "w", "alpaca"
    )
    assert rec.messages == (
        {"role": "system", "content": "Be nice"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Yo"},
    )
    no_input = parse_record({"instruction": "Hi", "input": None, "output": "Yo"}, "w", "alpaca")
    assert no_input.messages is not None and no_input.messages[0]["content"] == "Hi"


def test_sharegpt_maps_every_speaker() -> None:
    turns = [
        {"from": "system", "value": "s"},
        {"from": "human", "value": "h"},
        {"from": "function_call", "value": '{"name": "f"}'},
        {"from": "observation", "value": "o"},
        {"from": "tool", "value": "t"},
        {"from": "gpt", "value": "g"},
    ]
    rec = parse_record({"conversations": turns, "system": "top"}, "w", "sharegpt")
    assert rec.messages is not None
    assert [(m["role"], m["content"]) for m in rec.messages] == [
        ("system", "top"),
        ("system", "s"),
        ("user", "h"),
        ("assistant", '{"name": "f"}'),
        ("tool", "o"),
        ("tool", "t"),
        ("assistant", "g"),
    ]


GOOD = {
    "text": {"text": "fine"},
    "prompt_completion": {"prompt": "a", "completion": "b"},
    "messages": {"messages": CHAT},
    "alpaca": {"instruction": "i", "output": "o"},
    "sharegpt": {"conversations": [{"from": "human", "value": "x"}]},
}


@pytest.mark.parametrize(
    "fmt,bad,msg",
    [
        ("text", {"text": 5}, "'text' must be a string"),
        ("text", {"text": ""}, "'text' is empty"),
        ("prompt_completion", {"prompt": "a", "completion": ""}, "'completion' is empty"),
        ("prompt_completion", {"prompt": 1, "completion": "b"}, "'prompt' must be a string"),
        (
            "messages",
            {"messages": [*CHAT, {"role": "asistant", "content": "x"}]},
            "message 3: unknown role 'asistant' (expected one of system, developer, user, assistant, tool)",
        ),
        ("messages", {"messages": []}, "'messages' is empty"),
        ("messages", {"messages": "hi"}, "'messages' must be a list of messages"),
        ("messages", {"messages": [{"role": "user"}]}, "message 1: missing 'content'"),
        (
            "messages",
            {"messages": [{"role": "user", "content": ["part"]}]},
            "message 1: 'content' must be a string, got list",
        ),
        (
            "messages",
            {"messages": [{"role": "user", "content": None, "tool_calls": []}]},
            "message 1: only assistant messages carry 'tool_calls' (role is 'user')",
        ),
        ("messages", {"messages": ["hi"]}, "message 1: expected an object, got str"),
        ("messages", {"messages": CHAT, "tools": {"f": 1}}, "'tools' must be a list of objects"),
        ("alpaca", {"instruction": "i", "output": 3}, "'output' must be a string"),
        ("alpaca", {"instruction": "", "output": "o"}, "'instruction' is empty"),
        ("alpaca", {"instruction": "i", "input": 2, "output": "o"}, "'input' must be a string"),
        (
            "sharegpt",
            {"conversations": [{"from": "human", "value": "a"}, {"from": "bot", "value": "b"}]},
            "turn 2: unknown 'from' 'bot' (expected one of human, user, gpt, assistant, system, tool, observation, function_call)",
        ),
        ("sharegpt", {"conversations": [{"from": "gpt"}]}, "turn 1: missing 'value'"),
        ("sharegpt", {"conversations": []}, "'conversations' is empty"),
    ],
)
def test_malformed_record_names_file_line_and_field(
    tmp_path: Path, fmt: str, bad: dict[str, Any], msg: str
) -> None:
    """Line 1 is a good record of the same format, line 2 blank, line 3 the bad one."""
    p = tmp_path / "train.jsonl"
    with pytest.raises(DataError, match="^" + re.escape(f"{p}:3: {msg}") + "$"):
        read_lines(tmp_path, [GOOD[fmt], "", bad])
    # The same message when the format is given rather than detected.
    with pytest.raises(DataError, match="^" + re.escape(f"{p}:3: {msg}") + "$"):
        read_lines(tmp_path, [GOOD[fmt], "", bad], fmt=fmt)


def test_one_format_per_file_when_detected(tmp_path: Path) -> None:
    p = tmp_path / "train.jsonl"
    with pytest.raises(DataError) as e:
        read_lines(tmp_path, [GOOD["messages"], GOOD["messages"], GOOD["text"]])
    assert str(e.value).startswith(f"{p}:3: a text record, but {p} holds messages records")
    assert f"detected from {p}:1" in str(e.value)


def test_given_format_is_enforced_on_every_record(tmp_path: Path) -> None:
    p = tmp_path / "train.jsonl"
    with pytest.raises(
        DataError, match=re.escape(f"{p}:1: missing 'text' (keys found: ['messages'])")
    ):
        read_lines(tmp_path, [GOOD["messages"]], fmt="text")
    with pytest.raises(DataError, match="data.format: unknown format 'chatml'"):
        read_lines(tmp_path, [GOOD["text"]], fmt="chatml")


def test_legacy_shapes_keep_their_messages(tmp_path: Path) -> None:
    """The wording train/data.py has always used for the text and prompt/completion shapes."""
    p = tmp_path / "train.jsonl"
    for line, msg in [
        ('{"text": "ok"', "invalid JSON: Expecting ',' delimiter (column 14)"),
        ('["text"]', "expected a JSON object, got list"),
        ('{"prompt": "a"}', "missing 'completion' (keys found: ['prompt'])"),
        ('{"completion": "a"}', "missing 'prompt' (keys found: ['completion'])"),
        ('{"text": "a", "prompt": "b"}', "use either 'text' or 'prompt'+'completion', not both"),
    ]:
        with pytest.raises(DataError, match="^" + re.escape(f"{p}:2: {msg}") + "$"):
            read_lines(tmp_path, [GOOD["text"], line])
