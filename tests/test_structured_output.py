"""`shoestring infer` holds answers to their `response_format` (OpenAI batch files):
every answer to a bounded JSON Schema ends ("stop") as JSON that validates against
it, greedy or sampled; greedy answers equal in-memory transformers held to the same
grammar by a logits processor; `{"type": "text"}` is free text; a schema the grammar
compiler rejects, or a malformed `response_format`, becomes that line's error; and a
held generation stopped between passes resumes to the same tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from chat_fixtures import tiny_chat_model
from shoestring.cli import main

pytest.importorskip("llguidance")

#: Bounded everywhere (string length, integer range, array length, no extra keys),
#: so a complete answer fits in MAX_TOKENS byte tokens, whatever the model prefers.
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
#: A format and an enum as the top-level answer.
CHOICE: dict[str, Any] = {"enum": ["yes", "no", "maybe"]}
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny ChatML model, its tokenizer carrying Qwen's response template (for
    tool_choice "auto"), as transformers serve has it for the Qwen 2 family."""
    from shoestring.hf import load_tokenizer
    from shoestring.infer.toolsyntax import find_syntax

    model = tiny_chat_model(tmp_path_factory.mktemp("chat") / "tiny-chat")
    tok = load_tokenizer(model)
    syntax = find_syntax(tok, "qwen2")
    assert syntax is not None
    tok.response_template = syntax.template
    tok.save_pretrained(model)
    return model


def chat(cid: str, text: str, fmt: Any = None, **body: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": text}]
    if fmt is not None:
        body["response_format"] = fmt
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": messages, "max_tokens": MAX_TOKENS, **body}}  # fmt: skip


def schema_format(schema: Any, name: str = "answer") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def _run(model: Path, tmp_path: Path, reqs: list[dict[str, Any]], *extra: str) -> list[Any]:
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    out = tmp_path / "out.jsonl"
    args = ["infer", "--model", str(model), "--input", str(inp), "--output", str(out),
            "--threads", "1", "--job.progress", "off", *extra]  # fmt: skip
    assert main(args) == 0
    return [json.loads(x) for x in out.read_text().splitlines()]


def _choice(line: dict[str, Any]) -> dict[str, Any]:
    assert line["error"] is None, line["error"]
    return line["response"]["body"]["choices"][0]  # type: ignore[no-any-return]


def test_answers_validate_against_their_schema(chat_model: Path, tmp_path: Path) -> None:
    reqs = [
        chat("person-greedy", "Describe someone.", schema_format(PERSON), temperature=0),
        chat(
            "person-sampled",
            "Describe someone.",
            schema_format(PERSON),
            temperature=1.0,
            seed=5,
            logprobs=True,
            top_logprobs=2,
        ),  # fmt: skip
        chat("choice", "Yes or no?", schema_format(CHOICE, "verdict"), temperature=0),
        chat("free", "Describe someone.", temperature=0),
        chat("text", "Describe someone.", {"type": "text"}, temperature=0),
        chat("object", "Any JSON object.", {"type": "json_object"}, temperature=0.7, seed=3),
        chat("cut", "Describe someone.", schema_format(PERSON), temperature=0, max_tokens=5),
    ]
    lines = _run(chat_model, tmp_path, reqs, "--batch-size", "4")
    got = {line["custom_id"]: _choice(line) for line in lines}
    # Too few tokens for the format: cut ("length"), counted and warned about.
    assert got["cut"]["finish_reason"] == "length"
    assert got["cut"]["message"]["content"] == got["person-greedy"]["message"]["content"][:5]
    end = json.loads((tmp_path / "out.jsonl.run" / "events.jsonl").read_text().splitlines()[-1])
    cut = sum(got[c]["finish_reason"] == "length" for c in ("person-sampled", "choice", "object"))
    assert (end["held"], end["held_cut"]) == (5, 1 + cut)
    for cid, schema in (("person-greedy", PERSON), ("person-sampled", PERSON), ("choice", CHOICE)):
        c = got[cid]
        assert c["finish_reason"] == "stop", (cid, c)
        text = c["message"]["content"]
        jsonschema.validate(json.loads(text), schema)
        assert text == json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)
    # Logprobs are those of the held distribution: every chosen token had mass > 0.
    lps = [t["logprob"] for t in got["person-sampled"]["logprobs"]["content"]]
    assert len(lps) > 10 and all(lp > -9999.0 for lp in lps)
    # The same prompt unheld is not JSON; {"type": "text"} is the same free answer.
    free = got["free"]["message"]["content"]
    with pytest.raises(ValueError):
        json.loads(free)
    assert got["text"]["message"]["content"] == free
    obj = got["object"]
    if obj["finish_reason"] == "stop":  # a random model may write past MAX_TOKENS
        assert isinstance(json.loads(obj["message"]["content"]), dict)
    else:
        assert obj["message"]["content"].startswith("{")


