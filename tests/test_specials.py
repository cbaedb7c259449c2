"""One tokenization policy for plain text in train, eval and infer (issue 19, item 3).

A prompt starts with exactly what the tokenizer itself puts in front of a text (its
post-processor), never a ``bos_token`` it would not add; training samples end with one
EOS; the prompt the server feeds a model is, token for token, the prompt part of the
training sample. Checked through the real entry points on four tokenizers: one adding
BOS (Llama-style), one naming a chat BOS it does not add (the issue's case), one adding
nothing (Qwen-style) and one adding BOS and EOS — each also saved and loaded the way a
run loads it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from chat_fixtures import chatml_tokenizer, llama3_tokenizer, plain_tokenizer, save_tokenizer
from shoestring.data.records import IGNORE_INDEX, Record
from shoestring.data.specials import SPECIALS_POLICY, Specials, plain_prompt_ids, specials
from shoestring.data.tokenize import TokenizeSpec, tokenize_records
from shoestring.hf import load_tokenizer
from shoestring.infer import work
from shoestring.infer.batchapi import Request, Sampling
from shoestring.infer.inputs import InputRecord as InferRecord
from shoestring.infer.requests import request_ids
from shoestring.train import dataset
from shoestring.train.builtin import BUILTIN_MODEL, build_tokenizer, materialize_tiny_model
from shoestring.train.config import FinetuneConfig
from shoestring.train.evaluate import probes

BOS, EOS = 257, 258  # the byte tokenizer's <s> and </s>


def _bos_and_eos() -> Any:
    tok = build_tokenizer()
    tok.add_bos_token = True
    tok.add_eos_token = True
    return tok


#: name → (tokenizer, the prefix it adds itself, the EOS ending training samples)
CASES: dict[str, tuple[Callable[[], Any], list[int], int]] = {
    "adds-bos": (plain_tokenizer, [BOS], EOS),
    "chat-bos-not-added": (llama3_tokenizer, [], 263),  # <|begin_of_text|> 259, <|eot_id|>
    "adds-nothing": (chatml_tokenizer, [], 260),  # <|im_end|>
    "adds-bos-and-eos": (_bos_and_eos, [BOS], EOS),
}

PROMPT, COMPLETION, TEXT = "reverse: abc =", " cba", "naïve café"


@pytest.fixture(params=sorted(CASES), ids=str)
def case(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Any, list[int], int]:
    """Each tokenizer as a run loads it: saved into a model directory and read back."""
    make, prefix, eos = CASES[request.param]
    built = make()
    loaded = load_tokenizer(save_tokenizer(built, tmp_path / "model"))
    assert built("ab")["input_ids"] == loaded("ab")["input_ids"]
    return loaded, prefix, eos


def _bytes(text: str) -> list[int]:
    return list(text.encode())


def test_the_probe_finds_what_the_tokenizer_adds(case: tuple[Any, list[int], int]) -> None:
    tok, prefix, eos = case
    sp = specials(tok)
    assert sp.prefix == tuple(prefix) and sp.eos == eos
    assert list(sp.prefix) + _bytes("x y") + list(sp.suffix) == tok("x y")["input_ids"]


def test_the_issue_case_names_a_bos_it_does_not_add() -> None:
    tok = llama3_tokenizer()
    assert tok.bos_token == "<|begin_of_text|>" and tok.bos_token_id == 259
    assert tok("ab")["input_ids"] == [97, 98]


def test_training_samples_start_with_the_tokenizers_own_prefix(
    case: tuple[Any, list[int], int],
) -> None:
    tok, prefix, eos = case
    records = [
        Record("t.jsonl:1", text=TEXT),
        Record("p.jsonl:1", prompt=PROMPT, completion=COMPLETION),
    ]
    (text, pair), _ = tokenize_records(records, tok, TokenizeSpec(256))
    assert text.input_ids == prefix + _bytes(TEXT) + [eos]  # one EOS, also when it adds one
    assert text.labels == [IGNORE_INDEX] * len(prefix) + _bytes(TEXT) + [eos]
    prompt = prefix + _bytes(PROMPT)
    assert pair.input_ids == prompt + _bytes(COMPLETION) + [eos]
    assert pair.labels == [IGNORE_INDEX] * len(prompt) + _bytes(COMPLETION) + [eos]
    if tok.bos_token_id is not None and not prefix:  # no stray BOS anywhere
        assert tok.bos_token_id not in text.input_ids + pair.input_ids


def test_eval_and_serving_prompts_equal_the_training_prompt(
    case: tuple[Any, list[int], int],
) -> None:
    """Train/serve parity: the exact-match probe, a ``{"prompt"}`` line and a
    ``/v1/completions`` request give the tokens training put before the completion."""
    tok, prefix, _ = case
    pair = Record("p.jsonl:1", prompt=PROMPT, completion=COMPLETION)
    (trained,), _ = tokenize_records([pair], tok, TokenizeSpec(256))
    n = trained.labels.index(next(x for x in trained.labels if x != IGNORE_INDEX))
    train_prompt = trained.input_ids[:n]
    assert train_prompt == prefix + _bytes(PROMPT)

    (probe,) = probes([pair], tok, None, 256)
    assert probe.prompt == train_prompt

    jobs = work.tokenize([InferRecord(1, PROMPT)], tok, "generate")
    assert jobs.seqs == [[train_prompt]]
    scored = work.tokenize([InferRecord(1, PROMPT, completion=COMPLETION)], tok, "score")
    assert scored.seqs == [[trained.input_ids[:-1]]] and scored.starts == [[n]]

    req = Request(1, "r1", "completion", None, Sampling(max_tokens=4), prompt=PROMPT)
    assert request_ids(req, tok, None, None, "in.jsonl") == (req, train_prompt)
    assert plain_prompt_ids(tok, PROMPT) == train_prompt


class _Counting:
    """A tokenizer that remembers the longest text it was asked to encode."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.longest = tok, 0

    def __call__(self, text: str, **kw: Any) -> Any:
        self.longest = max(self.longest, len(text))
        return self.tok(text, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)


