"""OpenAI Batch API files: the input ``shoestring infer`` reads, the output it writes.

An input file is JSONL, one request a line, the format of OpenAI's Batch API and of
vLLM's ``run-batch``::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64}}

``url`` is ``/v1/chat/completions`` (``body.messages``, rendered with the chat template
by the caller) or ``/v1/completions`` (``body.prompt``: a string, or its token ids as
OpenAI takes them, a list of integers fed as given). Every output line is
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`` with
a ``chat.completion`` or ``text_completion`` object as the body, or ``response: null``
and an ``error`` shaped like ``openai.types.BatchError``.

Design choices:

* **One bad line never sinks the file.** ``parse_line`` returns a :class:`LineError`
  (never raises) naming ``path:line`` and the field's dotted path (``param``, e.g.
  ``body.messages[2].role``); the caller writes it as that line's error and runs the rest.
* **Strict.** An unknown key, top-level or in ``body``, is an error (a typo such as
  ``temprature`` must not silently run at the default), with a close match suggested.
  Integers reject booleans and floats (``1.5``, ``true``, ``"10"``). ``null`` reads as
  absent for every optional field, as in the OpenAI API.
* **Supported, or refused.** OpenAI fields this engine cannot honour (``n`` > 1,
  ``stream``, penalties other than 0, ``functions``,
  ``echo``, ``suffix``, ``best_of`` > 1, several prompts in one line) give code
  ``unsupported``
  rather than being ignored; ``user``, ``metadata`` and ``store`` are accepted and
  ignored. ``top_k`` (-1 or 0: off) is the vLLM extension. ``response_format``
  (``json_object``, ``json_schema``) is honoured on both endpoints, as vLLM does; the
  answer is held to it token by token (:mod:`shoestring.infer.structured`); so are
  tool calls (``tools`` with ``tool_choice`` ``"required"`` or a named function,
  :mod:`shoestring.infer.tools`). ``"auto"``, the default with tools, answers freely
  and reads calls back in the model's own syntax (:mod:`shoestring.infer.toolsyntax`).
* **Deterministic output.** Ids are sha256 digests of the job id, the line number and
  the ``custom_id``; ``created`` comes from the caller, so a resumed or re-run job writes
  byte-identical lines. Logprobs of ``-inf`` are written as ``-9999.0`` (what OpenAI
  returns) so every line stays strict JSON. Completion ``text_offset`` counts characters
  of the generated text from 0 (as vLLM does without ``echo``).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Literal

from shoestring.data.formats import MESSAGE_KEYS, parse_record
from shoestring.data.records import DataError
from shoestring.infer.sampleparams import ResponseFormat, Sampling
from shoestring.infer.tools import NO_PARAMETERS, Function, ToolUse

Endpoint = Literal["chat", "completion"]

URLS: dict[str, Endpoint] = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
LINE_KEYS = ("custom_id", "method", "url", "body")
_COMMON_KEYS = (
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "logprobs",
    "n",
    "stream",
    "stream_options",
    "user",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "response_format",
)
#: Fields that are errors (``unsupported``) unless absent or null.
_CHAT_UNSUPPORTED = (
    "functions",
    "function_call",
    "logit_bias",
    "stream_options",
)
_COMPLETION_UNSUPPORTED = ("suffix", "logit_bias", "stream_options")
BODY_KEYS: dict[Endpoint, frozenset[str]] = {
    "chat": frozenset(
        (*_COMMON_KEYS, *_CHAT_UNSUPPORTED, "messages", "max_completion_tokens")
        + ("top_logprobs", "metadata", "store", "tools", "tool_choice", "parallel_tool_calls")
    ),
    "completion": frozenset((*_COMMON_KEYS, *_COMPLETION_UNSUPPORTED, "prompt", "echo", "best_of")),
}
MAX_STOP = 4
FORMAT_TYPES = ("text", "json_object", "json_schema")
_JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")
_SCHEMA_NAME = re.compile(r"\A[A-Za-z0-9_-]{1,64}\Z")
MAX_TOOLS = 128
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")
MAX_TOP_LOGPROBS: dict[Endpoint, int] = {"chat": 20, "completion": 5}
#: What OpenAI writes for the logprob of a token of probability 0.
MIN_LOGPROB = -9999.0
_INT64 = 2**63


@dataclass(frozen=True)
class Request:
    line: int  # 1-based line number
    custom_id: str
    endpoint: Endpoint
    model: str | None
    sampling: Sampling
    prompt: str = ""  # completion endpoint
    messages: tuple[dict[str, Any], ...] | None = None  # chat endpoint
    tools: tuple[dict[str, Any], ...] | None = None  # rendered by the chat template
    tool_use: ToolUse | None = None  # the answer is tool calls (tools.py)
    prompt_ids: tuple[int, ...] | None = None  # completion endpoint: the prompt as token ids


@dataclass(frozen=True)
class LineError:
    line: int
    custom_id: str | None  # when it could be read from the line
    code: str  # "invalid_json", "invalid_request", "unsupported", "duplicate_custom_id"
    param: str | None  # dotted path of the offending field, e.g. "body.messages[2].role"
    message: str  # "in.jsonl:3: body.n: only n=1 is supported"


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    bytes: list[int]
    top: tuple[tuple[str, float, list[int]], ...] = ()  # alternatives (token, logprob, bytes)


@dataclass(frozen=True)
class Answer:
    text: str
    finish_reason: Literal["stop", "length", "tool_calls"]
    prompt_tokens: int
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] | None = None
    tool_calls: tuple[tuple[str, str], ...] = ()  # (name, arguments JSON) per call
    reasoning: str | None = None  # what a response template read as reasoning, beside calls


class _Bad(Exception):
    """One problem with a line: the field's dotted path, what is wrong, the error code."""

    def __init__(self, param: str | None, detail: str, code: str = "invalid_request") -> None:
        super().__init__(detail)
        self.param, self.detail, self.code = param, detail, code


