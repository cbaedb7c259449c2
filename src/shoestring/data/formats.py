"""One JSON object (a JSONL line, a Parquet/CSV row, a dataset row) → one :class:`Record`.

Five shapes are understood; ``detect_format`` picks one from an object's keys:

* ``text``: ``{"text": ...}``, loss on every token;
* ``prompt_completion``: ``{"prompt": ..., "completion": ...}``;
* ``messages``: OpenAI-style ``{"messages": [{"role", "content"}, ...], "tools": [...]}``;
* ``alpaca``: ``{"instruction", "input" (optional), "output", "system" (optional)}``;
* ``sharegpt``: ``{"conversations": [{"from", "value"}, ...], "system" (optional)}``;
* ``preference``: ``{"prompt", "chosen", "rejected"}`` as text, or TRL's conversational
  shape: ``chosen``/``rejected`` message lists, after a ``prompt`` message list or
  sharing their first messages as the prompt (``train.objective dpo|orpo|simpo``);
* ``prompt``: ``{"prompt": "..." or [messages], ...columns}``, a prompt and no answer
  (``train.objective grpo``, which reads only this shape; never detected by ``auto``):
  the other fields are kept for the reward functions (TRL's prompt-only format).

Alpaca and ShareGPT become conversations (``Record.messages``), so everything after
parsing sees three kinds of record: text, pair and chat. Every error names the place
(``where``: ``file:line``, ``file:row N``) and the field.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Literal

from shoestring.data.records import DataError, Record

ConcreteFormat = Literal[
    "text", "prompt_completion", "messages", "alpaca", "sharegpt", "preference", "prompt"
]
ROLES = ("system", "developer", "user", "assistant", "tool")

#: The keys of a message that are kept; anything else in a message is dropped.
MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")

#: ShareGPT ``from`` values and the role each becomes.
SHAREGPT_ROLES: Mapping[str, str] = MappingProxyType(
    {
        "human": "user",
        "user": "user",
        "gpt": "assistant",
        "assistant": "assistant",
        "system": "system",
        "tool": "tool",
        "observation": "tool",
        "function_call": "assistant",
    }
)

_SHAPES = (
    "'text' or 'prompt'+'completion' or 'messages' or 'conversations' or 'instruction'+'output'"
)


def _keys_found(obj: dict[str, Any]) -> str:
    return str(sorted(obj)) if obj else "none"


def _as_object(obj: Any, where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _missing_message(keys: set[str]) -> str:
    """What a near-miss lacks: ``'completion'`` beside a prompt, else every accepted shape."""
    if "prompt" in keys:
        return "'completion'"
    if "completion" in keys:
        return "'prompt'"
    if "instruction" in keys:
        return "'output'"
    if "output" in keys:
        return "'instruction'"
    return _SHAPES


def detect_format(obj: Any, where: str) -> ConcreteFormat:
    """The shape of one object, from its keys (see the module docstring for the order)."""
    keys = set(_as_object(obj, where))
    if keys & {"chosen", "rejected"}:
        return "preference"
    if "messages" in keys:
        return "messages"
    if "conversations" in keys:
        return "sharegpt"
    if {"instruction", "output"} <= keys:
        return "alpaca"
    if "text" in keys and keys & {"prompt", "completion"}:
        raise DataError(f"{where}: use either 'text' or 'prompt'+'completion', not both")
    if {"prompt", "completion"} <= keys:
        return "prompt_completion"
    if "text" in keys:
        return "text"
    raise DataError(f"{where}: missing {_missing_message(keys)} (keys found: {_keys_found(obj)})")


def _require(obj: dict[str, Any], where: str, *keys: str) -> None:
    for key in keys:
        if key not in obj:
            raise DataError(f"{where}: missing '{key}' (keys found: {_keys_found(obj)})")


def _string(obj: dict[str, Any], key: str, where: str, *, non_empty: bool = False) -> str:
    value = obj[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: '{key}' must be a string")
    if non_empty and not value:
        raise DataError(f"{where}: '{key}' is empty")
    return value


def _optional_string(obj: dict[str, Any], key: str, where: str) -> str:
    """An optional string field: absent or null reads as empty."""
    if obj.get(key) is None:
        return ""
    return _string(obj, key, where)


def _parse_text(obj: dict[str, Any], where: str) -> Record:
    _require(obj, where, "text")
    if obj.keys() & {"prompt", "completion"}:
        raise DataError(f"{where}: use either 'text' or 'prompt'+'completion', not both")
    return Record(where, text=_string(obj, "text", where, non_empty=True))


def _parse_prompt_completion(obj: dict[str, Any], where: str) -> Record:
    _require(obj, where, "prompt", "completion")
    prompt = _string(obj, "prompt", where)
    return Record(
        where, prompt=prompt, completion=_string(obj, "completion", where, non_empty=True)
    )


def _check_tool_calls(msg: dict[str, Any], role: str, at: str) -> None:
    calls = msg.get("tool_calls")
    if calls is None:
        return
    if role != "assistant":
        raise DataError(f"{at}: only assistant messages carry 'tool_calls' (role is {role!r})")
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise DataError(f"{at}: 'tool_calls' must be a list of objects")


def _check_content(msg: dict[str, Any], role: str, at: str) -> None:
    content = msg.get("content")
    if isinstance(content, str):
        return
    if content is None and role == "assistant" and msg.get("tool_calls") is not None:
        return
    if content is None:
        raise DataError(f"{at}: missing 'content'")
    raise DataError(f"{at}: 'content' must be a string, got {type(content).__name__}")


def parse_message(msg: Any, at: str) -> dict[str, Any]:
    """Validate one OpenAI-style message; return a copy holding only ``MESSAGE_KEYS``.

    ``at`` is the place and message number, e.g. ``train.jsonl:7: message 3``."""
    if not isinstance(msg, dict):
        raise DataError(f"{at}: expected an object, got {type(msg).__name__}")
    role = msg.get("role")
    if role not in ROLES:
        what = "missing 'role'" if role is None else f"unknown role {role!r}"
        raise DataError(f"{at}: {what} (expected one of {', '.join(ROLES)})")
    _check_tool_calls(msg, role, at)
    _check_content(msg, role, at)
    for key in ("tool_call_id", "name"):
        if msg.get(key) is not None and not isinstance(msg[key], str):
            raise DataError(f"{at}: '{key}' must be a string")
    # Parquet/Arrow rows carry every struct field, null where a message lacks it: drop those.
    return {k: msg.get(k) for k in MESSAGE_KEYS if msg.get(k) is not None or k == "content"}


def parse_tools(obj: dict[str, Any], where: str) -> tuple[dict[str, Any], ...] | None:
    """Optional ``tools``: a list of objects (or that list as a JSON string, as some
    datasets store it); an empty list or null means none."""
    tools = obj.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: 'tools' is a string but not valid JSON: {e.msg}") from e
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(f"{where}: 'tools' must be a list of objects")
    return tuple(tools) or None


def _parse_messages(obj: dict[str, Any], where: str) -> Record:
    _require(obj, where, "messages")
    messages = obj["messages"]
    if not isinstance(messages, list):
        raise DataError(f"{where}: 'messages' must be a list of messages")
    if not messages:
        raise DataError(f"{where}: 'messages' is empty")
    parsed = tuple(parse_message(m, f"{where}: message {i}") for i, m in enumerate(messages, 1))
    return Record(where, messages=parsed, tools=parse_tools(obj, where))


def _system_prefix(obj: dict[str, Any], where: str) -> list[dict[str, Any]]:
    system = _optional_string(obj, "system", where)
    return [{"role": "system", "content": system}] if system else []


def _parse_alpaca(obj: dict[str, Any], where: str) -> Record:
    _require(obj, where, "instruction", "output")
    instruction = _string(obj, "instruction", where, non_empty=True)
    extra = _optional_string(obj, "input", where)
    output = _string(obj, "output", where, non_empty=True)
    user = instruction + ("\n\n" + extra if extra else "")
    messages = [
        *_system_prefix(obj, where),
        {"role": "user", "content": user},
        {"role": "assistant", "content": output},
    ]
    return Record(where, messages=tuple(messages))


def _sharegpt_turn(turn: Any, at: str) -> dict[str, Any]:
    if not isinstance(turn, dict):
        raise DataError(f"{at}: expected an object, got {type(turn).__name__}")
    source = turn.get("from")
    if not isinstance(source, str) or source not in SHAREGPT_ROLES:
        what = "missing 'from'" if source is None else f"unknown 'from' {source!r}"
        raise DataError(f"{at}: {what} (expected one of {', '.join(SHAREGPT_ROLES)})")
    if "value" not in turn:
        raise DataError(f"{at}: missing 'value'")
    return {"role": SHAREGPT_ROLES[source], "content": _string(turn, "value", at)}


def _parse_sharegpt(obj: dict[str, Any], where: str) -> Record:
    _require(obj, where, "conversations")
    turns = obj["conversations"]
    if not isinstance(turns, list):
        raise DataError(f"{where}: 'conversations' must be a list of turns")
    if not turns:
        raise DataError(f"{where}: 'conversations' is empty")
    mapped = [_sharegpt_turn(t, f"{where}: turn {i}") for i, t in enumerate(turns, 1)]
    messages = (*_system_prefix(obj, where), *mapped)
    return Record(where, messages=messages, tools=parse_tools(obj, where))


def _answers(obj: dict[str, Any], where: str) -> tuple[Any, Any]:
    _require(obj, where, "chosen", "rejected")
    chosen, rejected = obj["chosen"], obj["rejected"]
    if isinstance(chosen, str) and isinstance(rejected, str):
        return chosen, rejected
    if isinstance(chosen, list) and isinstance(rejected, list):
        return chosen, rejected
    raise DataError(
        f"{where}: 'chosen' and 'rejected' must both be strings or both message lists "
        f"(got {type(chosen).__name__} and {type(rejected).__name__})"
    )


def _text_preference(obj: dict[str, Any], where: str, chosen: str, rejected: str) -> Record:
    _require(obj, where, "prompt")
    prompt = _string(obj, "prompt", where)
    for key, answer in (("chosen", chosen), ("rejected", rejected)):
        if not answer:
            raise DataError(f"{where}: '{key}' is empty")
    other = Record(where, prompt=prompt, completion=rejected)
    return Record(where, prompt=prompt, completion=chosen, rejected=other)


def _message_list(items: list[Any], where: str, key: str) -> list[dict[str, Any]]:
    return [parse_message(m, f"{where}: {key} message {i}") for i, m in enumerate(items, 1)]


def _shared_prefix(chosen: list[dict[str, Any]], rejected: list[dict[str, Any]]) -> int:
    n = 0
    while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
        n += 1
    return n


def _chat_preference(
    obj: dict[str, Any], where: str, chosen: list[Any], rejected: list[Any]
) -> Record:
    prompt_raw = obj.get("prompt")
    if prompt_raw is not None and not isinstance(prompt_raw, list):
        raise DataError(f"{where}: 'prompt' must be a message list when 'chosen' is one")
    prompt = _message_list(prompt_raw or [], where, "prompt")
    good = _message_list(chosen, where, "chosen")
    bad = _message_list(rejected, where, "rejected")
    if not prompt:  # TRL's implicit prompt: the messages both answers start with
        n = _shared_prefix(good, bad)
        prompt, good, bad = good[:n], good[n:], bad[n:]
    if not prompt:
        raise DataError(f"{where}: no prompt: give 'prompt' messages or a shared first message")
    for key, answer in (("chosen", good), ("rejected", bad)):
        if not answer or answer[-1].get("role") != "assistant":
            raise DataError(f"{where}: '{key}' must end with an assistant message")
    tools = parse_tools(obj, where)
    start = len(prompt)
    other = Record(where, messages=(*prompt, *bad), tools=tools, answer_start=start)
    return Record(where, messages=(*prompt, *good), tools=tools, rejected=other, answer_start=start)


def _parse_preference(obj: dict[str, Any], where: str) -> Record:
    chosen, rejected = _answers(obj, where)
    if isinstance(chosen, str):
        return _text_preference(obj, where, chosen, rejected)
    return _chat_preference(obj, where, chosen, rejected)


def _parse_prompt(obj: dict[str, Any], where: str) -> Record:
    if "prompt" not in obj:
        raise DataError(
            f"{where}: missing 'prompt' (train.objective grpo reads prompt records: "
            '{"prompt": "..."} or {"prompt": [messages]}, plus any fields the reward '
            f"functions take; keys found: {_keys_found(obj)})"
        )
    columns = {k: v for k, v in obj.items() if k != "prompt"}
    raw = obj["prompt"]
    if isinstance(raw, list):
        messages = _message_list(raw, where, "prompt")
        if not messages:
            raise DataError(f"{where}: 'prompt' is an empty message list")
        tools = parse_tools(obj, where)
        columns.pop("tools", None)
        return Record(where, messages=tuple(messages), tools=tools, columns=columns)
    return Record(where, prompt=_string(obj, "prompt", where, non_empty=True), columns=columns)


_PARSERS: Mapping[ConcreteFormat, Callable[[dict[str, Any], str], Record]] = MappingProxyType(
    {
        "text": _parse_text,
        "prompt_completion": _parse_prompt_completion,
        "messages": _parse_messages,
        "alpaca": _parse_alpaca,
        "sharegpt": _parse_sharegpt,
        "preference": _parse_preference,
        "prompt": _parse_prompt,
    }
)

FORMATS: tuple[ConcreteFormat, ...] = tuple(_PARSERS)


def parse_record(obj: Any, where: str, fmt: ConcreteFormat) -> Record:
    """Validate ``obj`` as a record of format ``fmt``; ``where`` goes into every error."""
    return _PARSERS[fmt](_as_object(obj, where), where)
