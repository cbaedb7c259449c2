"""OpenAI Batch API files: strict per-line parsing, and output lines the openai types accept."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types import BatchError, Completion, CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionMessage, ChatCompletionTokenLogprob
from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
from openai.types.chat.chat_completion_token_logprob import TopLogprob
from openai.types.completion_choice import Logprobs
from pydantic import BaseModel

from shoestring.infer.batchapi import (
    Answer,
    LineError,
    Request,
    Sampling,
    TokenLogprob,
    answer_line,
    error_line,
    is_batch_file,
    parse_line,
    read_batch,
)
from shoestring.infer.sampleparams import ResponseFormat

PATH = "in.jsonl"
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
CHAT_URL = "/v1/chat/completions"
COMPLETION_URL = "/v1/completions"
HELLO = [{"role": "user", "content": "Hello"}]


def chat(custom_id: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT_URL,
        "body": {"messages": HELLO, **body},
    }


def completion(custom_id: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": COMPLETION_URL,
        "body": {"prompt": "Once upon", **body},
    }


def without(obj: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k != key}


def parse(obj: Any, default_max_tokens: int = 16) -> Request | LineError:
    raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return parse_line(raw, 1, PATH, default_max_tokens)


# --------------------------------------------------------------------------- valid input


def test_chat_line_with_every_field() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    body = {
        "model": "my-model",
        "messages": messages,
        "max_completion_tokens": 40,
        "max_tokens": 40,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 50,
        "seed": 1234,
        "stop": ["\n\n", "END"],
        "logprobs": True,
        "top_logprobs": 5,
        "n": 1,
        "stream": False,
        "user": "u1",
        "metadata": {"k": "v"},
        "store": False,
        "frequency_penalty": 0,
        "presence_penalty": 0.0,
        "tools": None,
        "response_format": None,
    }
    line = {"custom_id": "c1", "method": "POST", "url": CHAT_URL, "body": body}
    req = parse(line)
    assert req == Request(
        line=1,
        custom_id="c1",
        endpoint="chat",
        model="my-model",
        sampling=Sampling(
            max_tokens=40,
            temperature=0.7,
            top_p=0.9,
            top_k=50,
            seed=1234,
            stop=("\n\n", "END"),
            logprobs=True,
            top_logprobs=5,
        ),
        prompt="",
        messages=tuple(messages),
    )


def test_completion_line_with_every_field() -> None:
    body = {
        "model": "m",
        "prompt": "Once upon",
        "max_tokens": 8,
        "temperature": 0,
        "top_p": 1,
        "top_k": -1,
        "seed": -3,
        "stop": "\n",
        "logprobs": 3,
        "n": 1,
        "stream": False,
        "echo": False,
        "best_of": 1,
        "suffix": None,
        "user": "u",
        "frequency_penalty": 0,
        "presence_penalty": 0,
    }
    req = parse({"custom_id": "p1", "method": "POST", "url": COMPLETION_URL, "body": body})
    assert req == Request(
        line=1,
        custom_id="p1",
        endpoint="completion",
        model="m",
        sampling=Sampling(
            max_tokens=8,
            temperature=0.0,
            top_p=1.0,
            top_k=0,
            seed=-3,
            stop=("\n",),
            logprobs=True,
            top_logprobs=3,
        ),
        prompt="Once upon",
        messages=None,
    )
    assert isinstance(req.sampling.temperature, float)


def test_response_formats_are_read_on_both_endpoints() -> None:
    schema = {"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "string"}}}
    spec = {"name": "pair", "description": "two fields", "schema": schema, "strict": True}
    held = parse(chat("a", response_format={"type": "json_schema", "json_schema": spec}))
    assert isinstance(held, Request)
    fmt = held.sampling.response_format
    assert fmt == ResponseFormat("json_schema", json.dumps(schema), "pair")
    assert list(json.loads(fmt.schema)["properties"]) == ["z", "a"]  # the answer's key order
    obj = parse(completion("b", response_format={"type": "json_object"}))  # as vLLM accepts
    assert isinstance(obj, Request) and obj.sampling.response_format == ResponseFormat(
        "json_object"
    )
    anything = parse(
        chat("c", response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    )
    assert isinstance(anything, Request) and anything.sampling.response_format is not None
    assert json.loads(anything.sampling.response_format.schema) == {}  # any JSON value
    text = parse(chat("d", response_format={"type": "text"}))
    assert isinstance(text, Request) and text.sampling == Sampling(max_tokens=16)


def test_tools_let_the_model_choose_unless_tool_choice_says() -> None:
    """OpenAI's default with tools is "auto": a free answer (no format held), read back
    in the model's own syntax later; "required" holds the answer to the calls' schema."""
    for req in (parse(chat("a", tools=[TOOL])), parse(chat("b", tools=[TOOL], tool_choice="auto"))):
        assert isinstance(req, Request) and req.tool_use is not None
        assert req.tool_use.mode == "auto" and req.sampling.response_format is None
        assert [f.name for f in req.tool_use.functions] == ["lookup"]
    held = parse(chat("c", tools=[TOOL], tool_choice="required", parallel_tool_calls=False))
    assert isinstance(held, Request) and held.tool_use is not None
    assert held.tool_use.mode == "required" and not held.tool_use.parallel
    assert held.sampling.response_format is not None
    text = parse(chat("d", tools=[TOOL], tool_choice="none"))
    assert isinstance(text, Request) and text.tool_use is None and text.tools is not None


def test_a_completion_prompt_may_be_its_token_ids() -> None:
    req = parse(completion("ids", prompt=[17, 0, 42]))
    assert isinstance(req, Request)
    assert (req.prompt, req.prompt_ids) == ("", (17, 0, 42))
    text = parse(completion("text"))
    assert isinstance(text, Request) and text.prompt_ids is None


def test_defaults_follow_openai() -> None:
    req = parse(chat("a"), default_max_tokens=77)
    assert isinstance(req, Request)
    assert req.model is None
    assert req.sampling == Sampling(max_tokens=77)
    assert req.sampling.temperature == 1.0 and req.sampling.top_p == 1.0
    assert req.sampling.top_k == 0 and req.sampling.seed is None and req.sampling.stop == ()
    assert not req.sampling.logprobs and req.sampling.top_logprobs == 0
    # null reads as absent; max_completion_tokens alone is the limit; logprobs=0 on
    # completions means "logprobs of the chosen tokens, no alternatives".
    nulls = parse(chat("b", temperature=None, top_p=None, stop=None, max_tokens=None, model=None))
    assert isinstance(nulls, Request) and nulls.sampling == Sampling(max_tokens=16)
    newer = parse(chat("c", max_completion_tokens=5))
    assert isinstance(newer, Request) and newer.sampling.max_tokens == 5
    zero = parse(completion("d", logprobs=0))
    assert isinstance(zero, Request) and zero.sampling.logprobs and zero.sampling.top_logprobs == 0
    none = parse(completion("e", logprobs=None))
    assert isinstance(none, Request) and not none.sampling.logprobs


def test_messages_keep_only_message_keys_and_a_bom_is_skipped() -> None:
    obj = chat("a", messages=[{"role": "user", "content": "x", "extra": 1}])
    req = parse(b"\xef\xbb\xbf" + json.dumps(obj).encode())
    assert isinstance(req, Request)
    assert req.messages == ({"role": "user", "content": "x"},)


def test_is_batch_file() -> None:
    assert is_batch_file([chat("a")])
    assert is_batch_file([{"prompt": "x"}, {"custom_id": "a"}])
    assert is_batch_file([{"body": {}}]) and is_batch_file([{"url": "/v1/completions"}])
    assert not is_batch_file([{"prompt": "x"}, {"messages": HELLO}])
    assert not is_batch_file([[1], "custom_id", None])
    assert not is_batch_file([])


# ------------------------------------------------------------------------- malformed input

NAN_TEMPERATURE = json.dumps(chat("nan")).replace('"messages"', '"temperature": NaN, "messages"')

#: (line, param, code, text the message must contain); a bytes line is written as is.
BAD: list[tuple[Any, str | None, str, str]] = [
    (b'{"custom_id": "j1", "method": ', None, "invalid_json", "not valid JSON"),
    (b'{"custom_id": "\xff"}', None, "invalid_json", "not valid UTF-8"),
    ([1, 2], None, "invalid_request", "expected a JSON object, got array"),
    (without(chat("x"), "custom_id"), "custom_id", "invalid_request", "missing"),
    ({**chat("x"), "custom_id": 7}, "custom_id", "invalid_request", "non-empty string"),
    ({**chat("x"), "custom_id": ""}, "custom_id", "invalid_request", "empty string"),
    (chat("first"), "custom_id", "duplicate_custom_id", "'first' already used on line "),
    (without(chat("nb"), "body"), "body", "invalid_request", "missing"),
    ({**chat("bs"), "body": "hello"}, "body", "invalid_request", "must be an object"),
    ({**chat("m"), "method": "GET"}, "method", "invalid_request", 'string "GET"'),
    (without(chat("m2"), "method"), "method", "invalid_request", "missing"),
    ({**chat("u"), "url": "/v1/embeddings"}, "url", "invalid_request", "/v1/embeddings"),
    ({**chat("k"), "metadata": {}}, "metadata", "invalid_request", "unknown field 'metadata'"),
    (
        {**chat("nm"), "body": {"max_tokens": 3}},
        "body.messages",
        "invalid_request",
        "missing",
    ),
    (chat("em", messages=[]), "body.messages", "invalid_request", "is empty"),
    (chat("ms", messages="hi"), "body.messages", "invalid_request", "must be a list"),
    (
        chat("role", messages=[*HELLO, {"role": "asistant", "content": "x"}]),
        "body.messages[1].role",
        "invalid_request",
        "unknown role 'asistant'",
    ),
    (
        chat("cnt", messages=[{"role": "user", "content": [{"type": "text", "text": "x"}]}]),
        "body.messages[0].content",
        "invalid_request",
        "'content' must be a string, got list",
    ),
    (chat("mo", messages=["hi"]), "body.messages[0]", "invalid_request", "expected an object"),
    (chat("neg", max_tokens=-5), "body.max_tokens", "invalid_request", "at least 1"),
    (chat("zero", max_tokens=0), "body.max_tokens", "invalid_request", "at least 1"),
    (chat("flt", max_tokens=1.5), "body.max_tokens", "invalid_request", "integer"),
    (chat("str", max_tokens="10"), "body.max_tokens", "invalid_request", "integer"),
    (chat("bool", max_tokens=True), "body.max_tokens", "invalid_request", "got boolean"),
    (
        chat("conf", max_tokens=10, max_completion_tokens=20),
        "body.max_completion_tokens",
        "invalid_request",
        "body.max_tokens is 10",
    ),
    (chat("temp", temperature=2.5), "body.temperature", "invalid_request", "[0, 2]"),
    (NAN_TEMPERATURE.encode(), "body.temperature", "invalid_request", "nan"),
    (chat("tp", top_p=0), "body.top_p", "invalid_request", "(0, 1]"),
    (chat("tk", top_k=-2), "body.top_k", "invalid_request", "at least -1"),
    (chat("seed", seed=True), "body.seed", "invalid_request", "got boolean"),
    (chat("n2", n=2), "body.n", "unsupported", "only n=1 is supported"),
    (chat("nb2", n=True), "body.n", "invalid_request", "integer"),
    (chat("st", stream=True), "body.stream", "unsupported", "stream=false"),
    (
        chat("tarf", tools=[TOOL], response_format={"type": "json_object"}),
        "body.response_format",
        "unsupported",
        "tool_choice 'auto' (the default",
    ),
    (
        chat("tt", tools=[{"type": "retrieval"}]),
        "body.tools[0].type",
        "invalid_request",
        "function",
    ),
    (
        chat("tn", tools=[{"type": "function", "function": {"name": "a b"}}], tool_choice="none"),
        "body.tools[0].function.name",
        "invalid_request",
        "a-z, A-Z",
    ),
    (
        chat("t2", tools=[TOOL, TOOL], tool_choice="required"),
        "body.tools[1].function.name",
        "invalid_request",
        "given twice",
    ),
    (
        chat("tc0", tool_choice="required"),
        "body.tool_choice",
        "invalid_request",
        "needs body.tools",
    ),
    (
        chat("tcn", tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),
        "body.tool_choice.function.name",
        "invalid_request",
        "tools: lookup",
    ),
    (
        chat("tcx", tools=[TOOL], tool_choice="always"),
        "body.tool_choice",
        "invalid_request",
        '"none", "auto", "required"',
    ),
    (
        chat("trf", tools=[TOOL], tool_choice="required", response_format={"type": "json_object"}),
        "body.response_format",
        "invalid_request",
        "cannot go with a tool_choice",
    ),
    (chat("fn", functions=[{"name": "f"}]), "body.functions", "unsupported", "'functions'"),
    (
        chat("rf", response_format={"type": "json"}),
        "body.response_format.type",
        "invalid_request",
        "must be one of text, json_object, json_schema",
    ),
    (chat("rf0", response_format="json"), "body.response_format", "invalid_request", "an object"),
    (
        chat("rf1", response_format={"type": "json_schema"}),
        "body.response_format.json_schema",
        "invalid_request",
        "'name' and 'schema' (missing)",
    ),
    (
        chat("rf2", response_format={"type": "json_schema", "json_schema": {"name": "a b"}}),
        "body.response_format.json_schema.name",
        "invalid_request",
        "a-z, A-Z, 0-9",
    ),
    (
        chat(
            "rf3",
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}},
        ),
        "body.response_format.json_schema.schema",
        "invalid_request",
        "got array",
    ),
    (
        chat(
            "rf4",
            response_format={"type": "json_schema", "json_schema": {"name": "a", "strict": "yes"}},
        ),
        "body.response_format.json_schema.strict",
        "invalid_request",
        "true or false",
    ),
    (
        chat("rf5", response_format={"type": "json_object", "json_schema": {}}),
        "body.response_format.json_schema",
        "invalid_request",
        "unknown field",
    ),
    (chat("fp", frequency_penalty=0.5), "body.frequency_penalty", "unsupported", ""),
    (
        chat("typo", temprature=0.5),
        "body.temprature",
        "invalid_request",
        "did you mean 'temperature'?",
    ),
    (chat("s5", stop=list("abcde")), "body.stop", "invalid_request", "at most 4"),
    (chat("se", stop=["a", ""]), "body.stop[1]", "invalid_request", "empty"),
    (chat("si", stop=["a", 3]), "body.stop[1]", "invalid_request", "got integer"),
    (chat("tl", top_logprobs=2), "body.top_logprobs", "invalid_request", "logprobs set to true"),
    (
        chat("tl21", logprobs=True, top_logprobs=21),
        "body.top_logprobs",
        "invalid_request",
        "between 0 and 20",
    ),
    (completion("pl", prompt=["a", "b"]), "body.prompt", "unsupported", "several prompts"),
    (completion("pll", prompt=[[1], [2]]), "body.prompt", "unsupported", "several prompts"),
    (completion("pn", prompt=[5, -1]), "body.prompt[1]", "invalid_request", "integer >= 0"),
    (completion("pb", prompt=[5, True]), "body.prompt[1]", "invalid_request", "integer >= 0"),
    (completion("pe", prompt=[]), "body.prompt", "invalid_request", "empty list"),
    (completion("po", prompt={"a": 1}), "body.prompt", "invalid_request", "list of token ids"),
    (without(completion("pm"), "body") | {"body": {}}, "body.prompt", "invalid_request", "missing"),
    (completion("lb", logprobs=True), "body.logprobs", "invalid_request", "got boolean"),
    (completion("l6", logprobs=6), "body.logprobs", "invalid_request", "between 0 and 5"),
    (completion("echo", echo=True), "body.echo", "unsupported", ""),
    (completion("bo", best_of=3), "body.best_of", "unsupported", ""),
    (completion("sfx", suffix="end"), "body.suffix", "unsupported", ""),
    (
        completion("mct", max_completion_tokens=5),
        "body.max_completion_tokens",
        "invalid_request",
        "unknown field",
    ),
    (chat("cl", logprobs=3), "body.logprobs", "invalid_request", "true or false"),
    (chat("md", model=""), "body.model", "invalid_request", "empty string"),
]


def _batch_file() -> tuple[bytes, list[tuple[int, Any, str | None, str, str]]]:
    """Each bad line between two valid ones (and some blank lines); the bad lines' numbers."""
    lines = [json.dumps(chat("first")), ""]
    expected = []
    for i, (obj, param, code, text) in enumerate(BAD):
        raw = obj.decode("utf-8", "surrogateescape") if isinstance(obj, bytes) else json.dumps(obj)
        lines.append(raw)
        expected.append((len(lines), obj, param, code, text))
        good = completion(f"ok{i}") if i % 2 else chat(f"ok{i}", max_tokens=i + 1)
        lines.append(json.dumps(good))
        if i % 5 == 0:
            lines.append("   ")
    data = "\n".join(lines).encode("utf-8", "surrogateescape") + b"\n"
    return data, expected


