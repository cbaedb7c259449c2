"""Best-fit packing that keeps samples whole and apart in attention.

Samples are placed whole into rows of at most ``block`` tokens by best-fit
decreasing (:func:`pack_bins`). A packed row is fed to the model as
``input_ids``, ``labels`` and ``position_ids`` with **no** ``attention_mask``
(:func:`collate_packed`): position ids restart at 0 for every sample, and
transformers (5.x, ``masking_utils.find_packed_sequence_indices``) turns each
run of consecutive positions into its own causal block for sdpa, eager and
flex attention, while flash-attention uses the same position ids for its
variable-length kernel. A token therefore attends only to earlier tokens of
its own sample, exactly as if the sample were run alone.

Flash attention (``flash_attention_2``/``3``) reads the position ids only for a
batch of **one** row (``modeling_flash_attention_utils._is_packed_sequence``); with
more rows and no mask it runs plain causal attention across samples. For flash
attention, feed :func:`flatten_packed` of the batch (all rows as one row).

transformers detects packing only when the model runs **without a cache**: call
it with ``use_cache=False`` (or ``config.use_cache = False``, as the trainer
does). With a cache, the position ids are ignored for masking and attention
crosses sample boundaries again.
"""

from __future__ import annotations

import contextlib
import io
from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy
import torch

from shoestring.data.records import IGNORE_INDEX, DataError, Example
from shoestring.fsio import atomic_write

__all__ = [
    "PackPlan",
    "collate_packed",
    "flatten_packed",
    "pack_bins",
    "pack_plan",
    "packing_stats",
]


class _OpenBins:
    """Bins that still have room, grouped by how much room they have.

    ``_rooms`` lists the distinct room sizes in ascending order (at most
    ``block`` values), so finding the fullest bin that fits a sample is one
    bisect, and a bin moves between groups in O(1) plus a short list insert.
    """

    def __init__(self) -> None:
        self._rooms: list[int] = []
        self._bins_by_room: dict[int, list[int]] = {}

    def take_fullest_fitting(self, size: int) -> tuple[int, int] | None:
        """Remove and return ``(bin, room)`` for the bin with the least room >= ``size``."""
        at = bisect_left(self._rooms, size)
        if at == len(self._rooms):
            return None
        room = self._rooms[at]
        group = self._bins_by_room[room]
        bin_id = group.pop()
        if not group:
            del self._rooms[at]
            del self._bins_by_room[room]
        return bin_id, room

    def put(self, bin_id: int, room: int) -> None:
        if room <= 0:
            return  # full: no sample (length >= 1) can ever join it
        group = self._bins_by_room.get(room)
        if group is None:
            self._bins_by_room[room] = [bin_id]
            insort(self._rooms, room)
        else:
            group.append(bin_id)


def _validated_lengths(lengths: Sequence[int] | numpy.ndarray, block: int) -> numpy.ndarray:
    if block <= 0:
        raise DataError(f"packing: block must be positive, got {block}")
    sizes = numpy.asarray(lengths, dtype=numpy.int64).reshape(-1)
    bad = numpy.flatnonzero((sizes <= 0) | (sizes > block))
    if bad.size:
        index = int(bad[0])
        size = int(sizes[index])
        why = "is empty" if size <= 0 else f"has {size} tokens, more than the block of {block}"
        raise DataError(
            f"packing: sample {index} {why} "
            f"(truncate samples to data.max_length <= the packing block)"
        )
    return sizes


def pack_bins(lengths: Sequence[int] | numpy.ndarray, block: int) -> list[list[int]]:
    """Group sample indices into rows of at most ``block`` tokens, keeping samples whole.

    Best-fit decreasing: samples are taken longest first (ties by index) and each
    goes into the fullest row it fits, or opens a new row. Deterministic. Rows are
    listed by their first (smallest) index; each row's indices ascend. Any two rows
    together hold more than ``block`` tokens (a sample only opens a row when it fits
    in no other), so at most one row is half full or less.

    Raises :class:`DataError` for a length ``<= 0`` or ``> block``.
    """
    sizes = _validated_lengths(lengths, block)
    order = numpy.argsort(-sizes, kind="stable")
    contents: list[list[int]] = []
    open_bins = _OpenBins()
    for index, size in zip(order.tolist(), sizes[order].tolist(), strict=True):
        found = open_bins.take_fullest_fitting(size)
        if found is None:
            bin_id, room = len(contents), block
            contents.append([])
        else:
            bin_id, room = found
        contents[bin_id].append(index)
        open_bins.put(bin_id, room - size)
    rows = [sorted(row) for row in contents]
    rows.sort(key=lambda row: row[0])
    return rows


