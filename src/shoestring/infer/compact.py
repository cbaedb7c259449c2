"""Ended sequences leave their micro-batch between two decode passes.

A batch of requests with mixed lengths would otherwise decode every row until its
longest request ends: a row that hit its end token or its limit keeps being fed a
pad token, and every layer computes it. Here its row leaves the micro-batch — its
input, mask and every cache layer's keys and values — and the mask columns (and
cache positions) that are left padding for every remaining row are cut off the
front, so a pass costs what its running sequences need. Positions are derived
from the mask (``cumsum``), so cutting whole padding columns changes no number.

Cache layers that cannot drop rows this way (layer kinds other than full
attention's dense or int8 layer, e.g. a sliding window that tracks its own
positions) keep their rows; the ended rows are then fed pad tokens as before and
their outputs are ignored.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from shoestring.infer.engine import MicroBatch
from shoestring.infer.kvcache import Int8KVLayer

_COMPACTABLE = (DynamicLayer, Int8KVLayer)


def drop_finished(
    groups: list[list[int]], mbs: list[MicroBatch], done: list[bool]
) -> tuple[list[list[int]], list[MicroBatch]]:
    """``groups`` and ``mbs`` without the rows of ended sequences (``done[i]``); a
    micro-batch whose rows all ended is dropped with its cache."""
    new_groups, new_mbs = [], []
    for g, mb in zip(groups, mbs):
        keep = [r for r, i in enumerate(g) if not done[i]]
        if not keep:
            continue
        if len(keep) < len(g) and _compactable(mb):
            _select_rows(mb, keep)
            g = [g[r] for r in keep]
        new_groups.append(g)
        new_mbs.append(mb)
    return new_groups, new_mbs


def _compactable(mb: MicroBatch) -> bool:
    return mb.cache is not None and all(
        type(layer) in _COMPACTABLE and layer.is_initialized for layer in mb.cache.layers
    )


def _select_rows(mb: MicroBatch, rows: list[int]) -> None:
    """Keep ``rows`` of the micro-batch, then cut the columns that are padding in all
    of them (the mask has one column more than the cache: the input to come)."""
    idx = torch.tensor(rows, dtype=torch.long)
    mb.input_ids = mb.input_ids[idx]
    mask = mb.attention_mask[idx]
    cut = int(mask.any(0).long().argmax())  # the first column some row attends to
    mb.attention_mask = mask[:, cut:].contiguous()
    for layer in mb.cache.layers:
        if isinstance(layer, Int8KVLayer):
            assert layer._k is not None and layer._v is not None
            layer._k = _rows_from(layer._k, idx, cut)
            layer._v = _rows_from(layer._v, idx, cut)
            layer.length -= cut
        else:
            layer.keys = layer.keys[idx.to(layer.keys.device), :, cut:].contiguous()
            layer.values = layer.values[idx.to(layer.values.device), :, cut:].contiguous()


def _rows_from(
    qs: tuple[torch.Tensor, torch.Tensor], idx: torch.Tensor, cut: int
) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = qs
    return (
        q[idx.to(q.device), :, cut:].contiguous(),
        s[idx.to(s.device), :, cut:].contiguous(),
    )
