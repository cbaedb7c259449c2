"""The job's work: input records as token sequences, and results as output lines.

Two kinds of input: ``{"prompt"}``/``{"messages"}`` lines (answered in shoestring's
own line format, a bad line fails the job before it starts), and OpenAI batch
files (answered in the batch output format, a bad line answered with an error
line: :mod:`shoestring.infer.requests`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from shoestring.config import ConfigError
from shoestring.data.chat import end_of_turn_ids, prompt_ids
from shoestring.data.records import DataError
from shoestring.data.specials import plain_prompt_ids
from shoestring.infer.batchapi import Request
from shoestring.infer.config import Mode
from shoestring.infer.decode import Generated, Rules, Scored
from shoestring.infer.inputs import InputRecord
from shoestring.infer.requests import (
    Answering,
    Item,
    answer_lines,
    format_grammar,
    request_ids,
    syntax_known,
)
from shoestring.infer.sampleparams import Choice, Sampling
from shoestring.infer.sampling import StopStrings
from shoestring.infer.structured import Grammars
from shoestring.infer.toolsyntax import ToolSyntax, find_syntax, no_syntax

#: The input's kind: shoestring's own lines, or an OpenAI batch file.
InputKind = Literal["lines", "openai"]


#: How ``{"prompt"}`` lines are continued by default (``generate.*``'s defaults).
GREEDY = Sampling(max_tokens=32, temperature=0.0)


@dataclass(frozen=True)
class Continuation:
    """How one record is continued: at most ``max_tokens`` new tokens, drawn as
    ``choice`` says, ended early by any of the ``stop`` strings, held to ``grammar``
    (a compiled response format) when there is one."""

    max_tokens: int
    choice: Choice
    stop: tuple[str, ...] = ()
    grammar: str | None = None


@dataclass
class Work:
    """Tokenized job: one or more sequences per record (none for an error line)."""

    records: Sequence[InputRecord | Item]
    seqs: list[list[list[int]]]  # per record: its sequences (prompt [+ completion] tokens)
    starts: list[list[int]]  # per record: index of the first completion token (score mode)
    eos_ids: set[int] = field(default_factory=set)
    pad_id: int = 0
    kind: InputKind = "lines"
    continuations: list[Continuation] = field(default_factory=list)  # per record
    grammars: Grammars | None = None  # when any record has a response format
    tool_syntax: ToolSyntax | None = None  # when any record lets the model choose its tools

    def sequences(self, records: Sequence[int]) -> list[tuple[int, int]]:
        """(record, sequence) of every sequence of ``records``, in order."""
        return [(i, j) for i in records for j in range(len(self.seqs[i]))]

    def rules(self, flat: list[tuple[int, int]], tok: Any, stop_at_eos: bool) -> Rules:
        """How each of the sequences ``flat`` is continued and when it ends."""
        conts = [self.continuations[i] for i, _ in flat]
        choices = [c.choice for c in conts]
        plain = not any(_draws(c) for c in choices)
        stops = [StopStrings(tok, c.stop) if c.stop else None for c in conts]
        held = self.grammars.held([c.grammar for c in conts]) if self.grammars else None
        return Rules(
            [c.max_tokens for c in conts],
            frozenset(self.eos_ids if stop_at_eos else ()),
            None if plain else choices,
            stops if any(stops) else None,
            held,
        )

    @property
    def most_new_tokens(self) -> int:
        return max((c.max_tokens for c in self.continuations), default=0)

    @property
    def samples(self) -> bool:
        """Does any record draw at random or ask for log-probs (else: plain greedy)?"""
        return any(_draws(c.choice) for c in self.continuations)

    def schedule(self) -> list[int] | None:
        """The order chunks take the records: by length limit (shortest first, then
        input order), so a chunk's requests end together and a chunk of short ones
        takes few passes, instead of each chunk running to the longest limit in the
        file. None when every limit is the same (input order)."""
        limits = [c.max_tokens for c in self.continuations]
        if len(set(limits)) <= 1:
            return None
        return sorted(range(len(limits)), key=lambda i: (limits[i], i))


def _draws(c: Choice) -> bool:
    return c.temperature > 0 or c.logprobs >= 0


def _context(r: InputRecord, tok: Any, template: str | None) -> list[int]:
    """The prompt's tokens: a conversation rendered with the chat template (with the
    assistant header, as training rendered it), else the text with the tokenizer's
    special tokens (``prompt_ids``: as given)."""
    if r.prompt_ids is not None:
        return list(r.prompt_ids)
    if r.messages is None:
        return plain_prompt_ids(tok, r.prompt)
    try:
        return prompt_ids(r.messages, tok, template, r.tools)
    except DataError as e:
        raise ConfigError(f"io.input: line {r.line}: {e}") from None


def tokenize(
    records: list[InputRecord],
    tok: Any,
    mode: Mode,
    template: str | None = None,
    sampling: Sampling = GREEDY,
    context: int | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
) -> Work:
    """``{"prompt"}``/``{"messages"}`` records as sequences, each continued as ``sampling``
    says with draws keyed by the job's ``seed`` and its line, held to its response
    format if it has one (compiled for a model of ``vocab_size`` logits); a record
    that cannot be answered (no tokens, longer than the model's ``context`` with what
    is generated or scored) fails the job before anything loads, naming its line."""
    seqs, starts = [], []
    for r in records:
        ctx = _context(r, tok, template)
        _known_ids(r, vocab_size)
        if mode == "generate":
            if not ctx:
                raise ConfigError(f"io.input: line {r.line}: the prompt has no tokens")
            _fits(r, len(ctx) + sampling.max_tokens, context, "+ --max-new-tokens")
            seqs.append([ctx])
            starts.append([len(ctx)])
            continue
        seqs.append(_scored_seqs(r, ctx, tok, context))
        starts.append([len(ctx)] * len(seqs[-1]))
    eos, pad = _stops(any(r.messages is not None for r in records), tok, template)
    most = sampling.max_tokens if mode == "generate" else 0
    grammars, grammar = _held_lines(sampling, mode, tok, vocab_size, eos)
    conts = [
        Continuation(most, sampling.choice(seed, f"line:{r.line}"), grammar=grammar)
        for r in records
    ]
    return Work(records, seqs, starts, eos, pad, "lines", conts, grammars)


def _scored_seqs(r: InputRecord, ctx: list[int], tok: Any, context: int | None) -> list[list[int]]:
    """A score record's sequences: the prompt followed by each completion to score."""
    if not ctx:
        raise ConfigError(
            f"io.input: line {r.line}: score mode needs a non-empty prompt "
            "(the first completion token is predicted from it)"
        )
    if r.completion_ids is not None:
        conts = [list(r.completion_ids)]
    else:
        outs = [r.completion] if r.completion is not None else list(r.choices or ())
        conts = [tok(c, add_special_tokens=False)["input_ids"] for c in outs]
    # The last completion token is scored but never fed (infer/decode.py::score).
    longest = len(ctx) + max(len(c) for c in conts) - 1
    _fits(r, longest, context, "+ its completion but the last token (never fed)")
    return [ctx + c for c in conts]


