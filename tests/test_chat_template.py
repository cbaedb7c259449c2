"""Conversations through real chat templates: the loss mask covers exactly the assistant
turns (content and end-of-turn marker, never the role header), for ChatML (Qwen2.5) and
Llama-3.1 templates and every ``data.loss_on``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from chat_fixtures import (
    CHATML_TEMPLATE,
    NOT_PREFIX_STABLE_TEMPLATE,
    WEATHER_TOOL,
    chatml_tokenizer,
    llama3_tokenizer,
    multi_turn,
    plain_tokenizer,
    save_tokenizer,
    tool_turns,
)
from shoestring.data.chat import (
    chat_example,
    end_of_turn_ids,
    load_template,
    prompt_ids,
    render_chat,
)
from shoestring.data.records import IGNORE_INDEX, DataError, Example, LossOn, Record
from shoestring.data.tokenize import TokenizeSpec, check_chat_ready, tokenize_records

# What each template writes for an assistant turn after its role header, up to and
# including its end-of-turn token: an independent oracle, written out by hand rather than
# derived from the rendering under test. ChatML's newline after <|im_end|> separates turns
# and takes no loss (as in a {% generation %} mask).
CHATML_TURNS = [
    "Paris.<|im_end|>",
    "Tōkyō — 東京.<|im_end|>",
    "You're welcome.<|im_end|>",
]
CHATML_TOOL_TURNS = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>',
    "It is -3 °C in Oslo.<|im_end|>",
]
LLAMA3_TURNS = ["Paris.<|eot_id|>", "Tōkyō — 東京.<|eot_id|>", "You're welcome.<|eot_id|>"]
LLAMA3_TOOL_TURNS = [
    '{"name": "get_weather", "parameters": {"city": "Oslo"}}<|eot_id|>',
    "It is -3 °C in Oslo.<|eot_id|>",
]
HEADER_TOKENS = ("<|im_start|>", "<|start_header_id|>", "<|end_header_id|>", "<|begin_of_text|>")

CASES = [
    pytest.param(chatml_tokenizer, multi_turn, None, CHATML_TURNS, id="chatml"),
    pytest.param(
        chatml_tokenizer, tool_turns, [WEATHER_TOOL], CHATML_TOOL_TURNS, id="chatml-tools"
    ),
    pytest.param(llama3_tokenizer, multi_turn, None, LLAMA3_TURNS, id="llama3"),
    pytest.param(
        llama3_tokenizer, tool_turns, [WEATHER_TOOL], LLAMA3_TOOL_TURNS, id="llama3-tools"
    ),
]


def _record(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> Record:
    return Record("chats.jsonl:3", messages=tuple(messages), tools=tuple(tools) if tools else None)


def _labelled_runs(tok: Any, ex: Example) -> list[str]:
    """The labelled tokens, decoded run by run (a run: consecutive labelled tokens)."""
    runs: list[list[int]] = []
    previous = IGNORE_INDEX
    for token, label in zip(ex.input_ids, ex.labels, strict=True):
        if label != IGNORE_INDEX:
            assert label == token
            if previous == IGNORE_INDEX:
                runs.append([])
            runs[-1].append(token)
        previous = label
    return [tok.decode(run, skip_special_tokens=False) for run in runs]


@pytest.mark.parametrize("loss_on", ["assistant", "last_assistant"])
@pytest.mark.parametrize(("make_tok", "make_messages", "tools", "expected"), CASES)
def test_loss_mask_is_exactly_the_assistant_turns(
    make_tok: Any, make_messages: Any, tools: Any, expected: list[str], loss_on: LossOn
) -> None:
    tok = make_tok()
    r = _record(make_messages(), tools)
    ex = chat_example(r, tok, TokenizeSpec(4096, loss_on=loss_on))
    rendered = tok.apply_chat_template(list(r.messages or ()), tools=tools, tokenize=False)
    assert tok.decode(ex.input_ids, skip_special_tokens=False) == rendered
    assert tok(rendered, add_special_tokens=False)["input_ids"] == ex.input_ids
    want = expected if loss_on == "assistant" else expected[-1:]
    assert _labelled_runs(tok, ex) == want
    header_ids = {tok.convert_tokens_to_ids(t) for t in HEADER_TOKENS if t in tok.get_vocab()}
    assert header_ids and not header_ids & {x for x in ex.labels if x != IGNORE_INDEX}
    end_of_turn = end_of_turn_ids(tok)[0]
    assert sum(1 for x in ex.labels if x == end_of_turn) == len(want)


@pytest.mark.parametrize(("make_tok", "make_messages", "tools", "expected"), CASES)
def test_loss_on_all_labels_every_token_but_the_first(
    make_tok: Any, make_messages: Any, tools: Any, expected: list[str]
) -> None:
    tok = make_tok()
    ex = chat_example(_record(make_messages(), tools), tok, TokenizeSpec(4096, loss_on="all"))
    assert ex.labels[0] == IGNORE_INDEX
    assert ex.labels[1:] == ex.input_ids[1:]
    assert all(turn in tok.decode(ex.input_ids, skip_special_tokens=False) for turn in expected)


@pytest.mark.parametrize(
    ("make_tok", "expected"), [(chatml_tokenizer, CHATML_TURNS), (llama3_tokenizer, LLAMA3_TURNS)]
)
def test_a_conversation_opened_by_the_assistant_trains_on_its_content_only(
    make_tok: Any, expected: list[str]
) -> None:
    tok = make_tok()
    ex = chat_example(_record(multi_turn()[2:]), tok, TokenizeSpec(4096))
    assert _labelled_runs(tok, ex) == expected
    alone = chat_example(_record(multi_turn()[2:3]), tok, TokenizeSpec(4096))
    assert _labelled_runs(tok, alone) == expected[:1]


def test_prompt_ids_are_the_training_tokens_before_each_answer() -> None:
    """Exact-match eval and inference prompt the model with what it was trained on."""
    for tok in (chatml_tokenizer(), llama3_tokenizer()):
        messages = multi_turn()
        ex = chat_example(_record(messages), tok, TokenizeSpec(4096))
        for i in (2, 4, 6):
            prompt = prompt_ids(messages[:i], tok)
            assert ex.input_ids[: len(prompt)] == prompt
            assert ex.labels[len(prompt) - 1] == IGNORE_INDEX  # the header is not trained
            assert ex.labels[len(prompt)] != IGNORE_INDEX  # the answer's first token is
        tools_prompt = prompt_ids(tool_turns()[:2], tok, tools=[WEATHER_TOOL])
        assert b"get_weather" in bytes(t for t in tools_prompt if t < 256)


def test_end_of_turn_ids() -> None:
    chatml, llama = chatml_tokenizer(), llama3_tokenizer()
    assert end_of_turn_ids(chatml) == [chatml.convert_tokens_to_ids("<|im_end|>")]
    assert end_of_turn_ids(llama) == [llama.convert_tokens_to_ids("<|eot_id|>")]
    plain = plain_tokenizer()
    assert end_of_turn_ids(plain) == [plain.eos_token_id]
    # ChatML rendered by a tokenizer whose EOS is </s>: both end a turn.
    assert end_of_turn_ids(plain, CHATML_TEMPLATE)[-1] == plain.eos_token_id
    chatml.eos_token = "<|endoftext|>"
    assert end_of_turn_ids(chatml) == [
        chatml.convert_tokens_to_ids("<|im_end|>"),
        chatml.convert_tokens_to_ids("<|endoftext|>"),
    ]


def test_a_template_that_is_not_prefix_stable_is_refused() -> None:
    tok = chatml_tokenizer()
    spec = TokenizeSpec(4096, chat_template=NOT_PREFIX_STABLE_TEMPLATE)
    with pytest.raises(
        DataError, match=r"chats\.jsonl:3: message 3: chat template is not prefix-stable"
    ):
        chat_example(_record(multi_turn()), tok, spec)
    # loss_on=all needs no turn boundaries, so the same template trains.
    ex = chat_example(
        _record(multi_turn()),
        tok,
        TokenizeSpec(4096, "all", chat_template=NOT_PREFIX_STABLE_TEMPLATE),
    )
    assert ex.labels[1:] == ex.input_ids[1:]


def test_the_spec_template_overrides_the_tokenizers() -> None:
    tok = llama3_tokenizer()
    spec = TokenizeSpec(4096, chat_template=CHATML_TEMPLATE)
    text = render_chat(_record(multi_turn()), tok, spec).text
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")


def test_a_conversation_without_an_assistant_turn_has_nothing_to_learn() -> None:
    r = _record([{"role": "user", "content": "hi"}])
    losses: tuple[LossOn, ...] = ("assistant", "last_assistant")
    for loss_on in losses:
        with pytest.raises(DataError, match=r"chats\.jsonl:3: nothing to learn.*no assistant"):
            chat_example(r, chatml_tokenizer(), TokenizeSpec(64, loss_on))
    assert chat_example(r, chatml_tokenizer(), TokenizeSpec(64, "all")).input_ids


def test_a_template_failure_names_the_record() -> None:
    r = _record([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    failing = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(
        DataError, match=r"chats\.jsonl:3: the chat template failed.*roles must alternate"
    ):
        chat_example(r, chatml_tokenizer(), TokenizeSpec(64, chat_template=failing))


def test_check_chat_ready() -> None:
    plain = plain_tokenizer()
    with pytest.raises(DataError, match=r"no chat template.*set data\.chat_template FILE"):
        check_chat_ready(plain, TokenizeSpec(64), needs_chat=True)
    check_chat_ready(plain, TokenizeSpec(64), needs_chat=False)
    check_chat_ready(plain, TokenizeSpec(64, chat_template=CHATML_TEMPLATE), needs_chat=True)
    check_chat_ready(chatml_tokenizer(), TokenizeSpec(64), needs_chat=True)

    class SlowTokenizer:
        is_fast = False
        chat_template = CHATML_TEMPLATE
        name_or_path = "org/slow"

    with pytest.raises(DataError, match=r"org/slow: .*needs a fast"):
        check_chat_ready(SlowTokenizer(), TokenizeSpec(64), needs_chat=True)
    with pytest.raises(DataError, match="needs a fast"):
        chat_example(_record(multi_turn()), SlowTokenizer(), TokenizeSpec(64))


def test_load_template(tmp_path: Path) -> None:
    good = tmp_path / "chatml.jinja"
    good.write_text(CHATML_TEMPLATE)
    assert load_template(str(good)) == CHATML_TEMPLATE
    tracked = tmp_path / "tracked.jinja"
    tracked.write_text(
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    assert "generation" in load_template(str(tracked))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}\n")
    with pytest.raises(DataError, match=r"bad\.jinja:2: data\.chat_template is not a valid Jinja"):
        load_template(str(bad))
    with pytest.raises(DataError, match=r"missing\.jinja: no such file"):
        load_template(str(tmp_path / "missing.jinja"))


def test_a_saved_tokenizer_keeps_its_template(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = chatml_tokenizer()
    loaded = AutoTokenizer.from_pretrained(save_tokenizer(tok, tmp_path / "model"))
    assert loaded.chat_template == CHATML_TEMPLATE
    r = _record(tool_turns(), [WEATHER_TOOL])
    assert chat_example(r, loaded, TokenizeSpec(4096)) == chat_example(r, tok, TokenizeSpec(4096))
    assert loaded.eos_token == "<|im_end|>"


@pytest.mark.parametrize("loss_on", ["assistant", "last_assistant", "all"])
@pytest.mark.parametrize("make_tok", [chatml_tokenizer, llama3_tokenizer])
def test_a_batch_renders_each_conversation_as_it_renders_alone(
    make_tok: Any, loss_on: LossOn
) -> None:
    """tokenize_records renders a chunk's prefixes in one template call per kind and per
    tools list: its examples equal the record-by-record ones, in order."""
    tok = make_tok()
    records = [
        _record(multi_turn()),
        _record(tool_turns(), [WEATHER_TOOL]),
        _record(multi_turn()[2:]),  # opened by the assistant
        _record(multi_turn()[:4]),  # ends with a user turn
        _record(tool_turns(), [WEATHER_TOOL]),
        _record(multi_turn()[:3]),
    ]
    spec = TokenizeSpec(4096, loss_on=loss_on)
    examples, stats = tokenize_records(records, tok, spec)
    assert stats.samples == len(records)
    assert examples == [chat_example(r, tok, spec) for r in records]


def test_a_template_failure_in_a_batch_names_its_record() -> None:
    good = _record(multi_turn())
    bad = Record("chats.jsonl:9", messages=({"role": "user", "content": "boom"},))
    failing = (
        "{% if messages[-1]['content'] == 'boom' %}{{ raise_exception('no boom') }}{% endif %}"
    )
    with pytest.raises(DataError, match=r"chats\.jsonl:9: the chat template failed.*no boom"):
        tokenize_records(
            [good, bad, good], chatml_tokenizer(), TokenizeSpec(64, "all", chat_template=failing)
        )
