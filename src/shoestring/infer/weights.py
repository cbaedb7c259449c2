"""What the reader thread does to a unit's tensors before compute: dequantize the
compressed copy of the decoder layers (or a checkpoint stored quantized: :mod:`.stored`),
merge a LoRA adapter, or both; and what that takes in memory, per unit, for the plan
(:class:`shoestring.infer.plan.Needs`)."""

from __future__ import annotations

from pathlib import Path

import torch

from shoestring.infer.adapter import LoraDelta
from shoestring.infer.codecs import Scheme
from shoestring.infer.decoded import build_decoded, decoded_needs, layer_units, use_decoded
from shoestring.infer.engine import StreamingCausalLM
from shoestring.infer.plan import Needs
from shoestring.infer.quant import Layout, build_compressed, compressed_layout, use_compressed
from shoestring.infer.stored import StoredWeights
from shoestring.infer.stream import Prepare, Slot


def weight_needs(
    engine: StreamingCausalLM,
    scheme: Scheme | None,
    adapter: LoraDelta | None,
    stored: StoredWeights | None = None,
    *,
    decode_once: bool = False,
) -> Needs:
    """What :func:`weight_hook` will give, known before anything is read or written."""
    needs = _streamed_needs(engine, scheme, adapter, stored)
    return decoded_needs(engine, needs, stored) if decode_once else needs


def _streamed_needs(
    engine: StreamingCausalLM,
    scheme: Scheme | None,
    adapter: LoraDelta | None,
    stored: StoredWeights | None,
) -> Needs:
    """The needs of streaming the checkpoint as stored (or its compressed copy)."""
    if adapter is not None:  # an adapted lm_head is no longer the embedding's tensor
        engine.untie(set(adapter.pairs))
    if stored is not None:
        return _stored_needs(engine, stored, adapter)
    n = len(engine.units)
    layout = (
        compressed_layout(engine, scheme)
        if scheme is not None
        else Layout(engine.unit_bytes, [0] * n, [0] * n, 0)
    )
    compressed = scheme is not None
    layers = [compressed and u.name.startswith("layers.") for u in engine.units]
    fused = [engine.fuse_bytes(i) for i in range(n)]
    return Needs(
        layout.read,
        [
            x + (0 if layers[i] else engine.cast_bytes(i)) + fused[i][0]
            for i, x in enumerate(layout.scratch)
        ],
        [
            t + _merge_scratch(engine, i, adapter, compressed) + fused[i][1]
            for i, t in enumerate(layout.temps)
        ],
        layout.build + _merge_in_copy(engine, adapter) if compressed else 0,
        _raw_kept(engine),
        _kinds(engine),
    )


def _stored_needs(
    engine: StreamingCausalLM, stored: StoredWeights, adapter: LoraDelta | None
) -> Needs:
    """A quantized checkpoint streamed as stored: its stored parts read, its weights
    dequantized into scratch in the compute dtype (other floats cast beside them), and
    for a moment a row block of that plus an adapter's ``B @ A`` row block."""
    dtype, n = engine.dtype, len(engine.units)
    fused = [engine.fuse_bytes(i) for i in range(n)]
    return Needs(
        engine.unit_bytes,
        [stored.scratch(i, dtype) + engine.cast_bytes(i) + fused[i][0] for i in range(n)],
        [
            stored.temps(i, dtype) + _stored_merge(engine, stored, i, adapter) + fused[i][1]
            for i in range(n)
        ],
        0,
        _raw_kept(engine),
        _kinds(engine),
    )


def _stored_merge(
    engine: StreamingCausalLM, stored: StoredWeights, i: int, adapter: LoraDelta | None
) -> int:
    """The adapter's row-block temporaries while unit ``i`` of a quantized checkpoint is
    prepared: merged into the dequantized weights (compute dtype) and the plain tensors."""
    if adapter is None:
        return 0
    weights = [(k, shape, engine.dtype) for k, shape in stored.shapes(i).items()]
    plain = [(r.key, r.shape, r.dtype) for r in engine.units[i].refs if "::" not in r.key]
    return max((adapter.scratch(*w) for w in weights + plain), default=0)


def _merge_scratch(
    engine: StreamingCausalLM, i: int, adapter: LoraDelta | None, compressed: bool
) -> int:
    """The adapter's row-block temporaries while unit ``i`` is prepared (none for a
    compressed decoder layer: its copy has the adapter merged already)."""
    if adapter is None or (compressed and engine.units[i].name.startswith("layers.")):
        return 0
    return max((adapter.scratch(r.key, r.shape, r.dtype) for r in engine.units[i].refs), default=0)