# ---------------------------------------------------------------------------- input


def is_batch_file(first_objects: Iterable[Any]) -> bool:
    """Whether a file whose first parsed objects are these is a Batch API file."""
    return any(
        isinstance(o, dict) and o.keys() & {"custom_id", "url", "body"} for o in first_objects
    )


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}
    return names.get(type(value), "object" if isinstance(value, dict) else type(value).__name__)


def _show(value: Any) -> str:
    """A value as its JSON type and (shortened) JSON text: ``boolean true``."""
    text = json.dumps(value)
    return f"{_json_type(value)} {text if len(text) <= 40 else text[:37] + '...'}"


def _unknown_key(key: str, known: Iterable[str], where: str) -> _Bad:
    names = sorted(known)
    close = difflib.get_close_matches(key, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return _Bad(f"{where}{key}", f"unknown field {key!r} ({hint}accepted: {', '.join(names)})")


def _check_keys(obj: dict[str, Any], known: Iterable[str], where: str) -> None:
    allowed = set(known)
    for key in obj:
        if key not in allowed:
            raise _unknown_key(key, allowed, where)


def _int(body: dict[str, Any], key: str, lo: int, hi: int | None = None) -> int | None:
    """An optional integer field in ``[lo, hi]``; booleans and floats are not integers."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Bad(f"body.{key}", f"must be an integer, got {_show(value)}")
    if value < lo or (hi is not None and value > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise _Bad(f"body.{key}", f"must be {bound}, got {value}")
    return value


def _number(body: dict[str, Any], key: str, lo: float, hi: float, *, open_lo: bool) -> float:
    """An optional number in ``[lo, hi]`` (``(lo, hi]`` with ``open_lo``), 1.0 when
    absent (the OpenAI default of ``temperature`` and ``top_p``); NaN fails."""
    value = body.get(key)
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Bad(f"body.{key}", f"must be a number, got {_show(value)}")
    ok = (lo < value if open_lo else lo <= value) and value <= hi
    if not ok:
        interval = f"{'(' if open_lo else '['}{lo:g}, {hi:g}]"
        raise _Bad(f"body.{key}", f"must be in {interval}, got {value}")
    return float(value)


def _bool(body: dict[str, Any], key: str, where: str = "body.") -> bool | None:
    value = body.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise _Bad(f"{where}{key}", f"must be true or false, got {_show(value)}")


def _string(body: dict[str, Any], key: str, where: str = "body.") -> str | None:
    value = body.get(key)
    if value is None or (isinstance(value, str) and value):
        return value
    what = "an empty string" if value == "" else _show(value)
    raise _Bad(f"{where}{key}", f"must be a non-empty string, got {what}")


def _max_tokens(body: dict[str, Any], default: int) -> int:
    given = _int(body, "max_tokens", 1)
    newer = _int(body, "max_completion_tokens", 1)
    if given is not None and newer is not None and given != newer:
        raise _Bad(
            "body.max_completion_tokens",
            f"is {newer} but body.max_tokens is {given}: give one of them, or equal values",
        )
    for value in (newer, given):
        if value is not None:
            return value
    return default


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list):
        raise _Bad("body.stop", f"must be a string or a list of strings, got {_json_type(stop)}")
    if len(items) > MAX_STOP:
        raise _Bad("body.stop", f"has {len(items)} sequences; at most {MAX_STOP} are allowed")
    for i, item in enumerate(items):
        where = "body.stop" if isinstance(stop, str) else f"body.stop[{i}]"
        if not isinstance(item, str):
            raise _Bad(where, f"must be a string, got {_show(item)}")
        if not item:
            raise _Bad(where, "is an empty string (a stop sequence must not be empty)")
    return tuple(items)


def _logprobs(body: dict[str, Any], endpoint: Endpoint) -> tuple[bool, int]:
    """``(logprobs on, number of alternatives)``: chat has ``logprobs`` (bool) +
    ``top_logprobs``; legacy completions have ``logprobs`` (the number, 0..5)."""
    top_max = MAX_TOP_LOGPROBS[endpoint]
    if endpoint == "completion":
        if isinstance(body.get("logprobs"), bool):
            raise _Bad(
                "body.logprobs",
                f"must be an integer 0..{top_max} on /v1/completions (the number of top "
                f"logprobs, legacy completions API), got boolean {json.dumps(body['logprobs'])}",
            )
        count = _int(body, "logprobs", 0, top_max)
        return count is not None, count or 0
    wanted = _bool(body, "logprobs") or False
    top = _int(body, "top_logprobs", 0, top_max)
    if top is not None and not wanted:
        raise _Bad("body.top_logprobs", "needs body.logprobs set to true")
    return wanted, top or 0


def _fixed(body: dict[str, Any], key: str, allowed: Any, why: str) -> None:
    """A field this engine supports at one value only (``n`` 1, ``stream`` false, ...)."""
    value = body.get(key)
    if value is None:
        return
    if isinstance(allowed, bool):
        got_type = isinstance(value, bool)
        kind = "true or false"
    elif isinstance(allowed, int):
        got_type = isinstance(value, int) and not isinstance(value, bool)
        kind = "an integer"
    else:
        got_type = isinstance(value, (int, float)) and not isinstance(value, bool)
        kind = "a number"
    if not got_type:
        raise _Bad(f"body.{key}", f"must be {kind}, got {_show(value)}")
    if value != allowed:
        shown = f"{allowed:g}" if isinstance(allowed, float) else json.dumps(allowed)
        raise _Bad(f"body.{key}", f"only {key}={shown} is supported ({why})", "unsupported")


def _unsupported(body: dict[str, Any], endpoint: Endpoint) -> None:
    _fixed(body, "n", 1, "one choice per line: repeat the line with another custom_id")
    _fixed(body, "stream", False, "a batch writes whole answers")
    for key in ("frequency_penalty", "presence_penalty"):
        _fixed(body, key, 0.0, "penalties are not implemented")
    if endpoint == "completion":
        _fixed(body, "echo", False, "the prompt is not repeated in the answer")
        _fixed(body, "best_of", 1, "one sample per line")
    keys = _CHAT_UNSUPPORTED if endpoint == "chat" else _COMPLETION_UNSUPPORTED
    for key in keys:
        if body.get(key) is not None:
            raise _Bad(
                f"body.{key}", f"{key!r} is not supported by shoestring infer", "unsupported"
            )
    _bool(body, "store")
    _string(body, "user")
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise _Bad("body.metadata", f"must be an object, got {_json_type(body['metadata'])}")


def _response_format(body: dict[str, Any]) -> ResponseFormat | None:
    """``response_format``: ``{"type": "text"}`` (free text, as when absent),
    ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name",
    "schema", "description", "strict"}}``. Whether the schema itself compiles is
    checked later, with the tokenizer (:mod:`shoestring.infer.structured`)."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    where = "body.response_format"
    if not isinstance(fmt, dict):
        raise _Bad(where, f"must be an object, got {_json_type(fmt)}")
    kind = fmt.get("type")
    if kind not in FORMAT_TYPES:
        got = "missing" if kind is None else f"got {_show(kind)}"
        raise _Bad(f"{where}.type", f"must be one of {', '.join(FORMAT_TYPES)} ({got})")
    _check_keys(fmt, ("type", "json_schema") if kind == "json_schema" else ("type",), f"{where}.")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    return _json_schema(fmt.get("json_schema"), f"{where}.json_schema")


