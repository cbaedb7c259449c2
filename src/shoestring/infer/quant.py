"""Weight-only compression of the decoder layers' linear weights: int8 and nf4.

Pure torch, so it runs on CPU and GPU alike (AirLLM's needs CUDA). The
compressed copy is written once, unit by unit, into the run directory and then
streamed instead of the original layers, so every pass reads 4x (int8 from
fp32) to ~7x (nf4 from fp32) fewer bytes. Dequantization happens in the reader
thread into a per-slot scratch buffer, overlapping compute like the reads do.

- int8: symmetric, one fp32 scale per output row (absmax / 127).
- nf4: the QLoRA NormalFloat-4 code book, one fp32 absmax per 64 inputs, two
  codes per byte. Rows whose width is not a multiple of 64 fall back to int8.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable

import torch

from shoestring.checkpoint.local import fsync_dir, replace_dir
from shoestring.infer.engine import StreamingCausalLM, generic_key
from shoestring.infer.shards import ShardReader, TensorRef, aligned_empty, read_header, views
from shoestring.infer.stream import Slot

GROUP = 64
NF4_CODE = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0])


def quantize(w: torch.Tensor, scheme: str, rows: int = 256) -> dict[str, torch.Tensor]:
    """Compressed parts of one 2-D weight, keyed by suffix ('q8'/'s' or 'q4'/'a').

    Works ``rows`` rows at a time, so the fp32 temporaries stay a few MB even for a
    huge matrix (compression runs under the same memory budget as inference)."""
    if w.shape[0] > rows:
        parts = [_quantize(w[i:i + rows], scheme) for i in range(0, w.shape[0], rows)]
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    return _quantize(w, scheme)


def _quantize(w: torch.Tensor, scheme: str) -> dict[str, torch.Tensor]:
    w = w.float()
    if scheme == "nf4" and w.shape[1] % GROUP == 0:
        g = w.reshape(w.shape[0], -1, GROUP)
        absmax = g.abs().amax(-1, keepdim=True).clamp_min(1e-12)
        idx = (g / absmax).unsqueeze(-1).sub(NF4_CODE).abs().argmin(-1).to(torch.uint8)
        idx = idx.reshape(w.shape[0], -1)
        packed = (idx[:, 0::2] << 4) | idx[:, 1::2]
        return {"q4": packed.contiguous(), "a": absmax[..., 0].contiguous()}
    q, scale = int8_rows(w)
    return {"q8": q.contiguous(), "s": scale.contiguous()}


def int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over the last dimension: (codes, fp32 scale = absmax / 127 per row)."""
    x = x.float()
    scale = (x.abs().amax(-1, keepdim=True) / 127.0).clamp_min(1e-12)
    return torch.round(x / scale).clamp_(-127, 127).to(torch.int8), scale


#: Both NF4 values of every code byte (high nibble first): one lookup per byte.
_NF4_PAIRS = torch.stack([NF4_CODE.repeat_interleave(16), NF4_CODE.repeat(16)], dim=-1)


def dequantize(parts: dict[str, torch.Tensor], out: torch.Tensor, rows: int = 512
               ) -> torch.Tensor:
    """Write the weight back into ``out`` (its final dtype and shape).

    Phrased for speed on one CPU thread, where it runs beside the compute:
    ``out.copy_(q8).mul_(s)`` is 6x faster than ``torch.mul(q8, s, out=out)``
    (which takes a slow mixed-dtype path), and nf4 looks up both values of a
    byte at once, ``rows`` rows at a time, 6.5x faster than decoding nibbles
    over the whole matrix (numbers: docs/inference.md). Results are bitwise the
    same as the plain formulas.

    Into a 16-bit ``out`` the product is formed in fp32 ``rows`` rows at a time and
    rounded once: the same values as dequantizing in fp32 and casting, without a
    full-size fp32 temporary (a bf16 ``copy_().mul_()`` would round the scale too)."""
    if "q8" in parts:
        q8, s = parts["q8"], parts["s"]
        if out.dtype == s.dtype:
            return out.copy_(q8).mul_(s)
        flat_q, flat_s = q8.reshape(-1, q8.shape[-1]), s.reshape(-1, 1)
        dst = out.view(-1, q8.shape[-1])
        tmp = torch.empty((min(rows, flat_q.shape[0]), flat_q.shape[1]), dtype=s.dtype,
                          device=q8.device)
        for i in range(0, flat_q.shape[0], rows):
            n = min(rows, flat_q.shape[0] - i)
            dst[i:i + n].copy_(tmp[:n].copy_(flat_q[i:i + n]).mul_(flat_s[i:i + n]))
        return out
    packed, absmax = parts["q4"], parts["a"]
    pairs = _NF4_PAIRS.to(device=packed.device)
    groups = absmax.shape[1]
    flat = out.view(packed.shape[0], -1)
    for i in range(0, packed.shape[0], rows):
        vals = torch.nn.functional.embedding(packed[i:i + rows].long(), pairs)
        dst = flat[i:i + rows].view(-1, groups, GROUP)
        if out.dtype == torch.float32:
            torch.mul(vals.view(-1, groups, GROUP), absmax[i:i + rows].unsqueeze(-1), out=dst)
        else:
            dst.copy_(vals.view(-1, groups, GROUP).mul_(absmax[i:i + rows].unsqueeze(-1)))
    return out


