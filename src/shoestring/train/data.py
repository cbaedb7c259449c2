"""The sample order, a pure function of ``(seed, epoch)``, and in-memory records.

The data cursor is the number of samples consumed so far. Resuming at sample 10⁶
costs the same as at sample 10: one permutation of the dataset, no replay of
batches. Parsing, tokenizing, packing and caching live in :mod:`shoestring.data`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shoestring.data.formats import detect_format, parse_record
from shoestring.data.records import IGNORE_INDEX, DataError, Example, Record

__all__ = ["IGNORE_INDEX", "DataError", "Example", "Record"]


def from_dicts(rows: Sequence[dict[str, str]], name: str) -> list[Record]:
    """Records of an in-memory task (the built-in one), located as ``name:N``."""
    return [parse_record(r, f"{name}:{i + 1}", detect_format(r, name)) for i, r in enumerate(rows)]


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
