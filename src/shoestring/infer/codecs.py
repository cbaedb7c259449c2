"""The int8 and nf4 codecs: plain torch, shared by weight compression and the KV cache.

- int8: symmetric, one fp32 scale per row of the last dimension (absmax / 127).
- nf4: the QLoRA NormalFloat-4 code book, one fp32 absmax per 64 inputs, two
  codes per byte. Rows whose width is not a multiple of 64 fall back to int8.

This module imports nothing from the rest of ``shoestring.infer``: ``quant``
(compressed weights) and ``kvcache`` (8-bit KV cache) both build on it.
"""

from __future__ import annotations

from typing import Literal

import torch

#: A compression scheme (``compress.scheme`` without "none").
Scheme = Literal["int8", "nf4"]

#: Inputs per nf4 absmax.
GROUP = 64
NF4_CODE = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ]
)

#: Both NF4 values of every code byte (high nibble first): one lookup per byte.
_NF4_PAIRS = torch.stack([NF4_CODE.repeat_interleave(16), NF4_CODE.repeat(16)], dim=-1)


#: Bytes of temporaries :func:`quantize` works within (it runs before the plan's
#: buffers exist, under the same budget).
QUANTIZE_SCRATCH = 16 << 20
#: Temporary bytes per weight element while quantizing a row block: nf4 compares
#: every element with the 16 codes in fp32 (64 B) and keeps the int64 argmin (8 B).
_QUANTIZE_PER_ELEMENT = {"int8": 16, "nf4": 80}


def quantize_scratch(largest: int, cols: int) -> int:
    """The temporaries :func:`quantize` is given while a copy is written whose largest
    tensor is ``largest`` bytes as read, its widest row ``cols``: no more than that
    tensor (a small model's copy must fit where streaming it does), nor than
    :data:`QUANTIZE_SCRATCH`, and at least one nf4 row."""
    return max(min(QUANTIZE_SCRATCH, largest), cols * _QUANTIZE_PER_ELEMENT["nf4"])


def quantize(
    w: torch.Tensor, scheme: Scheme, rows: int = 0, scratch: int = QUANTIZE_SCRATCH
) -> dict[str, torch.Tensor]:
    """Compressed parts of one 2-D weight, keyed by suffix ('q8'/'s' or 'q4'/'a').

    Works ``rows`` rows at a time (0: as many as keep the temporaries within
    ``scratch`` bytes, at least one row; every row is coded on its own, so the block
    size does not change the result)."""
    rows = rows or max(1, scratch // (w.shape[1] * _QUANTIZE_PER_ELEMENT[scheme]))
    if w.shape[0] > rows:
        parts = [_quantize(w[i : i + rows], scheme) for i in range(0, w.shape[0], rows)]
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    return _quantize(w, scheme)


def _quantize(w: torch.Tensor, scheme: Scheme) -> dict[str, torch.Tensor]:
    w = w.float()
    if scheme == "nf4" and w.shape[1] % GROUP == 0:
        g = w.reshape(w.shape[0], -1, GROUP)
        absmax = g.abs().amax(-1, keepdim=True).clamp_min(1e-12)
        idx = (g / absmax).unsqueeze(-1).sub(NF4_CODE).abs_().argmin(-1).to(torch.uint8)
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


def dequantize(parts: dict[str, torch.Tensor], out: torch.Tensor, rows: int = 512) -> torch.Tensor:
    """Write the weight back into ``out`` (its final dtype and shape).

    Phrased for speed on one CPU thread, where it runs beside the compute:
    ``out.copy_(q8).mul_(s)`` rather than ``torch.mul(q8, s, out=out)`` (which
    takes a slow mixed-dtype path), and nf4 looks up both values of a byte at
    once, ``rows`` rows at a time, rather than decoding nibbles over the whole
    matrix (timings: docs/inference.md). Results are bitwise the same as the
    plain formulas.

    Into a 16-bit ``out`` the product is formed in fp32 ``rows`` rows at a time and
    rounded once: the same values as dequantizing in fp32 and casting, without a
    full-size fp32 temporary (a bf16 ``copy_().mul_()`` would round the scale too)."""
    if "q8" in parts:
        return _dequantize_int8(parts["q8"], parts["s"], out, rows)
    return _dequantize_nf4(parts["q4"], parts["a"], out, rows)


def dequantize_scratch(shape: tuple[int, ...], part: str, out_dtype: torch.dtype) -> int:
    """Temporary bytes :func:`dequantize` takes for a weight of ``shape`` stored as
    ``part`` ('q8' or 'q4') into ``out_dtype``, at its default row block: int8 into a
    16-bit dtype forms the product in fp32 a row block at a time; nf4 looks up a row
    block's code bytes as int64 and their value pairs in fp32 (8 bytes per weight)."""
    cols = shape[-1]
    rows = 1
    for n in shape[:-1]:
        rows *= n
    block = min(rows, 512)
    if part == "q4":
        return block * cols * 8
    return 0 if out_dtype == torch.float32 else block * cols * 4


def _dequantize_int8(
    q8: torch.Tensor, s: torch.Tensor, out: torch.Tensor, rows: int
) -> torch.Tensor:
    if out.dtype == s.dtype:
        return out.copy_(q8).mul_(s)
    flat_q, flat_s = q8.reshape(-1, q8.shape[-1]), s.reshape(-1, 1)
    dst = out.view(-1, q8.shape[-1])
    tmp = torch.empty(
        (min(rows, flat_q.shape[0]), flat_q.shape[1]), dtype=s.dtype, device=q8.device
    )
    for i in range(0, flat_q.shape[0], rows):
        n = min(rows, flat_q.shape[0] - i)
        dst[i : i + n].copy_(tmp[:n].copy_(flat_q[i : i + n]).mul_(flat_s[i : i + n]))
    return out


def _dequantize_nf4(
    packed: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor, rows: int
) -> torch.Tensor:
    pairs = _NF4_PAIRS.to(device=packed.device)
    groups = absmax.shape[1]
    flat = out.view(packed.shape[0], -1)
    for i in range(0, packed.shape[0], rows):
        vals = torch.nn.functional.embedding(packed[i : i + rows].long(), pairs)
        dst = flat[i : i + rows].view(-1, groups, GROUP)
        if out.dtype == torch.float32:
            torch.mul(vals.view(-1, groups, GROUP), absmax[i : i + rows].unsqueeze(-1), out=dst)
        else:
            dst.copy_(vals.view(-1, groups, GROUP).mul_(absmax[i : i + rows].unsqueeze(-1)))
    return out