def test_every_malformed_line_gives_one_error_and_the_rest_parse() -> None:
    assert len({(p, c, t) for _, p, c, t in BAD}) >= 20
    data, expected = _batch_file()
    items = read_batch(data, PATH, 16)
    errors = {item.line: item for item in items if isinstance(item, LineError)}
    assert sorted(errors) == [n for n, *_ in expected]
    for n, obj, param, code, text in expected:
        err = errors[n]
        assert (err.line, err.param, err.code) == (n, param, code), err
        assert err.message.startswith(f"{PATH}:{n}: " + (f"{param}: " if param else "")), err
        assert text in err.message, err
        if isinstance(obj, dict) and isinstance(obj.get("custom_id"), str) and obj["custom_id"]:
            assert err.custom_id == obj["custom_id"]
    requests = [item for item in items if isinstance(item, Request)]
    assert [r.custom_id for r in requests] == ["first"] + [f"ok{i}" for i in range(len(BAD))]
    assert [r.line for r in requests] == sorted(r.line for r in requests)
    assert len(items) == len(requests) + len(errors)


def test_duplicates_of_an_erroneous_line_and_repeats_name_the_first_line() -> None:
    lines = [chat("a", n=2), chat("a"), chat("b"), chat("b"), chat("b")]
    data = "\n".join(json.dumps(x) for x in lines).encode()
    items = read_batch(data, PATH, 16)
    assert [type(i).__name__ for i in items] == [
        "LineError",
        "LineError",
        "Request",
        "LineError",
        "LineError",
    ]
    dups = [i for i in items if isinstance(i, LineError) and i.code == "duplicate_custom_id"]
    assert [(d.line, d.custom_id) for d in dups] == [(2, "a"), (4, "b"), (5, "b")]
    assert dups[0].message == f"{PATH}:2: custom_id: 'a' already used on line 1"
    assert dups[2].message.endswith("already used on line 3")


