"""``tool_choice`` ``"auto"`` in OpenAI batch files: a free answer read back as text or
as tool calls, in the model family's own syntax (transformers' response parser).

In-process and model-free: the prompts are rendered by Qwen2.5's real chat template,
the answers are the token ids a model would generate, and the output lines are
checked with the openai package's own types."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.chat import ChatCompletion

from chat_fixtures import (
    WEATHER_TOOL,
    chatml_tokenizer,
    llama3_tokenizer,
    mistral_tokenizer,
    save_tokenizer,
)
from shoestring.hf import load_tokenizer
from shoestring.infer.batchapi import LineError, Request, parse_line
from shoestring.infer.decode import Generated
from shoestring.infer.requests import Answering
from shoestring.infer.toolsyntax import find_syntax
from shoestring.infer.work import output_lines, tokenize_requests

CLOCK_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
CLOCK_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
ANSWERING = Answering("job", "tiny", 1700)


def _line(cid: str, **body: Any) -> bytes:
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    return json.dumps(
        {
            "custom_id": cid,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": messages, "tools": [WEATHER_TOOL, CLOCK_TOOL], **body},
        }
    ).encode()


def _answers(tok: Any, model_type: str | None, answers: dict[str, tuple[str, Any]]) -> dict:
    """Each request (custom_id -> (generated text, body extras)) answered as if the
    model had generated that text, then ended ("eos") or hit its limit ("length")."""
    items = [parse_line(_line(cid, **extra), i + 1, "in.jsonl", 64) for i, (cid, (_, extra)) in
             enumerate(answers.items())]  # fmt: skip
    work = tokenize_requests(items, tok, None, 4096, 0, "in.jsonl", 512, model_type)
    results = []
    for text, extra in answers.values():
        ids = tok.encode(text, add_special_tokens=False)
        finish = "length" if extra.get("max_tokens") == len(ids) else "eos"
        results.append([Generated(ids, finish)])
    raw = output_lines(work, range(len(items)), "generate", results, tok, ANSWERING)  # type: ignore[arg-type]
    lines = [json.loads(x) for x in raw.decode().splitlines()]
    return {x["custom_id"]: x for x in lines}


def _message(line: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    assert line["error"] is None, line["error"]
    body = line["response"]["body"]
    ChatCompletion.model_validate(body)  # the openai package's own type
    choice = body["choices"][0]
    return choice["finish_reason"], choice["message"]


def test_auto_answers_are_read_as_calls_or_text() -> None:
    tok = chatml_tokenizer()
    cut = CALL[:40]
    lines = _answers(
        tok,
        "qwen2",  # transformers serve's response template for the Qwen 2 family
        {
            "call": (CALL, {}),
            "text": ("It is sunny in Oslo.", {}),
            "both": ("Let me check.\n" + CALL + "\n" + CLOCK_CALL, {"tool_choice": "auto"}),
            "one": (CALL + "\n" + CLOCK_CALL, {"parallel_tool_calls": False}),
            "stop": (CALL + "\nEND" + CLOCK_CALL, {"stop": ["END"]}),  # read as text
            "broken": ('<tool_call>\n{"name": "get_weather", "argu</tool_call>', {}),
            "cut": (cut, {"max_tokens": len(tok.encode(cut, add_special_tokens=False))}),
        },
    )
    finish, msg = _message(lines["call"])
    assert finish == "tool_calls" and msg["content"] is None
    [call] = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Oslo"}'}
    # Text beside the calls stays the message's content; every call is kept, in order.
    finish, msg = _message(lines["both"])
    assert finish == "tool_calls" and msg["content"] == "Let me check."
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "get_time"]
    assert json.loads(msg["tool_calls"][1]["function"]["arguments"]) == {"tz": "CET"}
    assert len({c["id"] for c in msg["tool_calls"]}) == 2
    # parallel_tool_calls false: the first call only.
    finish, msg = _message(lines["one"])
    assert finish == "tool_calls" and len(msg["tool_calls"]) == 1
    # Stop strings cut the answer: the text up to them is read (the clock call is cut off).
    finish, msg = _message(lines["stop"])
    assert finish == "tool_calls" and [c["function"]["name"] for c in msg["tool_calls"]] == [
        "get_weather"
    ]
    # Text, a call whose JSON does not parse, and an answer cut by its limit stay text.
    for cid, text, why in (
        ("text", "It is sunny in Oslo.", "stop"),
        ("broken", "<tool_call>", "stop"),
        ("cut", "<tool_call>", "length"),
    ):
        finish, msg = _message(lines[cid])
        assert finish == why and text in msg["content"] and "tool_calls" not in msg, cid


def test_a_thinking_answer_keeps_its_reasoning_beside_its_calls() -> None:
    tok = chatml_tokenizer()
    lines = _answers(tok, "qwen3", {"t": ("<think>\nOslo: weather.\n</think>\n\n" + CALL, {})})
    finish, msg = _message(lines["t"])
    assert finish == "tool_calls" and msg["content"] is None
    assert msg["reasoning_content"].strip() == "Oslo: weather."
    assert msg["tool_calls"][0]["function"]["name"] == "get_weather"


def test_the_tokenizers_own_response_template_is_used(tmp_path: Any) -> None:
    """A response_template in tokenizer_config.json (as models on the Hub ship it) is
    the model's syntax, whatever its model type: here calls in ``<call>`` tags."""
    tok = chatml_tokenizer()
    tok.response_template = {
        "start_anchor": "<|im_start|>assistant\n",
        "fields": {
            "tool_calls": {
                "open": "<call>",
                "close": "</call>",
                "repeats": True,
                "content": "json",
                "transform": {"type": "function", "function": "{content}"},
            },
            "content": {"close": "<|im_end|>", "content": "text"},
        },
    }
    loaded = load_tokenizer(save_tokenizer(tok, tmp_path / "tok"))
    syntax = find_syntax(loaded, "llama")
    assert syntax is not None and syntax.source == "the tokenizer's response_template"
    lines = _answers(
        loaded, "llama", {"c": ('<call>{"name": "get_time", "arguments": {}}</call>', {})}
    )
    finish, msg = _message(lines["c"])
    assert finish == "tool_calls" and msg["tool_calls"][0]["function"]["name"] == "get_time"


