"""Preference records → tokenized (chosen, rejected) pairs sharing a prompt.

A pair is two examples: ``prompt + chosen`` and ``prompt + rejected``, labels on the
answer only (its end-of-turn or EOS included). Text pairs are tokenized exactly as SFT
tokenizes a prompt/completion record (:mod:`shoestring.data.specials`); conversations
are rendered with the chat template, the answer being everything the full render adds
after the prompt's render with the generation prompt (TRL's conversational format).

Truncation: a pair longer than ``data.max_length`` loses tokens from the start of its
prompt (after its first token, BOS or the template's opening), the same number in both
examples so they keep one prompt. The answers are never cut: a pair whose answer does
not fit even then is refused with ``file:line`` (``data.truncate drop``: dropped and
counted). The cache stores a pair as examples ``2i`` (chosen) and ``2i + 1``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from shoestring.data.chat import (
    _end_at_marker,
    _render_many,
    _tools_arg,
    encode_with_offsets,
    label_tokens,
    special_texts,
)
from shoestring.data.records import IGNORE_INDEX, DataError, Example, Record
from shoestring.data.tokenize import CHUNK, TokenizeSpec, _untruncated

#: How pairs are laid out and truncated; part of the tokenized cache's key.
PAIR_LAYOUT = 1


@dataclass
class PairStats:
    """What tokenizing pairs did (the ``data`` event's counts)."""

    samples: int = 0  # pairs kept
    truncated: int = 0  # pairs whose prompt lost tokens
    dropped: int = 0
    tokens: int = 0


def preference_only(records: Sequence[Record], objective: str) -> None:
    """``train.objective dpo|orpo|simpo`` trains on preference records only, SFT on none
    (``grpo`` reads prompt records, a shape only it asks for)."""
    if objective == "grpo":
        return
    for r in records:
        if objective == "sft" and r.is_preference:
            raise DataError(
                f"{r.source}: a preference record ('chosen'/'rejected'): "
                "set train.objective dpo, orpo or simpo to train on preferences"
            )
        if objective != "sft" and not r.is_preference:
            raise DataError(
                f"{r.source}: train.objective {objective} needs preference records "
                "('prompt', 'chosen', 'rejected'), this one has neither 'chosen' nor 'rejected'"
            )


def _chat_example(r: Record, tok: Any, spec: TokenizeSpec, specials: tuple[str, ...]) -> Example:
    messages = list(r.messages or ())
    tools, template = _tools_arg(r.tools), spec.chat_template
    try:
        full = _render_many(tok, [messages], tools, template, False)[0]
        prompt = _render_many(tok, [messages[: r.answer_start]], tools, template, True)[0]
    except Exception as e:  # jinja2 errors, raise_exception() in templates
        raise DataError(f"{r.source}: the chat template failed on this conversation: {e}") from e
    if not full.startswith(prompt) or len(full) == len(prompt):
        raise DataError(
            f"{r.source}: the chat template does not render the prompt as a prefix of the "
            "conversation with its answer; use a prefix-stable template (data.chat_template)"
        )
    span = _end_at_marker(full, (len(prompt), len(full)), specials)
    ids, offsets = next(iter(encode_with_offsets(tok, [full])))
    return Example(list(ids), label_tokens(ids, offsets, [span]))


def _examples(records: Sequence[Record], tok: Any, spec: TokenizeSpec) -> list[Example]:
    """Untruncated examples: chosen, rejected, chosen, ... in record order."""
    both = [x for r in records for x in (r, r.rejected) if x is not None]
    if all(x.kind != "chat" for x in both):
        return _untruncated(both, tok, spec)
    specials = special_texts(tok)
    return [
        _chat_example(x, tok, spec, specials)
        if x.kind == "chat"
        else _untruncated([x], tok, spec)[0]
        for x in both
    ]


def _answer_start(ex: Example) -> int:
    return next((i for i, y in enumerate(ex.labels) if i and y != IGNORE_INDEX), len(ex.labels))


def _cut_prompt(ex: Example, n: int) -> Example:
    return Example(ex.input_ids[:1] + ex.input_ids[1 + n :], ex.labels[:1] + ex.labels[1 + n :])


def fit_pair(
    r: Record, chosen: Example, rejected: Example, spec: TokenizeSpec
) -> tuple[Example, Example] | None:
    """The pair within ``max_length``, its prompt cut from the start; None when
    ``data.truncate drop`` drops it; DataError (``file:line``) when an answer cannot fit."""
    for name, ex in (("chosen", chosen), ("rejected", rejected)):
        if _answer_start(ex) >= len(ex.labels):
            raise DataError(f"{r.source}: the {name} answer has no token to learn")
    over = max(len(chosen.input_ids), len(rejected.input_ids)) - spec.max_length
    if over <= 0:
        return chosen, rejected
    room = min(_answer_start(chosen), _answer_start(rejected)) - 1
    if over > room:
        if spec.truncate == "drop":
            return None
        longest = max(len(chosen.input_ids), len(rejected.input_ids)) - room
        raise DataError(
            f"{r.source}: the answers do not fit data.max_length={spec.max_length} even with "
            f"the prompt cut to its first token ({longest} tokens); answers are never cut: "
            "raise data.max_length, shorten the record, or set data.truncate drop"
        )
    return _cut_prompt(chosen, over), _cut_prompt(rejected, over)


def tokenize_pairs(
    records: Sequence[Record],
    tok: Any,
    spec: TokenizeSpec,
    sink: Callable[[list[Example]], None],
    should_stop: Callable[[], bool] = lambda: False,
) -> PairStats:
    """Every preference record → two examples handed to ``sink`` (chunk by chunk)."""
    stats = PairStats()
    for start in range(0, len(records), CHUNK):
        if should_stop():
            raise InterruptedError("preempted while tokenizing")
        chunk = records[start : start + CHUNK]
        exs = _examples(chunk, tok, spec)
        out: list[Example] = []
        for k, r in enumerate(chunk):
            chosen, rejected = exs[2 * k], exs[2 * k + 1]
            fitted = fit_pair(r, chosen, rejected, spec)
            if fitted is None:
                stats.dropped += 1
                continue
            stats.truncated += int(fitted[0] is not chosen)
            stats.samples += 1
            stats.tokens += sum(len(e.input_ids) for e in fitted)
            out.extend(fitted)
        sink(out)
    return stats


def pair_examples(records: Sequence[Record], tok: Any, spec: TokenizeSpec) -> list[Example]:
    """:func:`tokenize_pairs` into a list (held-out pairs)."""
    out: list[Example] = []
    tokenize_pairs(records, tok, spec, out.extend)
    return out