def test_an_exact_match_prompt_longer_than_max_length_is_left_out_unread(tmp_path: Path) -> None:
    """Evaluation drops examples longer than data.max_length; its exact-match probes do
    too, and a huge prompt (a whole book pasted in) is judged by a bounded cut, the way
    training's tokenizer judges it, never tokenized whole."""
    tok = _Counting(plain_tokenizer())
    book = "words of a long book " * 50_000  # 1 MB
    fits = Record("e.jsonl:1", prompt=PROMPT, completion=COMPLETION)
    chat = Record(
        "e.jsonl:2",
        messages=[{"role": "user", "content": book}, {"role": "assistant", "content": "ok"}],
    )
    huge = Record("e.jsonl:3", prompt=book, completion=COMPLETION)
    got = probes([fits, huge], tok, None, 64)
    assert [p.want for p in got] == [COMPLETION]
    assert 0 < tok.longest < 16 * (64 + 64) * 8, tok.longest
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    tok.longest = 0
    assert probes([chat], tok, template, 64) == []
    assert 0 < tok.longest < 16 * (64 + 64) * 8, tok.longest


def test_an_eos_the_tokenizer_appends_never_ends_a_prompt() -> None:
    tok = _bos_and_eos()
    assert tok(PROMPT)["input_ids"] == [BOS, *_bytes(PROMPT), EOS]
    assert work.tokenize([InferRecord(1, PROMPT)], tok, "generate").seqs == [
        [[BOS, *_bytes(PROMPT)]]
    ]


def test_the_tiny_models_tokenizer_adds_its_bos(cache_dir: Path) -> None:
    """It has always been trained with BOS first; now it is also served with it."""
    tok = load_tokenizer(materialize_tiny_model(cache_dir))
    assert specials(tok) == Specials((BOS,), (), EOS)
    assert plain_prompt_ids(tok, "ab") == tok("ab")["input_ids"] == [BOS, 97, 98]


def test_the_policy_is_part_of_the_tokenized_cache_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache tokenized under another policy (the stray BOS) is never reused."""
    cfg = FinetuneConfig()
    cfg.model.path = BUILTIN_MODEL
    origin = dataset.Origin("d.jsonl", "digest", lambda: ([], {}))
    key = dataset.train_cache_key(cfg, origin, None)
    assert key == dataset.train_cache_key(cfg, origin, None)
    monkeypatch.setattr(dataset, "SPECIALS_POLICY", SPECIALS_POLICY + 1)
    assert dataset.train_cache_key(cfg, origin, None) != key


class _Scrambling:
    """A tokenizer whose ids with specials do not contain its ids without them."""

    eos_token_id = 2

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [9] if add_special_tokens else [5, 6]


def test_a_tokenizer_that_cannot_be_probed_gets_no_specials() -> None:
    with pytest.warns(RuntimeWarning, match="cannot tell which special tokens"):
        assert specials(_Scrambling()) == Specials((), (), 2)
    with pytest.warns(RuntimeWarning):
        assert plain_prompt_ids(_Scrambling(), "x") == [5, 6]