def _json_schema(spec: Any, where: str) -> ResponseFormat:
    if not isinstance(spec, dict):
        got = "missing" if spec is None else f"got {_json_type(spec)}"
        raise _Bad(where, f"must be an object with 'name' and 'schema' ({got})")
    _check_keys(spec, _JSON_SCHEMA_KEYS, f"{where}.")
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
        got = "missing" if name is None else f"got {_show(name)}"
        raise _Bad(f"{where}.name", f"must be 1-64 of a-z, A-Z, 0-9, _ and - ({got})")
    schema = spec.get("schema", {})  # absent: any JSON value
    if not isinstance(schema, dict):
        raise _Bad(f"{where}.schema", f"must be a JSON Schema object, got {_json_type(schema)}")
    _string(spec, "description", f"{where}.")
    _bool(spec, "strict", f"{where}.")
    return ResponseFormat.of_schema(schema, name)


def _tools(body: dict[str, Any]) -> tuple[tuple[dict[str, Any], ...] | None, ToolUse | None]:
    """``tools`` (rendered into the prompt) and how the answer must call them:
    ``tool_choice`` ``"none"`` (a text answer), ``"auto"`` (the default: text or calls,
    the model's choice), ``"required"`` or a named function (tool calls,
    :mod:`shoestring.infer.tools`)."""
    tools = body.get("tools")
    if tools is None:
        if body.get("tool_choice") is not None:
            raise _Bad("body.tool_choice", "needs body.tools")
        return None, None
    if not isinstance(tools, list) or not tools:
        raise _Bad("body.tools", "must be a non-empty list of tools")
    if len(tools) > MAX_TOOLS:
        raise _Bad("body.tools", f"has {len(tools)} tools; at most {MAX_TOOLS} are allowed")
    functions = [_function(t, f"body.tools[{i}]") for i, t in enumerate(tools)]
    names = [f.name for f in functions]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise _Bad(f"body.tools[{i}].function.name", f"{name!r} is given twice")
    parallel = _bool(body, "parallel_tool_calls") is not False
    given = body.get("tool_choice")
    choice = _tool_choice("auto" if given is None else given, functions)
    if choice == "none":
        return tuple(tools), None
    if isinstance(choice, Function):
        return tuple(tools), ToolUse("named", (choice,), parallel)
    return tuple(tools), ToolUse(choice, tuple(functions), parallel)