def _compressible(key: str, ref: TensorRef) -> bool:
    return len(ref.shape) == 2 and ref.dtype.is_floating_point and key.endswith(".weight")


def build_compressed(engine: StreamingCausalLM, dest: Path, scheme: str, source_id: str,
                     transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                     ) -> Path:
    """Write ``dest``/layers.N.safetensors for every decoder layer, once.

    Committed like a checkpoint: written into a temp dir, fsynced, ``meta.json``
    last, then renamed, so a kill leaves either no copy or a complete one.
    ``transform`` (e.g. merging a LoRA adapter) is applied before quantizing.
    """
    from safetensors.torch import save_file

    meta_path = dest / "meta.json"
    if meta_path.is_file() and json.loads(meta_path.read_text()).get("source") == source_id:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".tmp-{dest.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    reader = ShardReader()
    buf = aligned_empty(max(u.plan.nbytes for u in engine.units))
    try:
        for unit in engine.units:
            if not unit.name.startswith("layers."):
                continue
            reader.read(unit.plan, buf)
            tensors = views(unit.plan, buf)
            out: dict[str, torch.Tensor] = {}
            for ref in unit.refs:
                t = tensors[ref.key]
                if transform is not None:
                    t = transform(ref.key, t)
                if _compressible(ref.key, ref):
                    for suffix, part in quantize(t, scheme).items():
                        out[f"{ref.key}::{suffix}"] = part
                else:
                    out[ref.key] = t.clone()
            path = tmp / f"{unit.name}.safetensors"
            save_file(out, str(path))
            del out
            with open(path, "rb") as f:
                os.fsync(f.fileno())  # then its clean pages can be dropped from the cache
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        meta_path_tmp = tmp / "meta.json"
        meta_path_tmp.write_text(json.dumps({"source": source_id, "scheme": scheme}))
        with open(meta_path_tmp, "rb") as f:
            os.fsync(f.fileno())
        fsync_dir(tmp)
        replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        reader.close()
    return dest


def use_compressed(engine: StreamingCausalLM, src: Path) -> tuple[
        Callable[[int, dict[str, torch.Tensor], Slot], dict[str, torch.Tensor]], list[int]]:
    """Point the decoder-layer units at the compressed files.

    Returns the ``prepare`` hook that dequantizes into slot scratch buffers, and
    the scratch bytes each unit needs once read (its dequantized weights)."""
    shapes: dict[int, dict[str, tuple[tuple[int, ...], torch.dtype]]] = {}
    scratch = [0] * len(engine.units)
    for i, unit in enumerate(engine.units):
        if not unit.name.startswith("layers."):
            continue
        refs = read_header(src / f"{unit.name}.safetensors")
        shapes[i] = {r.key: (r.shape, r.dtype) for r in unit.refs if f"{r.key}::q8" in refs
                     or f"{r.key}::q4" in refs}
        scratch[i] = sum(engine.dtype.itemsize * _numel(s) for s, _ in shapes[i].values())
        engine.replace_refs(i, [TensorRef(k, r.file, r.offset, r.nbytes, r.dtype, r.shape)
                                for k, r in refs.items()])

    def prepare(i: int, tensors: dict[str, torch.Tensor], slot: Slot) -> dict[str, torch.Tensor]:
        if i not in shapes:
            return tensors
        out = {k: v for k, v in tensors.items() if "::" not in k}
        for key, (shape, _dt) in shapes[i].items():
            generic = generic_key(key)
            buf = slot.scratch.get(generic)
            if buf is None or tuple(buf.shape) != shape:
                buf = slot.scratch[generic] = torch.empty(shape, dtype=engine.dtype,
                                                          device=tensors[next(iter(tensors))].device)
            parts = {s: tensors[f"{key}::{s}"] for s in ("q8", "s", "q4", "a")
                     if f"{key}::{s}" in tensors}
            out[key] = dequantize(parts, buf)
        return out

    return prepare, scratch


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
