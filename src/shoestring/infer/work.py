"""The job's work: input records as token sequences, and results as output lines."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from shoestring.config import ConfigError
from shoestring.data.chat import end_of_turn_ids, prompt_ids
from shoestring.data.records import DataError
from shoestring.infer.decode import Generated, Scored
from shoestring.infer.inputs import Record

#: ``generate.mode``: greedy continuation, or the log-likelihood of given completions.
Mode = Literal["generate", "score"]


@dataclass
class Work:
    """Tokenized job: one or more sequences per record."""

    records: list[Record]
    seqs: list[list[list[int]]]  # per record: its sequences (prompt [+ completion] tokens)
    starts: list[list[int]]  # per record: index of the first completion token (score mode)
    eos_ids: set[int] = field(default_factory=set)
    pad_id: int = 0

    def sequences(self, records: range) -> list[tuple[int, int]]:
        """(record, sequence) of every sequence of ``records``, in order."""
        return [(i, j) for i in records for j in range(len(self.seqs[i]))]


def _context(r: Record, tok: Any, template: str | None) -> list[int]:
    """The prompt's tokens: a conversation rendered with the chat template (with the
    assistant header, as training rendered it), else the text with the tokenizer's
    special tokens."""
    if r.messages is None:
        return list(tok(r.prompt)["input_ids"])
    try:
        return prompt_ids(r.messages, tok, template, r.tools)
    except DataError as e:
        raise ConfigError(f"io.input: line {r.line}: {e}") from None


def tokenize(records: list[Record], tok: Any, mode: str, template: str | None = None) -> Work:
    seqs, starts = [], []
    for r in records:
        ctx = _context(r, tok, template)
        if mode == "generate":
            if not ctx:
                raise ConfigError(f"io.input: line {r.line}: the prompt has no tokens")
            seqs.append([ctx])
            starts.append([len(ctx)])
            continue
        if not ctx:
            raise ConfigError(
                f"io.input: line {r.line}: score mode needs a non-empty prompt "
                "(the first completion token is predicted from it)"
            )
        outs = [r.completion] if r.completion is not None else list(r.choices or ())
        conts = [tok(c, add_special_tokens=False)["input_ids"] for c in outs]
        seqs.append([ctx + c for c in conts])
        starts.append([len(ctx)] * len(conts))
    return Work(records, seqs, starts, *_stops(records, tok, template))


def _stops(records: list[Record], tok: Any, template: str | None) -> tuple[set[int], int]:
    """EOS ids (plus the template's end-of-turn tokens when any prompt is a
    conversation) and the pad id."""
    eos = tok.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    if any(r.messages is not None for r in records):
        eos_ids |= set(end_of_turn_ids(tok, template))
    pad = tok.pad_token_id if tok.pad_token_id is not None else (min(eos_ids) if eos_ids else 0)
    return eos_ids, pad


def output_lines(
    work: Work, records: range, mode: str, results: list[list[Generated] | list[Scored]], tok: Any
) -> bytes:
    """The output JSONL lines of ``records`` (``results``: per record, per sequence)."""
    lines = []
    for r, res in zip((work.records[i] for i in records), results):
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


def _scored(r: Record, res: list[Scored]) -> dict[str, Any]:
    if r.completion is not None:
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