@dataclass(frozen=True)
class PackPlan:
    """Rows of sample indices as two flat arrays (row ``p`` is
    ``samples[rows[p]:rows[p + 1]]``): a few bytes per sample instead of a Python list
    per row, and saved beside the tokenized cache so a restart does not pack again."""

    rows: numpy.ndarray  # int64, n_rows + 1 offsets
    samples: numpy.ndarray  # int64, every sample index once

    @classmethod
    def of(cls, bins: Sequence[Sequence[int]]) -> PackPlan:
        rows = numpy.zeros(len(bins) + 1, dtype=numpy.int64)
        numpy.cumsum([len(b) for b in bins], out=rows[1:])
        flat = numpy.fromiter(chain.from_iterable(bins), numpy.int64, int(rows[-1]))
        return cls(rows, flat)

    def __len__(self) -> int:
        return len(self.rows) - 1

    def row(self, p: int) -> list[int]:
        indices: list[int] = self.samples[self.rows[p] : self.rows[p + 1]].tolist()
        return indices

    def save(self, path: Path) -> None:
        buf = io.BytesIO()
        numpy.save(buf, numpy.concatenate([[len(self.rows)], self.rows, self.samples]))
        atomic_write(path, buf.getvalue(), durable=False)  # derived: a loss only repacks

    @classmethod
    def load(cls, path: Path, n_samples: int) -> PackPlan | None:
        """The saved plan, or None when absent or not a plan of ``n_samples`` samples."""
        try:
            flat = numpy.load(path, allow_pickle=False)
            n = int(flat[0])
            rows, samples = flat[1 : 1 + n], flat[1 + n :]
        except (OSError, ValueError, IndexError):
            return None
        whole = len(rows) >= 1 and rows[0] == 0 and rows[-1] == len(samples) == n_samples
        if not whole or numpy.any(numpy.diff(rows) <= 0):
            return None
        if n_samples and not numpy.array_equal(numpy.sort(samples), numpy.arange(n_samples)):
            return None
        return cls(rows, samples)


def pack_plan(lengths: Sequence[int] | numpy.ndarray, block: int, saved: Path | None) -> PackPlan:
    """:func:`pack_bins` as a :class:`PackPlan`, read from ``saved`` when it holds one for
    these samples (else computed and saved there)."""
    n = len(lengths)
    plan = PackPlan.load(saved, n) if saved is not None and saved.exists() else None
    if plan is None:
        plan = PackPlan.of(pack_bins(lengths, block))
        if saved is not None:
            with contextlib.suppress(OSError):
                plan.save(saved)
    return plan


def _packed_row(examples: Sequence[Example], row: int) -> tuple[list[int], list[int], list[int]]:
    """Token ids, labels and position ids of one row, before padding."""
    if not examples:
        raise DataError(f"packing: row {row} has no samples")
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    for k, example in enumerate(examples):
        n = len(example.input_ids)
        if n == 0 or len(example.labels) != n:
            raise DataError(
                f"packing: row {row}, sample {k}: {n} input ids but "
                f"{len(example.labels)} labels (expected the same, at least 1)"
            )
        ids += example.input_ids
        labels += [IGNORE_INDEX, *example.labels[1:]]
        positions += range(n)
    return ids, labels, positions


def collate_packed(
    rows: Sequence[Sequence[Example]], pad_id: int, width: int | None = None
) -> dict[str, torch.Tensor]:
    """One tensor row per packed row: its samples concatenated, ready for the model.

    * ``position_ids`` restart at 0 for every sample, which is what separates the
      samples in attention (see the module docstring; pass no ``attention_mask``).
    * The label of each sample's **first** token is ``IGNORE_INDEX``. The model shifts
      labels inside the row, so that label would otherwise train the previous
      sample's last token to predict the next sample's first token. Alone, a sample's
      first label is never used either (nothing precedes it), so this changes nothing
      for the loss or for counting label tokens: the label tokens of a packed row
      (``labels[1:] != IGNORE_INDEX``, as for any row) are exactly the sum of
      ``label_count`` of its samples, each counted unpacked as ``labels[1:]``.
    * Each row is right-padded to ``width`` (default: the longest row) with
      ``pad_id``, ``IGNORE_INDEX`` labels and position ids ``0, 1, ...``: the padding
      is one more segment of its own, which never attends into a sample (and no
      sample attends to it, as it comes last).

    Returns long tensors ``input_ids``, ``labels``, ``position_ids`` of shape
    ``(len(rows), width)``. Raises :class:`DataError` if a row is longer than ``width``.
    """
    built = [_packed_row(examples, r) for r, examples in enumerate(rows)]
    if not built:
        raise DataError("packing: no rows to collate")
    longest = max(len(ids) for ids, _, _ in built)
    width = longest if width is None else width
    input_ids = torch.full((len(built), width), pad_id, dtype=torch.long)
    labels = torch.full((len(built), width), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((len(built), width), dtype=torch.long)
    for r, (row_ids, row_labels, row_positions) in enumerate(built):
        n = len(row_ids)
        if n > width:
            raise DataError(f"packing: row {r} has {n} tokens, more than the width of {width}")
        input_ids[r, :n] = torch.tensor(row_ids, dtype=torch.long)
        labels[r, :n] = torch.tensor(row_labels, dtype=torch.long)
        position_ids[r, :n] = torch.tensor(row_positions, dtype=torch.long)
        position_ids[r, n:] = torch.arange(width - n, dtype=torch.long)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def flatten_packed(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A :func:`collate_packed` batch as one row of shape ``(1, rows * width)``.

    Needed for flash attention, which separates samples by position ids only in a
    batch of one row; correct for sdpa and eager too (with a mask ``rows`` times
    larger). The loss is unchanged: every row starts with a sample whose first label
    is ``IGNORE_INDEX``, so no token learns across a row boundary either.
    """
    return {name: tensor.reshape(1, -1) for name, tensor in batch.items()}


def packing_stats(
    bins: Sequence[Sequence[int]], lengths: Sequence[int] | numpy.ndarray, block: int
) -> dict[str, float]:
    """``rows``, ``samples``, ``tokens`` and ``fill`` (tokens / (rows * block)) of a packing."""
    sizes = numpy.asarray(lengths, dtype=numpy.int64).reshape(-1)
    members = numpy.fromiter(chain.from_iterable(bins), dtype=numpy.int64)
    samples = int(members.size)
    tokens = int(sizes[members].sum())
    rows = len(bins)
    fill = tokens / (rows * block) if rows and block > 0 else 0.0
    return {"rows": float(rows), "samples": float(samples), "tokens": float(tokens), "fill": fill}
