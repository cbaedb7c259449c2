"""What the reader thread does to a unit's tensors before compute: dequantize the
compressed copy of the decoder layers, merge a LoRA adapter, or both."""

from __future__ import annotations

from pathlib import Path

import torch

from shoestring.infer.adapter import LoraDelta
from shoestring.infer.codecs import Scheme
from shoestring.infer.engine import StreamingCausalLM
from shoestring.infer.quant import build_compressed, use_compressed
from shoestring.infer.stream import Prepare, Slot


def weight_hook(
    engine: StreamingCausalLM,
    scheme: Scheme | None,
    adapter: LoraDelta | None,
    compressed_dir: Path,
    source_id: str,
) -> tuple[Prepare | None, list[int]]:
    """The ``prepare`` hook for ``engine`` (None: use the tensors as read), and the scratch
    bytes each unit needs for it, including casts to the compute dtype.

    With ``scheme`` the decoder layers are compressed once into ``compressed_dir``
    (kept while ``source_id`` names the same model, adapter and scheme; the adapter is
    merged into the copy) and streamed from there."""
    hook: Prepare | None = None
    if adapter is not None:  # an adapted lm_head is no longer the embedding's tensor
        engine.untie(set(adapter.pairs))
    extra = [0] * len(engine.units)
    if scheme is not None:
        merge = (lambda k, t: adapter.merge_(k, t.float().clone())) if adapter else None
        dest = build_compressed(engine, compressed_dir, scheme, source_id, merge)
        hook, extra = use_compressed(engine, dest)
        if adapter is not None:  # layers are merged in the copy; embed/head still need it
            hook = _merged_outside_layers(hook, adapter, engine)
    elif adapter is not None:
        hook = _merged(adapter)
    return hook, [x + engine.cast_bytes(i) for i, x in enumerate(extra)]


def _merged(adapter: LoraDelta) -> Prepare:
    def prepare(i: int, t: dict[str, torch.Tensor], s: Slot) -> dict[str, torch.Tensor]:
        for k, v in t.items():
            adapter.merge_(k, v)
        return t

    return prepare


def _merged_outside_layers(
    dequantize: Prepare, adapter: LoraDelta, engine: StreamingCausalLM
) -> Prepare:
    def prepare(i: int, t: dict[str, torch.Tensor], s: Slot) -> dict[str, torch.Tensor]:
        out = dequantize(i, t, s)
        if not engine.units[i].name.startswith("layers."):
            for k, v in out.items():
                adapter.merge_(k, v)
        return out

    return prepare
