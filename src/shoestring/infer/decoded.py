"""``compress.decode_once``: the decoder layers written once as the job computes with
them, then streamed instead of the checkpoint.

A checkpoint stored quantized (FP8 with block scales, MXFP4 experts, bitsandbytes
4-bit: :mod:`.stored`) is rebuilt in the compute dtype every pass, and so is one
computed in another dtype than it is stored in (a cast) or an MoE whose experts are
stored one tensor each (a fuse). On a GPU that costs little beside the copy to the
device; on a CPU it costs more than reading: a Llama-2-7B shape in FP8 took 33.9 s a
decode step against 5.9 s for its bf16 original. Here each decoder layer is read once,
prepared by the very pipeline the reader thread runs (:meth:`StreamingCausalLM.prepared`:
the stored weights' hook and an adapter's merge, the casts, the fused parameters), and
its tensors are written as they came out into ``layers.N.safetensors``; the layers
then stream from that copy with nothing left to do. The copy holds the bytes a pass
would have computed with, so the outputs are the same bit for bit; it costs the disk
of the compute-dtype model's layers (committed as :mod:`.layercopy` says, kept while
the model, adapter and dtype are the same). The embedding and head still stream as
stored.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from shoestring.infer.engine import StreamingCausalLM
from shoestring.infer.layercopy import layer_file, numel, settle, write_once
from shoestring.infer.plan import Needs
from shoestring.infer.shards import ShardReader, aligned_empty, read_header, views
from shoestring.infer.stored import StoredWeights
from shoestring.infer.stream import Prepare, Slot
from shoestring.stwriter import TensorSpec, write_file

#: Bytes of a tensor handed to the file writer at once (it copies each block once).
BLOCK_BYTES = 64 << 20
#: Layers in flight while the copy is written: one written, the next read and prepared.
SLOTS = 2


def layer_units(engine: StreamingCausalLM) -> list[int]:
    return [i for i, u in enumerate(engine.units) if u.name.startswith("layers.")]


def decodes(engine: StreamingCausalLM, stored: StoredWeights | None, i: int) -> bool:
    """Whether unit ``i`` is rebuilt when it is prepared: weights dequantized, floats
    cast to the compute dtype, or parameters fused from several tensors."""
    unit = engine.units[i]
    return bool(
        (stored is not None and stored.shapes(i))
        or unit.fused
        or any(
            r.dtype.is_floating_point and r.dtype != engine.dtype and r.key not in engine.own_dtype
            for r in unit.refs
        )
    )


def decoded_bytes(engine: StreamingCausalLM, stored: StoredWeights | None, i: int) -> int:
    """Bytes of unit ``i``'s tensors once prepared: what its copy holds."""
    unit, dtype = engine.units[i], engine.dtype
    sources = {s for f in unit.fused.values() for s in f.sources}
    shapes = stored.shapes(i) if stored is not None else {}
    weights = sum(numel(s) for k, s in shapes.items() if k not in sources) * dtype.itemsize
    kept = stored.kept(i).values() if stored is not None else ()
    weights += sum(numel(s) * d.itemsize for s, d in kept)
    plain = sum(
        numel(r.shape) * dtype.itemsize if r.dtype.is_floating_point else r.nbytes
        for r in unit.refs
        if "::" not in r.key and r.key not in sources
    )
    return weights + plain + engine.fuse_bytes(i)[0]


def decoded_needs(
    engine: StreamingCausalLM, streamed: Needs, stored: StoredWeights | None
) -> Needs:
    """The needs of streaming the decoded copy, from those of streaming as stored: a
    layer reads its prepared bytes and prepares nothing. Writing the copy holds two
    slots (:func:`_write`), each a layer as read and its prepared scratch, what
    preparing one takes for a moment, and the block being written."""
    layers = layer_units(engine)
    read, extra, prepare = list(streamed.read), list(streamed.extra), list(streamed.prepare)
    kept = list(streamed.raw_kept) if streamed.raw_kept is not None else [True] * len(read)
    for i in layers:
        read[i], extra[i], prepare[i], kept[i] = decoded_bytes(engine, stored, i), 0, 0, True
    slot = max(streamed.read[i] for i in layers) + max(streamed.extra[i] for i in layers)
    build = SLOTS * slot + max((streamed.prepare[i] for i in layers), default=0) + BLOCK_BYTES
    return Needs(read, extra, prepare, build, kept, streamed.kinds)


def build_decoded(
    engine: StreamingCausalLM, dest: Path, source_id: str, hook: Prepare | None, nbytes: int
) -> bool:
    """Write the decoded copy of ``engine``'s layers into ``dest`` once (``hook``: what
    the stream would run on each unit as read); returns whether it was written now."""
    return write_once(
        dest, source_id, {"scheme": "decoded"}, nbytes, lambda tmp: _write(engine, tmp, hook)
    )


def _write(engine: StreamingCausalLM, tmp: Path, hook: Prepare | None) -> None:
    """Each layer read into a slot and prepared into its scratch, then written by a
    writer thread while the next layer is read and prepared into the other slot (a
    slot is reused once the write from it is done, as a ring slot is)."""
    layers = layer_units(engine)
    user: Prepare = hook or (lambda i, t, s: t)
    size = max(engine.units[i].plan.nbytes for i in layers)
    slots = [Slot(aligned_empty(size)) for _ in range(SLOTS)]
    writes: list[Future[None] | None] = [None] * SLOTS
    reader = ShardReader()
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="decoded-copy") as writer:
            for n, i in enumerate(layers):
                k = n % SLOTS
                if (done := writes[k]) is not None:
                    done.result()  # its slot is free again (and a failed write raises here)
                plan, slot = engine.units[i].plan, slots[k]
                reader.read(plan, slot.host)
                tensors = engine.prepared(i, views(plan, slot.host), slot, user)
                path = layer_file(tmp, engine.units[i].name)
                writes[k] = writer.submit(_write_layer, path, tensors)
            for w in writes:
                if w is not None:
                    w.result()
    finally:
        reader.close()


def _write_layer(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    specs = [TensorSpec(k, tuple(t.shape), t.dtype) for k, t in tensors.items()]
    write_file(path, specs, lambda spec: _blocks(tensors[spec.name]))
    settle(path)


def _blocks(t: torch.Tensor) -> Iterator[torch.Tensor]:
    flat = t.reshape(-1)
    yield from flat.split(max(1, BLOCK_BYTES // t.element_size()))


def use_decoded(engine: StreamingCausalLM, src: Path, hook: Prepare | None) -> Prepare | None:
    """Point the layer units at the copy in ``src`` (their parameters are built in it:
    nothing is fused any more); ``hook`` still prepares the other units."""
    layers = set(layer_units(engine))
    for i in layers:
        unit = engine.units[i]
        unit.fused = {}
        engine.replace_refs(i, list(read_header(layer_file(src, unit.name)).values()))
    if hook is None:
        return None
    outside: Prepare = hook

    def prepare(i: int, t: dict[str, torch.Tensor], slot: Slot) -> dict[str, torch.Tensor]:
        return t if i in layers else outside(i, t, slot)

    return prepare