def test_unusable_formats_become_error_lines(chat_model: Path, tmp_path: Path) -> None:
    bad_type = schema_format({"type": "object", "properties": {"a": {"type": "strin"}}})
    no_name = {"type": "json_schema", "json_schema": {"schema": PERSON}}
    reqs = [
        chat("bad-schema", "x", bad_type, temperature=0, max_tokens=8),
        chat("no-name", "x", no_name),
        chat("xml", "x", {"type": "xml"}),
        chat("typo", "x", {"type": "json_schema", "json_schema": {"name": "a", "shema": {}}}),
        chat("good", "Yes or no?", schema_format(CHOICE), temperature=0),
    ]
    lines = _run(chat_model, tmp_path, reqs)
    errors = {x["custom_id"]: x["error"] for x in lines if x["error"] is not None}
    assert set(errors) == {"bad-schema", "no-name", "xml", "typo"}
    params = {cid: e["param"] for cid, e in errors.items()}
    assert params == {
        "bad-schema": "body.response_format.json_schema.schema",
        "no-name": "body.response_format.json_schema.name",
        "xml": "body.response_format.type",
        "typo": "body.response_format.json_schema.shema",
    }
    assert "strin" in errors["bad-schema"]["message"] and ":1:" in errors["bad-schema"]["message"]
    assert "did you mean 'schema'" in errors["typo"]["message"]
    good = _choice(next(x for x in lines if x["custom_id"] == "good"))
    assert json.loads(good["message"]["content"]) in CHOICE["enum"]


class HeldToGrammar:
    """A transformers logits processor holding one sequence to an llguidance grammar:
    the reference the streamed job is compared with."""

    def __init__(self, tok: Any, vocab: int, schema: Any, eos: list[int]) -> None:
        import llguidance
        import llguidance.hf

        llt = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
        self.matcher = llguidance.LLMatcher(llt, grammar)
        self.prompt_len: int | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        import llguidance.numpy

        if self.prompt_len is None:
            self.prompt_len = input_ids.shape[1]
        else:
            assert self.matcher.consume_token(int(input_ids[0, -1]))
        mask = llguidance.numpy.allocate_token_bitmask(1, scores.shape[1])
        llguidance.numpy.fill_next_token_bitmask(self.matcher, mask)
        held = scores.detach().numpy().copy()
        llguidance.numpy.apply_token_bitmask_inplace(held, mask)
        return torch.from_numpy(held)


def test_greedy_held_answers_equal_transformers_held_by_llguidance(
    chat_model: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

    prompts = ["Describe someone.", "Describe a friend of yours, please."]
    reqs = [chat(f"p{i}", p, schema_format(PERSON), temperature=0) for i, p in enumerate(prompts)]
    lines = _run(chat_model, tmp_path, reqs, "--batch-size", "2")
    tok = AutoTokenizer.from_pretrained(str(chat_model))
    model = AutoModelForCausalLM.from_pretrained(str(chat_model)).eval()
    eos = [tok.convert_tokens_to_ids("<|im_end|>")]
    for req, line in zip(reqs, lines):
        ids = tok.apply_chat_template(req["body"]["messages"], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]  # fmt: skip
        held = HeldToGrammar(tok, model.config.vocab_size, PERSON, eos)
        g = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=MAX_TOKENS, eos_token_id=eos,
                           logits_processor=LogitsProcessorList([held]))  # fmt: skip
        new = g[0, ids.shape[1] :].tolist()
        assert held.matcher.is_stopped() and new[-1] in eos  # transformers needs an end token
        content = _choice(line)["message"]["content"]
        assert content == tok.decode(new[:-1], skip_special_tokens=True)
        assert line["response"]["body"]["usage"]["completion_tokens"] == len(new) - 1