def _held_lines(
    sampling: Sampling, mode: Mode, tok: Any, vocab_size: int | None, eos: set[int]
) -> tuple[Grammars | None, str | None]:
    """The compiled ``--json-schema`` every generated line is held to (None: free)."""
    fmt = sampling.response_format
    if fmt is None:
        return None, None
    key = "--json-schema (generate.json_schema)"
    if mode != "generate":
        raise ConfigError(f"{key}: holds generated answers; score mode generates none")
    grammars = Grammars(tok, vocab_size or len(tok), eos)
    try:
        return grammars, grammars.compile(fmt)
    except ValueError as e:
        raise ConfigError(f"{key}: {fmt.name}: the schema cannot be used: {e}") from None


def _known_ids(r: InputRecord, vocab_size: int | None) -> None:
    """Token ids given in a line name rows of the model's embedding."""
    for key, ids in (("prompt_ids", r.prompt_ids), ("completion_ids", r.completion_ids)):
        if ids is not None and vocab_size is not None and max(ids) >= vocab_size:
            raise ConfigError(
                f"io.input: line {r.line}: {key} has token id {max(ids)}, beyond the "
                f"model's vocabulary of {vocab_size} (vocab_size)"
            )


def _fits(r: InputRecord, tokens: int, context: int | None, what: str) -> None:
    if context is not None and tokens > context:
        raise ConfigError(
            f"io.input: line {r.line}: the prompt {what} is {tokens} tokens, more than "
            f"the model's context of {context} (max_position_embeddings); shorten it"
        )