def test_messages_errors_read_like_the_field_path() -> None:
    err = parse(chat("r", messages=[*HELLO, *HELLO, {"role": "asistant", "content": "x"}]))
    assert isinstance(err, LineError)
    assert err.message.startswith(f"{PATH}:1: body.messages[2].role: unknown role 'asistant'")
    err = parse(chat("t", messages=[{"role": "user", "content": "x", "tool_calls": []}]))
    assert isinstance(err, LineError) and err.param == "body.messages[0].tool_calls"


# --------------------------------------------------------------------------- output lines


def _logprobs(n: int) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(
            token=f"t{i}",
            logprob=-0.5 * i,
            bytes=list(f"t{i}".encode()),
            top=((f"t{i}", -0.5 * i, list(f"t{i}".encode())), ("x", float("-inf"), [120])),
        )
        for i in range(n)
    )


def _keys_declared(emitted: dict[str, Any], model: type[BaseModel]) -> None:
    extra = set(emitted) - set(model.model_fields)
    assert not extra, f"{model.__name__} declares no {sorted(extra)}"


def _roundtrip(line: dict[str, Any]) -> dict[str, Any]:
    text = json.dumps(line, allow_nan=False)
    assert "\n" not in text
    back: dict[str, Any] = json.loads(text)
    assert back == line
    return back