def test_llama3_json_calls_are_read_with_our_template() -> None:
    """Llama 3.1's calls (transformers ships no template for them): the whole answer is a
    ``{"name", "parameters"}`` object, after ``<|python_tag|>`` for a built-in tool."""
    tok = llama3_tokenizer()
    syntax = find_syntax(tok, "llama")
    assert syntax is not None and "Llama 3.1" in syntax.source
    call = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    lines = _answers(
        tok,
        "llama",
        {
            "call": (call, {}),
            "tagged": ("<|python_tag|>" + call, {}),
            "text": ('It is sunny, as {"name": "x"} says.', {}),
            "broken": ('{"name": "get_weather", "para', {}),
        },
    )
    for cid in ("call", "tagged"):
        finish, msg = _message(lines[cid])
        assert finish == "tool_calls" and msg["content"] is None, cid
        assert msg["tool_calls"][0]["function"] == {
            "name": "get_weather",
            "arguments": '{"city":"Oslo"}',
        }
    for cid in ("text", "broken"):
        finish, msg = _message(lines[cid])
        assert finish == "stop" and "tool_calls" not in msg and msg["content"], cid


@pytest.mark.parametrize("v11", [False, True])
def test_mistral_calls_are_read_with_our_template(v11: bool) -> None:
    """Mistral's calls (transformers ships no template for them): ``[TOOL_CALLS]`` and a
    JSON list of calls (v3), or ``[TOOL_CALLS]name[ARGS]{...}`` for each call (v11);
    one call or two, text before a call, text alone, and a broken call read as text."""
    tok = mistral_tokenizer(v11)
    syntax = find_syntax(tok, "mistral")
    assert syntax is not None and ("v11" in syntax.source) == v11
    weather, clock = ("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "CET"})

    def calls(*each: tuple[str, dict[str, Any]]) -> str:
        if v11:
            return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in each)
        return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in each])

    lines = _answers(
        tok,
        "mistral",
        {
            "one": (calls(weather), {}),
            "two": (calls(weather, clock), {}),
            "said": ("Let me check. " + calls(weather), {}),
            "text": ("It is sunny in Oslo.", {}),
            "broken": (calls(weather)[:-6], {}),
        },
    )
    finish, msg = _message(lines["one"])
    assert finish == "tool_calls" and msg["content"] is None
    assert [c["function"] for c in msg["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city":"Oslo"}'}
    ]
    finish, msg = _message(lines["two"])
    assert finish == "tool_calls"
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "get_time"]
    assert msg["tool_calls"][1]["function"]["arguments"] == '{"tz":"CET"}'
    finish, msg = _message(lines["said"])
    assert finish == "tool_calls" and msg["content"] == "Let me check."
    assert msg["tool_calls"][0]["function"]["name"] == "get_weather"
    for cid in ("text", "broken"):
        finish, msg = _message(lines[cid])
        assert finish == "stop" and "tool_calls" not in msg and msg["content"], cid


def test_auto_without_a_known_syntax_is_that_lines_error() -> None:
    """A Llama with a ChatML template has no response template, transformers knows none
    for its type, and it is not Llama 3's format: its ``"auto"`` lines (tool_choice
    absent, or "auto") are refused, the rest run."""
    tok = chatml_tokenizer()
    assert find_syntax(tok, "llama") is None
    items = [
        parse_line(_line("absent"), 1, "in.jsonl", 8),
        parse_line(_line("auto", tool_choice="auto"), 2, "in.jsonl", 8),
        parse_line(_line("required", tool_choice="required"), 3, "in.jsonl", 8),
        parse_line(_line("none", tool_choice="none"), 4, "in.jsonl", 8),
    ]
    work = tokenize_requests(items, tok, None, 4096, 0, "in.jsonl", 512, "llama")
    for err, line in zip(work.records[:2], (1, 2)):
        assert isinstance(err, LineError) and err.code == "unsupported", err
        assert err.param == "body.tool_choice" and err.message.startswith(f"in.jsonl:{line}: ")
        assert "model type 'llama'" in err.message and "response_template" in err.message
        assert '"required"' in err.message
    assert [isinstance(r, Request) for r in work.records[2:]] == [True, True]
    assert [len(s) for s in work.seqs] == [0, 0, 1, 1]