def _function(tool: Any, where: str) -> Function:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise _Bad(f"{where}.type", 'must be "function" (the only kind of tool)')
    _check_keys(tool, ("type", "function"), f"{where}.")
    spec = tool.get("function")
    if not isinstance(spec, dict):
        raise _Bad(f"{where}.function", f"must be an object, got {_json_type(spec)}")
    _check_keys(spec, _FUNCTION_KEYS, f"{where}.function.")
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
        got = "missing" if name is None else f"got {_show(name)}"
        raise _Bad(f"{where}.function.name", f"must be 1-64 of a-z, A-Z, 0-9, _ and - ({got})")
    params = spec.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise _Bad(
            f"{where}.function.parameters",
            f"must be a JSON Schema object, got {_json_type(params)}",
        )
    _string(spec, "description", f"{where}.function.")
    _bool(spec, "strict", f"{where}.function.")
    return Function(name, NO_PARAMETERS if params is None else json.dumps(params))


def _tool_choice(
    choice: Any, functions: list[Function]
) -> Literal["none", "auto", "required"] | Function:
    """``"none"``, ``"auto"``, ``"required"`` or the named :class:`Function`."""
    where = "body.tool_choice"
    if choice in ("none", "auto", "required"):
        return choice  # type: ignore[no-any-return]
    if not isinstance(choice, dict) or choice.get("type") != "function":
        raise _Bad(
            where,
            'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        )
    _check_keys(choice, ("type", "function"), f"{where}.")
    spec = choice.get("function")
    name = spec.get("name") if isinstance(spec, dict) else None
    named = [f for f in functions if f.name == name]
    if not named:
        known = ", ".join(f.name for f in functions)
        raise _Bad(
            f"{where}.function.name",
            f"names no tool of body.tools (got {_show(name)}; tools: {known})",
        )
    return named[0]


def _sampling(body: dict[str, Any], endpoint: Endpoint, default_max_tokens: int) -> Sampling:
    _unsupported(body, endpoint)
    top_k = _int(body, "top_k", -1)
    logprobs, top_logprobs = _logprobs(body, endpoint)
    return Sampling(
        max_tokens=_max_tokens(body, default_max_tokens),
        temperature=_number(body, "temperature", 0.0, 2.0, open_lo=False),
        top_p=_number(body, "top_p", 0.0, 1.0, open_lo=True),
        top_k=max(top_k or 0, 0),
        seed=_int(body, "seed", -_INT64, _INT64 - 1),
        stop=_stop(body),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        response_format=_response_format(body),
    )


_MESSAGE_ERROR = re.compile(r"\Abody\.messages: message (\d+): (.*)\Z", re.DOTALL)


def _message_error(error: DataError) -> _Bad:
    """``parse_record``'s ``message 3: unknown role ...`` as ``body.messages[2].role``."""
    text = str(error)
    match = _MESSAGE_ERROR.match(text)
    if match is None:
        return _Bad("body.messages", text.removeprefix("body.messages: "))
    index, detail = int(match[1]) - 1, match[2]
    quoted = [k for k in re.findall(r"'(\w+)'", detail) if k in MESSAGE_KEYS]
    field = "role" if detail.startswith("unknown role") else (quoted[0] if quoted else None)
    return _Bad(f"body.messages[{index}]" + (f".{field}" if field else ""), detail)


def _messages(body: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    messages = body.get("messages")
    if messages is None:
        raise _Bad("body.messages", "missing: a chat request needs a 'messages' list")
    if not isinstance(messages, list):
        raise _Bad("body.messages", f"must be a list of messages, got {_json_type(messages)}")
    if not messages:
        raise _Bad("body.messages", "is empty: a chat request needs at least one message")
    try:
        record = parse_record({"messages": messages}, "body.messages", "messages")
    except DataError as e:
        raise _message_error(e) from None
    assert record.messages is not None
    return record.messages


def _prompt(body: dict[str, Any]) -> str | tuple[int, ...]:
    """A prompt string, or one prompt's token ids (fed as given, no specials added)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if prompt is None:
        raise _Bad("body.prompt", "missing: a completion request needs a 'prompt' string")
    if not isinstance(prompt, list):
        raise _Bad(
            "body.prompt", f"must be a string or a list of token ids, got {_json_type(prompt)}"
        )
    if any(isinstance(x, (str, list)) for x in prompt):
        raise _Bad(
            "body.prompt",
            "several prompts in one line are not supported: one prompt per line",
            "unsupported",
        )
    for i, x in enumerate(prompt):
        if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < _INT64:
            raise _Bad(f"body.prompt[{i}]", f"a token id must be an integer >= 0, got {_show(x)}")
    if not prompt:
        raise _Bad("body.prompt", "an empty list of token ids")
    return tuple(prompt)


def _endpoint(obj: dict[str, Any]) -> Endpoint:
    method = obj.get("method")
    if method != "POST":
        got = "missing" if method is None else f"got {_show(method)}"
        raise _Bad("method", f'must be "POST" ({got})')
    url = obj.get("url")
    if not isinstance(url, str) or url not in URLS:
        got = "missing" if url is None else f"got {_show(url)}"
        raise _Bad("url", f"must be one of {', '.join(URLS)} ({got})", "invalid_request")
    return URLS[url]


def _custom_id(obj: dict[str, Any]) -> str:
    if obj.get("custom_id") is None:
        raise _Bad("custom_id", "missing: every line needs a unique 'custom_id' string")
    value = _string(obj, "custom_id", where="")
    assert value is not None
    return value


def _request(obj: Any, line: int, default_max_tokens: int) -> Request:
    if not isinstance(obj, dict):
        raise _Bad(None, f"expected a JSON object, got {_json_type(obj)}")
    custom_id = _custom_id(obj)
    _check_keys(obj, LINE_KEYS, "")
    endpoint = _endpoint(obj)
    body = obj.get("body")
    if not isinstance(body, dict):
        what = "missing" if body is None else f"must be an object, got {_json_type(body)}"
        raise _Bad("body", what)
    _check_keys(body, BODY_KEYS[endpoint], "body.")
    model = _string(body, "model")
    chat = endpoint == "chat"
    messages = _messages(body) if chat else None
    prompt = "" if chat else _prompt(body)
    ids = prompt if isinstance(prompt, tuple) else None
    sampling = _sampling(body, endpoint, default_max_tokens)
    tools, use = _tools(body) if chat else (None, None)
    if use is not None and sampling.response_format is not None:
        raise _Bad("body.response_format", *_format_with_tools(use))
    if use is not None and use.mode != "auto":
        sampling = replace(sampling, response_format=use.response_format())
    text = prompt if isinstance(prompt, str) else ""
    return Request(line, custom_id, endpoint, model, sampling, text, messages, tools, use, ids)


def _format_with_tools(use: ToolUse) -> tuple[str, str]:
    """Why a ``response_format`` cannot go with these tools, and the error's code."""
    if use.mode != "auto":
        return "cannot go with a tool_choice that calls a tool", "invalid_request"
    why = (
        "cannot go with tool_choice 'auto' (the default with tools): an answer held to "
        'the format could not call a tool; use tool_choice "none" for a held text answer'
    )
    return why, "unsupported"


def _decode(raw: bytes, line: int) -> Any:
    if line == 1:
        raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise _Bad(None, f"not valid UTF-8 (byte {e.start})", "invalid_json") from None
    except json.JSONDecodeError as e:
        raise _Bad(None, f"not valid JSON: {e.msg} (column {e.colno})", "invalid_json") from None


def parse_line(raw: bytes, line: int, path: str, default_max_tokens: int) -> Request | LineError:
    """One line of a Batch API file: a :class:`Request`, or the :class:`LineError` saying
    why not (``path:line``, the field, what is wrong). Never raises on bad input."""
    custom_id: str | None = None
    try:
        obj = _decode(raw, line)
        if isinstance(obj, dict) and isinstance(obj.get("custom_id"), str):
            custom_id = obj["custom_id"]
        return _request(obj, line, default_max_tokens)
    except _Bad as bad:
        where = f"{path}:{line}: " + (f"{bad.param}: " if bad.param else "")
        return LineError(line, custom_id, bad.code, bad.param, where + bad.detail)


def read_batch(data: bytes, path: str, default_max_tokens: int) -> list[Request | LineError]:
    """Every non-blank line of ``data``, in order. A ``custom_id`` seen on an earlier line
    (valid or not) makes the later line a ``duplicate_custom_id`` error."""
    out: list[Request | LineError] = []
    first_seen: dict[str, int] = {}
    for n, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        item = parse_line(raw, n, path, default_max_tokens)
        cid = item.custom_id
        if cid is not None and cid in first_seen:
            message = f"{path}:{n}: custom_id: {cid!r} already used on line {first_seen[cid]}"
            item = LineError(n, cid, "duplicate_custom_id", "custom_id", message)
        elif cid is not None:
            first_seen[cid] = n
        out.append(item)
    return out


# --------------------------------------------------------------------------- output


def _digest(kind: str, job_id: str, line: int, custom_id: str | None) -> str:
    """32 hex digits naming one output object; the same inputs give the same id."""
    key = json.dumps([kind, job_id, line, custom_id])
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def _chat_logprobs(tokens: tuple[TokenLogprob, ...]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": t.token,
                "logprob": _logprob(t.logprob),
                "bytes": list(t.bytes),
                "top_logprobs": [
                    {"token": tok, "logprob": _logprob(lp), "bytes": list(b)}
                    for tok, lp, b in t.top
                ],
            }
            for t in tokens
        ]
    }