def test_a_held_generation_stopped_between_passes_resumes_to_the_same_tokens(
    chat_model: Path, tmp_path: Path
) -> None:
    from shoestring.infer import partial
    from shoestring.infer.decode import Rules, generate_from, start
    from shoestring.infer.engine import StreamingCausalLM
    from shoestring.infer.sampleparams import Choice, ResponseFormat
    from shoestring.infer.structured import Grammars
    from shoestring.train.builtin import build_tokenizer

    class Stop(Exception):
        pass

    torch.set_num_threads(1)
    grammars = Grammars(build_tokenizer(), 320, [258])
    grammar = grammars.compile(ResponseFormat.of_schema(PERSON, "p"))
    prompts = [[72, 105], [65, 32, 108, 111, 110, 103, 101, 114, 32, 111, 110, 101], [33] * 5]
    choices = [Choice(), Choice(temperature=1.0, seed=2, key="b"), Choice(temperature=0.5)]

    def rules() -> Rules:  # fresh matchers, as a new process would build them
        held = grammars.held([grammar] * len(prompts))
        return Rules([MAX_TOKENS] * 3, frozenset({258}), choices, None, held)

    def engine() -> StreamingCausalLM:
        return StreamingCausalLM(chat_model, device=torch.device("cpu")).start(resident=1, depth=1)

    eng = engine()
    ref = [g.tokens for g in generate_from(eng, start(eng, prompts, pad_id=0, micro_tokens=16),
                                           rules=rules(), pad_id=0)]  # fmt: skip
    eng.close()
    assert all(len(t) > 20 for t in ref)
    eng = engine()
    state = start(eng, prompts, pad_id=0, micro_tokens=16)

    def on_pass() -> None:
        if state.step == 9:
            raise Stop

    with pytest.raises(Stop):
        generate_from(eng, state, rules=rules(), pad_id=0, on_pass=on_pass)
    path, _ = partial.save(tmp_path / "partial", 0, state, {"chunk": 0})
    eng.close()
    eng = engine()
    loaded = partial.load(path, eng, len(prompts))
    got = [g.tokens for g in generate_from(eng, loaded, rules=rules(), pad_id=0)]
    eng.close()
    assert got == ref


def _lines_args(model: Path, inp: Path, out: Path, *extra: str) -> list[str]:
    return ["infer", "--model", str(model), "--input", str(inp), "--output", str(out),
            "--threads", "1", "--job.progress", "off", "--max-new-tokens", str(MAX_TOKENS),
            *extra]  # fmt: skip


def test_a_schema_file_holds_every_answer_of_a_jobs_own_lines(
    chat_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON, indent=2))
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt": f"Person {i}:"}) + "\n" for i in range(3))
                   + json.dumps({"messages": [{"role": "user", "content": "Who?"}]}) + "\n")  # fmt: skip
    out = tmp_path / "out.jsonl"
    assert main(_lines_args(chat_model, inp, out, "--json-schema", str(schema))) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["finish"] for x in lines] == ["stop"] * 4
    for x in lines:
        jsonschema.validate(json.loads(x["completion"]), PERSON)
    # The run directory belongs to this schema: another one is refused, naming it.
    schema.write_text(json.dumps(CHOICE))
    assert main(_lines_args(chat_model, inp, out, "--json-schema", str(schema))) == 2
    assert "json_schema_sha256 changed" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text,extra,expected",
    [
        ('{\n  "type": "object",\n  "properties": {"a": }\n}', (), "bad.json:3:"),
        ('["not", "a", "schema"]', (), "a JSON Schema is an object, got list"),
        ('{"type": "object", "properties": {"a": {"type": "strin"}}}', (), "Invalid type: strin"),
        ('{"type": "object"}', ("--mode", "score"), "score mode generates none"),
    ],
)
def test_a_schema_file_that_cannot_be_used_fails_before_weights_load(
    chat_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    text: str, extra: tuple[str, ...], expected: str,
) -> None:  # fmt: skip
    schema = tmp_path / "bad.json"
    schema.write_text(text)
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt": "x", "completion": "y"}) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(_lines_args(chat_model, inp, out, "--json-schema", str(schema), *extra)) == 2
    err = capsys.readouterr().err
    assert "--json-schema (generate.json_schema)" in err and expected in err, err
    assert not (tmp_path / "out.jsonl.run" / "events.jsonl").exists()  # nothing started


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"enum": ["UTC", "CET"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },  # fmt: skip
    },
}


