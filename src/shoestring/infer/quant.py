"""Weight-only compression of the decoder layers' linear weights: building and using it.

Pure torch, so it runs on CPU and GPU alike (AirLLM's needs CUDA). The
compressed copy is written once, unit by unit, into the run directory and then
streamed instead of the original layers, so every pass reads 4x (int8 from
fp32) to ~7x (nf4 from fp32) fewer bytes. Dequantization happens in the reader
thread into a per-slot scratch buffer, overlapping compute like the reads do.
The codecs themselves (int8 per output row, nf4 per 64 inputs) are in
:mod:`shoestring.infer.codecs`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from shoestring.infer.codecs import (
    GROUP,
    Scheme,
    dequantize,
    dequantize_scratch,
    quantize,
    quantize_scratch,
)
from shoestring.infer.engine import StreamingCausalLM
from shoestring.infer.layercopy import layer_file, numel, settle, write_once
from shoestring.infer.shards import (
    ReadPlan,
    ShardReader,
    TensorRef,
    aligned_empty,
    generic_key,
    plan_reads,
    read_header,
    views,
)
from shoestring.infer.stream import Prepare, Slot

#: Rewrites one tensor before it is quantized (e.g. merges a LoRA adapter into it).
Transform = Callable[[str, torch.Tensor], torch.Tensor]


def _compressible(key: str, ref: TensorRef) -> bool:
    return len(ref.shape) == 2 and ref.dtype.is_floating_point and key.endswith(".weight")


def build_compressed(
    engine: StreamingCausalLM,
    dest: Path,
    scheme: Scheme,
    source_id: str,
    transform: Transform | None = None,
) -> Path:
    """Write ``dest``/layers.N.safetensors for every decoder layer, once
    (:func:`shoestring.infer.layercopy.write_once`: committed like a checkpoint, kept
    while ``source_id`` is the same). ``transform`` (e.g. merging a LoRA adapter) is
    applied before quantizing."""
    layout = compressed_layout(engine, scheme)
    nbytes = sum(n for u, n in zip(engine.units, layout.read) if u.name.startswith("layers."))
    write_once(
        dest,
        source_id,
        {"scheme": scheme},
        nbytes,
        lambda tmp: _write_layers(engine, tmp, scheme, transform),
    )
    return dest


def _write_layers(
    engine: StreamingCausalLM, tmp: Path, scheme: Scheme, transform: Transform | None
) -> None:
    """Read each decoder layer once, one tensor at a time, and write its compressed copy
    into ``tmp`` (what it holds at once: :func:`compressed_layout`'s ``build``)."""
    from safetensors.torch import save_file

    reader = ShardReader()
    largest, cols = _largest_tensor(engine)
    buf = aligned_empty(largest)
    try:
        for unit in engine.units:
            if not unit.name.startswith("layers."):
                continue
            out: dict[str, torch.Tensor] = {}
            for ref in unit.refs:
                plan = plan_reads([ref])
                reader.read(plan, buf)
                t = views(plan, buf)[ref.key]
                out.update(_compressed(ref, t, scheme, transform, quantize_scratch(largest, cols)))
            path = layer_file(tmp, unit.name)
            save_file(out, str(path))
            del out
            settle(path)
    finally:
        reader.close()


def _largest_tensor(engine: StreamingCausalLM) -> tuple[int, int]:
    """The most bytes one decoder-layer tensor takes read on its own, and the widest row."""
    plans: list[tuple[ReadPlan, TensorRef]] = [
        (plan_reads([r]), r) for u in engine.units if u.name.startswith("layers.") for r in u.refs
    ]
    return max(p.nbytes for p, _ in plans), max(r.shape[-1] if r.shape else 1 for _, r in plans)


def _compressed(
    ref: TensorRef, t: torch.Tensor, scheme: Scheme, transform: Transform | None, scratch: int
) -> dict[str, torch.Tensor]:
    """One tensor as stored in the copy: a compressible weight as its parts
    (``key::q8``/``key::s`` or ``key::q4``/``key::a``), the rest as it is (copied out of
    the read buffer, which the next tensor reuses)."""
    if transform is not None:
        t = transform(ref.key, t)
    if _compressible(ref.key, ref):
        return {f"{ref.key}::{k}": part for k, part in quantize(t, scheme, scratch=scratch).items()}
    return {ref.key: t.clone()}


@dataclass(frozen=True)
class Layout:
    """What streaming a compressed copy takes, per unit, known before it is written."""

    read: list[int]  # bytes of each unit's tensors as streamed
    scratch: list[int]  # its dequantized weights, in slot scratch
    temps: list[int]  # what dequantizing it takes on top, for a moment
    build: int  # what writing the copy holds at once (without a transform's temporaries)


def compressed_layout(engine: StreamingCausalLM, scheme: Scheme) -> Layout:
    """The layout of ``engine``'s decoder layers compressed with ``scheme`` (from the
    original tensors' shapes; call it before :func:`use_compressed` repoints them).
    A layer's scratch includes its other tensors' casts to the compute dtype; other
    units' casts are not in it (:meth:`StreamingCausalLM.cast_bytes`)."""
    n = len(engine.units)
    read, scratch, temps = [u.plan.nbytes for u in engine.units], [0] * n, [0] * n
    unit = part = 0
    for i, u in enumerate(engine.units):
        if not u.name.startswith("layers."):
            continue
        read[i] = 0
        for r in u.refs:
            packed = _packed_bytes(r, scheme) if _compressible(r.key, r) else r.nbytes
            read[i] += packed
            part = max(part, packed)
            if _compressible(r.key, r) or (r.dtype.is_floating_point and r.dtype != engine.dtype):
                scratch[i] += engine.dtype.itemsize * numel(r.shape)  # dequantized, or cast
            if _compressible(r.key, r):
                code = "q4" if scheme == "nf4" and r.shape[-1] % GROUP == 0 else "q8"
                temps[i] = max(temps[i], dequantize_scratch(r.shape, code, engine.dtype))
        unit = max(unit, read[i])
    # One tensor read, its layer's copy built (a weight's row blocks' parts and their
    # concatenation beside them) and serialized by save_file (a second copy).
    largest, cols = _largest_tensor(engine)
    build = largest + 2 * unit + 2 * part + quantize_scratch(largest, cols)
    return Layout(read, scratch, temps, build)


def _packed_bytes(ref: TensorRef, scheme: Scheme) -> int:
    rows, cols = ref.shape[0], ref.shape[-1]
    if scheme == "nf4" and cols % GROUP == 0:
        return rows * cols // 2 + rows * (cols // GROUP) * 4
    return rows * cols + rows * 4


def use_compressed(engine: StreamingCausalLM, src: Path) -> tuple[Prepare, list[int]]:
    """Point the decoder-layer units at the compressed files.

    Returns the ``prepare`` hook that dequantizes into slot scratch buffers, and
    the scratch bytes each unit needs once read (its dequantized weights)."""
    shapes: dict[int, dict[str, tuple[tuple[int, ...], torch.dtype]]] = {}
    scratch = [0] * len(engine.units)
    for i, unit in enumerate(engine.units):
        if not unit.name.startswith("layers."):
            continue
        refs = read_header(layer_file(src, unit.name))
        shapes[i] = {
            r.key: (r.shape, r.dtype)
            for r in unit.refs
            if f"{r.key}::q8" in refs or f"{r.key}::q4" in refs
        }
        scratch[i] = sum(engine.dtype.itemsize * numel(s) for s, _ in shapes[i].values())
        engine.replace_refs(i, list(refs.values()))

    def prepare(i: int, tensors: dict[str, torch.Tensor], slot: Slot) -> dict[str, torch.Tensor]:
        if i not in shapes:
            return tensors
        out = {k: v for k, v in tensors.items() if "::" not in k}
        device = next(iter(tensors.values())).device
        for key, (shape, _dt) in shapes[i].items():
            buf = slot.buffer(generic_key(key), shape, engine.dtype, device)
            parts = {
                s: tensors[f"{key}::{s}"]
                for s in ("q8", "s", "q4", "a")
                if f"{key}::{s}" in tensors
            }
            out[key] = dequantize(parts, buf)
        return out

    return prepare, scratch