def _completion_logprobs(tokens: tuple[TokenLogprob, ...]) -> dict[str, Any]:
    """The legacy shape: parallel lists; ``top_logprobs`` maps token text to logprob
    (two alternatives decoding to the same text keep the first, the likelier)."""
    offsets, offset = [], 0
    for t in tokens:
        offsets.append(offset)
        offset += len(t.token)
    tops = []
    for t in tokens:
        top: dict[str, float] = {}
        for tok, lp, _ in t.top:
            top.setdefault(tok, _logprob(lp))
        tops.append(top)
    return {
        "tokens": [t.token for t in tokens],
        "token_logprobs": [_logprob(t.logprob) for t in tokens],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _message(req: Request, ans: Answer, job_id: str) -> dict[str, Any]:
    """The assistant's message: its text, or its tool calls (ids derived like the rest)
    with the text beside them (``"auto"``) and the reasoning a response template reads
    apart (``reasoning_content``, as vLLM and DeepSeek name it)."""
    if not ans.tool_calls:
        return {"role": "assistant", "content": ans.text}
    calls = [
        {
            "id": "call_" + _digest(f"tool_call:{k}", job_id, req.line, req.custom_id)[:24],
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        for k, (name, arguments) in enumerate(ans.tool_calls)
    ]
    message = {"role": "assistant", "content": ans.text or None, "tool_calls": calls}
    if ans.reasoning is not None:
        message["reasoning_content"] = ans.reasoning
    return message


def _choice(req: Request, ans: Answer, job_id: str) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0}
    if req.endpoint == "chat":
        choice["message"] = _message(req, ans, job_id)
        logprobs = _chat_logprobs(ans.logprobs) if ans.logprobs is not None else None
    else:
        choice["text"] = ans.text
        logprobs = _completion_logprobs(ans.logprobs) if ans.logprobs is not None else None
    choice["finish_reason"] = ans.finish_reason
    choice["logprobs"] = logprobs
    return choice


def answer_line(
    req: Request, ans: Answer, *, job_id: str, model: str, created: int
) -> dict[str, Any]:
    """The output line of a request that ran: a ``chat.completion`` body for chat
    requests, a ``text_completion`` one for completions. ``ans.logprobs`` (set by the
    caller when the request asked for them) fills ``choices[0].logprobs``."""
    chat = req.endpoint == "chat"
    prefix, kind = ("chatcmpl-", "chat.completion") if chat else ("cmpl-", "text_completion")
    body = {
        "id": prefix + _digest("body", job_id, req.line, req.custom_id),
        "object": kind,
        "created": created,
        "model": req.model if req.model is not None else model,
        "choices": [_choice(req, ans, job_id)],
        "usage": {
            "prompt_tokens": ans.prompt_tokens,
            "completion_tokens": ans.completion_tokens,
            "total_tokens": ans.prompt_tokens + ans.completion_tokens,
        },
    }
    return {
        "id": "batch_req_" + _digest("batch_req", job_id, req.line, req.custom_id),
        "custom_id": req.custom_id,
        "response": {
            "status_code": 200,
            "request_id": _digest("request", job_id, req.line, req.custom_id),
            "body": body,
        },
        "error": None,
    }


def error_line(err: LineError, *, job_id: str) -> dict[str, Any]:
    """The output line of a request that could not run (``openai.types.BatchError``)."""
    return {
        "id": "batch_req_" + _digest("batch_req", job_id, err.line, err.custom_id),
        "custom_id": err.custom_id,
        "response": None,
        "error": {"code": err.code, "message": err.message, "param": err.param, "line": err.line},
    }