def test_tools_are_called_as_the_tool_choice_says(chat_model: Path, tmp_path: Path) -> None:
    from openai.types.chat import ChatCompletion

    ask = "Weather in Oslo?"  # (the template's tool text is ~900 byte tokens of 1024)
    named = {"type": "function", "function": {"name": "get_weather"}}
    both = {"tools": [WEATHER, CLOCK], "max_tokens": 90}
    reqs = [
        chat("named", ask, tool_choice=named, temperature=0, **both),
        chat("one", ask, tool_choice="required", parallel_tool_calls=False, seed=1, **both),
        chat("any", ask, tool_choice="required", temperature=0, **both),
        chat("none", ask, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=8),
        chat("plain", ask, temperature=0, max_tokens=8),
        chat("auto", ask, temperature=0, **both),  # tool_choice absent: "auto"
        chat("free", ask, tool_choice="none", temperature=0, **both),
    ]
    lines = {x["custom_id"]: x for x in _run(chat_model, tmp_path, reqs, "--batch-size", "7")}
    for x in lines.values():
        ChatCompletion.model_validate(x["response"]["body"])  # the openai package's own type
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}

    def calls(cid: str) -> list[dict[str, Any]]:
        c = _choice(lines[cid])
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None, c
        for call in c["message"]["tool_calls"]:
            assert call["type"] == "function" and call["id"].startswith("call_")
            jsonschema.validate(
                json.loads(call["function"]["arguments"]), schema[call["function"]["name"]]
            )
        return c["message"]["tool_calls"]  # type: ignore[no-any-return]

    assert [c["function"]["name"] for c in calls("named")] == ["get_weather"]
    assert len(calls("one")) == 1
    if _choice(lines["any"])["finish_reason"] == "tool_calls":  # a random model may go on
        assert len(calls("any")) >= 1
    ids = [c["id"] for cid in ("named", "one") for c in calls(cid)]
    assert len(set(ids)) == len(ids)
    # "none": the tools are in the prompt (the template renders them), the answer is text.
    none, plain = lines["none"]["response"]["body"], lines["plain"]["response"]["body"]
    assert (
        none["choices"][0]["message"]["content"]
        and "tool_calls" not in none["choices"][0]["message"]
    )
    assert none["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 20
    # "auto": the answer is free (no grammar holds it): greedy, it is the "none" answer's
    # tokens, read back as text, unless the model happened to call a tool in Qwen's syntax.
    auto, free = _choice(lines["auto"]), _choice(lines["free"])
    if auto["finish_reason"] == "tool_calls":
        assert calls("auto") and "<tool_call>" in free["message"]["content"]
    else:
        assert auto["message"] == free["message"] and auto["finish_reason"] == free["finish_reason"]
    usage = [lines[c]["response"]["body"]["usage"] for c in ("auto", "free")]
    assert usage[0] == usage[1]
    events = (tmp_path / "out.jsonl.run" / "events.jsonl").read_text().splitlines()
    start = next(e for e in map(json.loads, events) if e["event"] == "infer_start")
    assert start["tool_syntax"] == "the tokenizer's response_template"