def _request(obj: dict[str, Any]) -> Request:
    req = parse(obj)
    assert isinstance(req, Request)
    return req


ANSWERS = [
    Answer("Hi there", "stop", 7, 3),
    Answer("Hi the", "length", 7, 2, _logprobs(2)),
    Answer("", "stop", 4, 0, ()),
]


@pytest.mark.parametrize("ans", ANSWERS)
def test_chat_answer_line_validates(ans: Answer) -> None:
    req = _request(chat("c1", logprobs=ans.logprobs is not None))
    line = _roundtrip(answer_line(req, ans, job_id="job", model="base", created=1700))
    assert set(line) == {"id", "custom_id", "response", "error"}
    assert (
        line["custom_id"] == "c1" and line["error"] is None and line["id"].startswith("batch_req_")
    )
    assert line["response"]["status_code"] == 200 and line["response"]["request_id"]
    body = line["response"]["body"]
    parsed = ChatCompletion.model_validate(body)
    assert parsed.object == "chat.completion" and parsed.id.startswith("chatcmpl-")
    assert parsed.model == "base" and parsed.created == 1700
    choice = parsed.choices[0]
    assert choice.index == 0 and choice.finish_reason == ans.finish_reason
    assert choice.message.role == "assistant" and choice.message.content == ans.text
    assert parsed.usage is not None
    assert (parsed.usage.prompt_tokens, parsed.usage.completion_tokens) == (
        ans.prompt_tokens,
        ans.completion_tokens,
    )
    assert parsed.usage.total_tokens == ans.prompt_tokens + ans.completion_tokens
    _keys_declared(body, ChatCompletion)
    _keys_declared(body["choices"][0], Choice)
    _keys_declared(body["choices"][0]["message"], ChatCompletionMessage)
    _keys_declared(body["usage"], CompletionUsage)
    if ans.logprobs is None:
        assert choice.logprobs is None
        return
    assert choice.logprobs is not None and choice.logprobs.content is not None
    _keys_declared(body["choices"][0]["logprobs"], ChoiceLogprobs)
    got = choice.logprobs.content
    assert [(t.token, t.logprob, t.bytes) for t in got] == [
        (t.token, t.logprob, t.bytes) for t in ans.logprobs
    ]
    for emitted, token in zip(body["choices"][0]["logprobs"]["content"], got):
        _keys_declared(emitted, ChatCompletionTokenLogprob)
        for alt in emitted["top_logprobs"]:
            _keys_declared(alt, TopLogprob)
        assert [(a.token, a.logprob) for a in token.top_logprobs] == [
            (token.token, token.logprob),
            ("x", -9999.0),
        ]


