"""An 8-bit KV cache layer for transformers' ``DynamicCache``.

Keys and values are stored as int8 with one fp32 scale per (sequence, head,
token) — absmax over the head dimension / 127 — so each token is quantized on
its own when it arrives: appending never re-quantizes old tokens, no scale is
frozen from the prompt (transformers' fp8 backend clips later tokens to the
prompt's range), and a sequence's numbers do not depend on which other
sequences share its micro-batch. A fp32 cache shrinks ~3.8x, a bf16 one ~1.9x
(head_dim 64), so the budget fits a bigger job batch, and batching is what makes
streamed inference fast. Attention reads a dequantized copy of one layer at a
time.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from shoestring.infer.codecs import dequantize, int8_rows


class Int8KVLayer(DynamicLayer):
    """A full-attention cache layer holding int8 keys/values and per-token scales."""

    is_croppable = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]
        self.length = 0
        self._k: tuple[torch.Tensor, torch.Tensor] | None = None
        self._v: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.dtype = key_states.dtype

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._k = self._append(self._k, key_states)
        self._v = self._append(self._v, value_states)
        self.length += key_states.shape[-2]
        return self._dequantize(self._k), self._dequantize(self._v)

    @staticmethod
    def _append(
        old: tuple[torch.Tensor, torch.Tensor] | None, new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, s = int8_rows(new)
        if old is None:
            return q, s
        return torch.cat([old[0], q], dim=-2), torch.cat([old[1], s], dim=-2)

    def _dequantize(self, qs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        q, s = qs
        return dequantize(
            {"q8": q, "s": s}, torch.empty(q.shape, dtype=self.dtype, device=q.device)
        )

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers' convention: a
        negative count), e.g. to cut a pass that was stopped midway back off."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        n = max(self.length + tokens_to_remove, 0)
        if self._k is None or self._v is None or n == self.length:
            return
        self._k = tuple(t[..., :n, :] for t in self._k)  # type: ignore[assignment]
        self._v = tuple(t[..., :n, :] for t in self._v)  # type: ignore[assignment]
        self.length = n

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for qs in (self._k, self._v) if qs for t in qs)

    def offload(self) -> None:
        if self._k is not None and self._v is not None:
            self._k = (self._k[0].to("cpu", non_blocking=True), self._k[1].to("cpu"))
            self._v = (self._v[0].to("cpu", non_blocking=True), self._v[1].to("cpu"))

    def prefetch(self) -> None:
        if self._k is not None and self._v is not None and self._k[0].device != self.device:
            self._k = tuple(t.to(self.device, non_blocking=True) for t in self._k)  # type: ignore
            self._v = tuple(t.to(self.device, non_blocking=True) for t in self._v)  # type: ignore

    def reset(self) -> None:
        self._k = self._v = None
        self.length = 0
        super().reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for name in ("_k", "_v"):
            qs = getattr(self, name)
            if qs is not None:
                setattr(self, name, tuple(t.index_select(0, beam_idx.to(t.device)) for t in qs))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for name in ("_k", "_v"):
            qs = getattr(self, name)
            if qs is not None:
                setattr(self, name, tuple(t[indices, ...] for t in qs))


def int8_cache(config: Any, offloading: bool = False) -> DynamicCache:
    """A ``DynamicCache`` whose full-attention layers are :class:`Int8KVLayer`.

    Raises ValueError for models with other layer kinds (sliding-window, linear
    attention): their caches would stay in the model dtype and break the budget."""
    cache = DynamicCache(config=config, offloading=offloading)
    other = {type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer}
    if other:
        raise ValueError(
            f"an 8-bit KV cache supports full-attention layers only; this "
            f"model also has {', '.join(sorted(other))}"
        )
    cache.layers = [Int8KVLayer() for _ in cache.layers]
    return cache


def merge_left_padded(caches: list[Any], target: Any) -> Any | None:
    """Stack per-micro-batch caches into ``target`` (an empty cache of the same model),
    left-padding each to the longest, layer by layer (the sources are emptied as it
    goes, so the extra memory is one layer's worth). Returns ``target``, or None — and
    leaves the sources untouched — when a layer kind cannot be stacked this way
    (sliding-window or other layers that track their own positions)."""
    kinds = {type(layer) for c in caches for layer in c.layers} | {
        type(layer) for layer in target.layers
    }
    if not kinds <= {DynamicLayer, Int8KVLayer} or len(kinds) != 1:
        return None
    if any(not layer.is_initialized for c in caches for layer in c.layers):
        return None
    longest = max(c.layers[0].get_seq_length() for c in caches)

    def stack(parts: list[torch.Tensor], lengths: list[int]) -> torch.Tensor:
        return torch.cat(
            [torch.nn.functional.pad(p, (0, 0, longest - n, 0)) for p, n in zip(parts, lengths)],
            dim=0,
        )

    for i, dst in enumerate(target.layers):
        src = [c.layers[i] for c in caches]
        lengths = [layer.get_seq_length() for layer in src]
        if isinstance(dst, Int8KVLayer):
            dst.lazy_initialization(src[0].keys, src[0].values)
            ks, vs = [layer._k for layer in src], [layer._v for layer in src]
            dst._k = (stack([k[0] for k in ks], lengths), stack([k[1] for k in ks], lengths))
            dst._v = (stack([v[0] for v in vs], lengths), stack([v[1] for v in vs], lengths))
            dst.length = longest
            for layer in src:
                layer._k = layer._v = None
        else:
            dst.lazy_initialization(src[0].keys, src[0].values)
            dst.keys = stack([layer.keys for layer in src], lengths)
            dst.values = stack([layer.values for layer in src], lengths)
            for layer in src:
                layer.keys = layer.values = None
    return target


#: Cache layer kinds that a shared prefix's keys and values can be copied into: full
#: attention's (a sliding window tracks positions of its own and drops old tokens).
PREFIX_LAYERS = (DynamicLayer, Int8KVLayer)


def takes_prefix(cache: Any) -> bool:
    """Whether every layer of ``cache`` can start from a shared prefix's keys and values
    (:func:`fill_from_prefix`); never for an offloaded cache, whose layers move between
    devices inside the cache's own ``update``."""
    return not getattr(cache, "offloading", False) and all(
        type(layer) in PREFIX_LAYERS for layer in cache.layers
    )


def fill_from_prefix(src: Any, dst: Any, rows: int) -> None:
    """Start the empty cache layer ``dst`` with the keys and values of ``src``'s one
    sequence (a shared prompt prefix), repeated for ``rows`` sequences.

    ``dst`` holds expanded views, no copy: the layer's next update concatenates them
    with the rows' own tokens into new tensors, as every update does, so the memory is
    what the rows' caches take without sharing. An int8 layer takes the prefix's codes
    and scales as they are (quantizing is per token, so they are the codes each row
    would have computed)."""

    def rep(t: torch.Tensor) -> torch.Tensor:
        return t.expand(rows, *t.shape[1:])

    dst.lazy_initialization(src.keys, src.values)
    if isinstance(src, Int8KVLayer):
        assert src._k is not None and src._v is not None
        dst._k = (rep(src._k[0]), rep(src._k[1]))
        dst._v = (rep(src._v[0]), rep(src._v[1]))
        dst.length = src.length
    else:
        dst.keys, dst.values = rep(src.keys), rep(src.values)
