"""Training data: JSONL records → token examples → an O(1)-resumable sample order.

Two record shapes are accepted, one per line:
``{"text": ...}`` (loss on every token) and ``{"prompt": ..., "completion": ...}``
(loss on the completion and EOS only). A malformed line fails with ``file:line``
before any model is loaded.

The sample order is a pure function of ``(seed, epoch)``; the data cursor is the
number of samples consumed so far. Resuming at sample 10⁶ costs the same as
at sample 10: one permutation of the dataset, no replay of batches.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from shoestring.data.records import IGNORE_INDEX, DataError, Example, Record

__all__ = ["IGNORE_INDEX", "DataError", "Example", "Record"]


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def parse_record(obj: Any, where: str) -> Record:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    keys = set(obj)
    if "text" in keys:
        extra = keys - {"text"}
        if extra & {"prompt", "completion"}:
            raise DataError(f"{where}: use either 'text' or 'prompt'+'completion', not both")
        if not isinstance(obj["text"], str):
            raise DataError(f"{where}: 'text' must be a string")
        if not obj["text"]:
            raise DataError(f"{where}: 'text' is empty")
        return Record(where, text=obj["text"])
    if "prompt" in keys and "completion" in keys:
        for k in ("prompt", "completion"):
            if not isinstance(obj[k], str):
                raise DataError(f"{where}: '{k}' must be a string")
        if not obj["completion"]:
            raise DataError(f"{where}: 'completion' is empty")
        return Record(where, prompt=obj["prompt"], completion=obj["completion"])
    missing = (
        "'completion'"
        if "prompt" in keys
        else "'prompt'"
        if "completion" in keys
        else "'text' or 'prompt'+'completion'"
    )
    raise DataError(f"{where}: missing {missing} (keys found: {sorted(keys) or 'none'})")


def read_jsonl(path: str | Path) -> list[Record]:
    """Read and validate every line of a JSONL file."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: no such file")
    records: list[Record] = []
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{p}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from e
            records.append(parse_record(obj, where))
    if not records:
        raise DataError(f"{p}: no records")
    return records


def from_dicts(rows: Sequence[dict[str, str]], name: str) -> list[Record]:
    return [parse_record(r, f"{name}:{i + 1}") for i, r in enumerate(rows)]


def tokenize(
    records: Sequence[Record],
    tok: Tokenizer,
    max_length: int,
    should_stop: Callable[[], bool] = lambda: False,
) -> list[Example]:
    """Turn records into examples, truncated to ``max_length`` tokens."""
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    out: list[Example] = []
    for i, r in enumerate(records):
        if i % 1024 == 0 and should_stop():
            raise InterruptedError("preempted while tokenizing")
        if r.text is not None:
            ids = bos + tok.encode(r.text, add_special_tokens=False) + eos
            labels = list(ids)
            if bos:
                labels[0] = IGNORE_INDEX
        else:
            p = bos + tok.encode(r.prompt or "", add_special_tokens=False)
            c = tok.encode(r.completion or "", add_special_tokens=False) + eos
            ids = p + c
            labels = [IGNORE_INDEX] * len(p) + c
        ids, labels = ids[:max_length], labels[:max_length]
        if all(x == IGNORE_INDEX for x in labels[1:]):
            raise DataError(
                f"{r.source}: nothing to learn after truncation to "
                f"data.max_length={max_length} (prompt too long?)"
            )
        out.append(Example(ids, labels))
    return out


def pack(examples: Sequence[Example], block: int) -> list[Example]:
    """Concatenate examples and cut them into full blocks (the remainder is dropped)."""
    ids: list[int] = []
    labels: list[int] = []
    for ex in examples:
        ids += ex.input_ids
        labels += ex.labels
    n = len(ids) // block
    if n == 0:
        raise DataError(f"not enough tokens ({len(ids)}) for one packed block of {block}")
    return [
        Example(ids[i * block : (i + 1) * block], labels[i * block : (i + 1) * block])
        for i in range(n)
    ]


def label_count(ex: Example) -> int:
    """Label tokens that enter the loss (labels are shifted by one, so the first never does)."""
    return sum(1 for t in ex.labels[1:] if t != IGNORE_INDEX)


def collate(batch: Sequence[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example; padding is masked out of attention and loss."""
    width = max(len(ex.input_ids) for ex in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ex in enumerate(batch):
        n = len(ex.input_ids)
        ids[row, :n] = torch.tensor(ex.input_ids)
        labels[row, :n] = torch.tensor(ex.labels)
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class SampleOrder:
    """Global sample order: epoch ``e`` is a permutation seeded by ``(seed, e)``.

    ``indices(start, count)`` returns dataset indices for global positions
    ``start .. start+count-1``. It depends only on the arguments, never on how
    the run got there, so a resume needs only ``start`` (the data cursor). It
    also does not depend on the world size: later, rank ``r`` of ``W`` simply
    takes its slice of the same global positions.
    """

    def __init__(self, size: int, seed: int) -> None:
        if size <= 0:
            raise DataError("empty dataset")
        self.size = size
        self.seed = seed
        self._cache: tuple[int, list[int]] | None = None

    def _perm(self, epoch: int) -> list[int]:
        if self._cache is None or self._cache[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._cache = (epoch, torch.randperm(self.size, generator=g).tolist())
        return self._cache[1]

    def indices(self, start: int, count: int) -> list[int]:
        out = []
        for pos in range(start, start + count):
            epoch, i = divmod(pos, self.size)
            out.append(self._perm(epoch)[i])
        return out

    def epoch_of(self, position: int) -> int:
        return position // self.size