@pytest.mark.parametrize("ans", ANSWERS)
def test_completion_answer_line_validates(ans: Answer) -> None:
    req = _request(
        completion("p1", model="named", logprobs=2 if ans.logprobs is not None else None)
    )
    line = _roundtrip(answer_line(req, ans, job_id="job", model="base", created=5))
    body = line["response"]["body"]
    parsed = Completion.model_validate(body)
    assert parsed.object == "text_completion" and parsed.id.startswith("cmpl-")
    assert parsed.model == "named" and parsed.created == 5
    choice = parsed.choices[0]
    assert (choice.index, choice.text, choice.finish_reason) == (0, ans.text, ans.finish_reason)
    assert parsed.usage is not None
    assert parsed.usage.total_tokens == ans.prompt_tokens + ans.completion_tokens
    assert parsed.usage.completion_tokens == ans.completion_tokens
    _keys_declared(body, Completion)
    _keys_declared(body["choices"][0], CompletionChoice)
    _keys_declared(body["usage"], CompletionUsage)
    if ans.logprobs is None:
        assert choice.logprobs is None
        return
    lp = choice.logprobs
    assert lp is not None
    _keys_declared(body["choices"][0]["logprobs"], Logprobs)
    assert lp.tokens == [t.token for t in ans.logprobs]
    assert lp.token_logprobs == [t.logprob for t in ans.logprobs]
    assert lp.top_logprobs == [{t.token: t.logprob, "x": -9999.0} for t in ans.logprobs]
    assert lp.text_offset == [
        sum(len(t.token) for t in ans.logprobs[:i]) for i in range(len(ans.logprobs))
    ]