def tokenize_requests(
    items: list[Item],
    tok: Any,
    template: str | None,
    context: int | None,
    seed: int,
    path: str,
    vocab_size: int | None = None,
    model_type: str | None = None,
) -> Work:
    """An OpenAI batch file's work: each request's prompt, limit, sampling, stop
    strings and response format (compiled for a model of ``vocab_size`` logits), and
    the model's tool-call syntax (found by ``model_type``) when a request lets the
    model choose; lines that cannot be answered become error lines with no sequence."""
    checked = [request_ids(item, tok, template, context, path, vocab_size) for item in items]
    reqs = [item if isinstance(item, Request) else None for item, _ in checked]
    eos, pad = _stops(any(r is not None and r.messages is not None for r in reqs), tok, template)
    wants = any(r is not None and r.sampling.response_format is not None for r in reqs)
    grammars = Grammars(tok, vocab_size or len(tok), eos) if wants else None
    chooses = any(
        r is not None and r.tool_use is not None and r.tool_use.mode == "auto" for r in reqs
    )
    syntax = find_syntax(tok, model_type) if chooses else None
    missing = no_syntax(tok, model_type) if chooses and syntax is None else ""
    checked = [(syntax_known(item, syntax, missing, path), ids) for item, ids in checked]
    held = [format_grammar(item, grammars, path) for item, _ in checked]
    return Work(
        [item for item, _ in held],
        [[ids] if isinstance(item, Request) else [] for (item, _), (_, ids) in zip(held, checked)],
        [
            [len(ids)] if isinstance(item, Request) else []
            for (item, _), (_, ids) in zip(held, checked)
        ],
        eos,
        pad,
        "openai",
        [_continuation(item, grammar, seed) for item, grammar in held],
        grammars,
        syntax,
    )


def _continuation(item: Item, grammar: str | None, seed: int) -> Continuation:
    if not isinstance(item, Request):
        return Continuation(0, Choice())
    s = item.sampling
    return Continuation(s.max_tokens, s.choice(seed, item.custom_id), s.stop, grammar)


def _stops(chats: bool, tok: Any, template: str | None) -> tuple[set[int], int]:
    """EOS ids (plus the template's end-of-turn tokens when any prompt is a
    conversation) and the pad id."""
    eos = tok.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    if chats:
        eos_ids |= set(end_of_turn_ids(tok, template))
    pad = tok.pad_token_id if tok.pad_token_id is not None else (min(eos_ids) if eos_ids else 0)
    return eos_ids, pad


def output_lines(
    work: Work,
    records: Sequence[int],
    mode: Mode,
    results: list[list[Generated] | list[Scored]],
    tok: Any,
    answering: Answering | None = None,
) -> bytes:
    """The output JSONL lines of ``records`` (``results``: per record, per sequence)."""
    if work.kind == "openai":
        assert answering is not None, "an OpenAI batch job names its model and ids"
        items = [work.records[i] for i in records]
        prompts = [work.seqs[i][0] if work.seqs[i] else [] for i in records]
        gens: list[list[Generated]] = results  # type: ignore[assignment]
        lines = answer_lines(items, prompts, gens, tok, answering, work.tool_syntax)  # type: ignore[arg-type]
        return ("\n".join(lines) + "\n").encode()
    lines = []
    for r, res in zip((work.records[i] for i in records), results):
        assert isinstance(r, InputRecord)
        rec: dict[str, Any] = {"index": r.line - 1}
        if r.id is not None:
            rec["id"] = r.id
        if mode == "generate":
            rec.update(_generated(res[0], tok))  # type: ignore[arg-type]
        else:
            rec.update(_scored(r, res))  # type: ignore[arg-type]
        lines.append(json.dumps(rec, ensure_ascii=False))
    return ("\n".join(lines) + "\n").encode()


def _generated(g: Generated, tok: Any) -> dict[str, Any]:
    return {
        "completion": tok.decode(g.tokens, skip_special_tokens=True),
        "tokens": len(g.tokens),
        "finish": g.finish,
    }


def _scored(r: InputRecord, res: list[Scored]) -> dict[str, Any]:
    if r.single:
        s = res[0]
        return {"logprob": s.logprob, "tokens": s.tokens, "greedy": s.greedy}
    lps = [s.logprob for s in res]
    best = max(range(len(lps)), key=lambda j: (lps[j], -j))
    assert r.choices is not None  # a score record has a completion or choices
    return {
        "choice": best,
        "label": r.choices[best],
        "logprobs": lps,
        "tokens": [s.tokens for s in res],
    }