def _merge_in_copy(engine: StreamingCausalLM, adapter: LoraDelta | None) -> int:
    """What merging the adapter into a decoder layer's weight takes while the compressed
    copy is written: the weight as an fp32 copy and a row block of the product."""
    if adapter is None:
        return 0
    return max(
        (
            4 * _numel(r.shape) + adapter.scratch(r.key, r.shape, torch.float32)
            for u in engine.units
            if u.name.startswith("layers.")
            for r in u.refs
            if r.key in adapter.pairs
        ),
        default=0,
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def weight_hook(
    engine: StreamingCausalLM,
    scheme: Scheme | None,
    adapter: LoraDelta | None,
    copy_dir: Path,
    source_id: str,
    stored: StoredWeights | None = None,
    *,
    decode_once: bool = False,
) -> tuple[Prepare | None, Needs]:
    """The ``prepare`` hook for ``engine`` (None: use the tensors as read), and what the
    weights take per unit (:class:`Needs`).

    With ``scheme`` the decoder layers are compressed once into ``copy_dir`` (kept
    while ``source_id`` names the same model, adapter and scheme; the adapter is
    merged into the copy) and streamed from there. With ``stored`` (a checkpoint stored
    quantized; ``scheme`` is then None) its weights are dequantized as they
    are streamed, and an adapter merged into them. With ``decode_once`` the layers are
    written into ``copy_dir`` as that would prepare them (:mod:`.decoded`)."""
    needs = weight_needs(engine, scheme, adapter, stored, decode_once=decode_once)
    if decode_once:
        return _decoded_once(engine, adapter, stored, copy_dir, source_id, needs)
    if stored is not None:
        return _stored_hook(engine, adapter, stored), needs
    hook: Prepare | None = None
    extra = [0] * len(engine.units)
    if scheme is not None:
        merge = (
            (lambda k, t: adapter.merge_(k, t.to(torch.float32, copy=True))) if adapter else None
        )
        dest = build_compressed(engine, copy_dir, scheme, source_id, merge)
        hook, extra = use_compressed(engine, dest)
        if adapter is not None:  # layers are merged in the copy; embed/head still need it
            hook = _merged_outside_layers(hook, adapter, engine)
    elif adapter is not None:
        hook = _merged(adapter)
    cast = [x + engine.cast_bytes(i) + engine.fuse_bytes(i)[0] for i, x in enumerate(extra)]
    return hook, Needs(
        engine.unit_bytes, cast, needs.prepare, needs.build, _raw_kept(engine), _kinds(engine)
    )


def _stored_hook(
    engine: StreamingCausalLM, adapter: LoraDelta | None, stored: StoredWeights
) -> Prepare:
    dequantize = stored.hook(engine.dtype)
    return _merged_after(dequantize, adapter) if adapter else dequantize


def _decoded_once(
    engine: StreamingCausalLM,
    adapter: LoraDelta | None,
    stored: StoredWeights | None,
    copy_dir: Path,
    source_id: str,
    needs: Needs,
) -> tuple[Prepare | None, Needs]:
    """The layers decoded once into ``copy_dir`` by the hook that would stream them, then
    streamed from there; the embedding and head keep that hook."""
    hook = (
        _stored_hook(engine, adapter, stored)
        if stored is not None
        else (_merged(adapter) if adapter is not None else None)
    )
    build_decoded(
        engine, copy_dir, source_id, hook, sum(needs.read[i] for i in layer_units(engine))
    )
    hook = use_decoded(engine, copy_dir, hook)
    return hook, Needs(
        engine.unit_bytes, needs.extra, needs.prepare, needs.build, _raw_kept(engine),
        _kinds(engine),
    )  # fmt: skip


def _kinds(engine: StreamingCausalLM) -> list[str]:
    """Per unit, the scratch buffers it prepares into: the embedding's, the decoder
    layers' (one set, by generic name), the head's."""
    return [u.name.split(".")[0] for u in engine.units]


def _raw_kept(engine: StreamingCausalLM) -> list[bool]:
    """Per unit, as it will be streamed: whether a resident copy keeps its raw bytes."""
    return [engine.raw_kept(i) for i in range(len(engine.units))]


def _merged(adapter: LoraDelta) -> Prepare:
    def prepare(i: int, t: dict[str, torch.Tensor], s: Slot) -> dict[str, torch.Tensor]:
        for k, v in t.items():
            adapter.merge_(k, v)
        return t

    return prepare


def _merged_after(dequantize: Prepare, adapter: LoraDelta) -> Prepare:
    def prepare(i: int, t: dict[str, torch.Tensor], s: Slot) -> dict[str, torch.Tensor]:
        out = dequantize(i, t, s)
        for k, v in out.items():
            adapter.merge_(k, v)
        return out

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