def test_error_line_validates() -> None:
    data, _ = _batch_file()
    errors = [i for i in read_batch(data, PATH, 16) if isinstance(i, LineError)]
    ids = set()
    for err in errors:
        line = _roundtrip(error_line(err, job_id="job"))
        assert set(line) == {"id", "custom_id", "response", "error"}
        assert line["response"] is None and line["custom_id"] == err.custom_id
        _keys_declared(line["error"], BatchError)
        parsed = BatchError.model_validate(line["error"])
        assert (parsed.code, parsed.message, parsed.param, parsed.line) == (
            err.code,
            err.message,
            err.param,
            err.line,
        )
        ids.add(line["id"])
    assert len(ids) == len(errors)


def test_ids_are_deterministic_and_distinct() -> None:
    data = "\n".join(json.dumps(chat(f"c{i}")) for i in range(20)).encode()
    reqs = [r for r in read_batch(data, PATH, 16) if isinstance(r, Request)]
    ans = ANSWERS[0]
    lines = [answer_line(r, ans, job_id="j", model="m", created=1) for r in reqs]
    again = [answer_line(r, ans, job_id="j", model="m", created=1) for r in reqs]
    assert lines == again
    assert len({line["id"] for line in lines}) == len(lines)
    assert len({line["response"]["request_id"] for line in lines}) == len(lines)
    assert len({line["response"]["body"]["id"] for line in lines}) == len(lines)
    other = answer_line(reqs[0], ans, job_id="k", model="m", created=1)
    assert other["id"] != lines[0]["id"]
    assert other["response"]["body"]["id"] != lines[0]["response"]["body"]["id"]
    err = LineError(3, None, "invalid_json", None, "x")
    assert error_line(err, job_id="j") == error_line(err, job_id="j")
    assert error_line(err, job_id="j")["id"] != error_line(err, job_id="k")["id"]
