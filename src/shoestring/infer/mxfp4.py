"""MXFP4 experts (openai/gpt-oss-*) decoded on the way to the compute dtype.

The format (OCP Microscaling): blocks of 32 values, each an e2m1 code (4 bits: sign,
2 exponent bits, 1 mantissa bit; two codes a byte, the low nibble first) times the
block's power of two (a uint8 exponent, biased by 127). transformers' decoder,
``convert_moe_packed_tensors``, looks each nibble up in its ``FP4_VALUES`` table with
strided writes and int32 indices, then ``ldexp``, then transposes the whole result: on
a CPU it costs about 28 ns a weight (one expert of gpt-oss-20b, 2 threads, 2026-12-07),
so reading a 20B model's experts once would take minutes. Here each byte is looked up
once in a 256-entry table of value pairs built from that same ``FP4_VALUES``, scaled
by the block's power of two (the same exact product as transformers' ``ldexp``), and
written transposed into the expert's slice of the fused parameter, a few hundred rows
at a time. The values are transformers' bit for bit (a test compares every byte and
exponent), at a fraction of the cost (see benchmarks/README.md).
"""

from __future__ import annotations

import torch

#: Rows of an expert (its output features) decoded at once.
ROWS = 256
_PAIR = {2: torch.int32, 4: torch.int64}  # a value pair of 2- or 4-byte floats as one int


def pair_table(dtype: torch.dtype) -> torch.Tensor:
    """For each byte, its two e2m1 values (low nibble first) in ``dtype``, as one int."""
    from transformers.integrations.mxfp4 import FP4_VALUES

    values = torch.tensor(FP4_VALUES, dtype=dtype)
    byte = torch.arange(256)
    pairs = torch.stack([values[byte & 15], values[byte >> 4]], dim=-1).contiguous()
    return pairs.view(_PAIR[dtype.itemsize]).reshape(256)


def dequantize_expert(
    blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, table: torch.Tensor
) -> torch.Tensor:
    """One expert: ``blocks`` (rows, groups, 16) and ``scales`` (rows, groups), uint8,
    into ``out`` (groups x 32, rows), the layout transformers' experts compute with."""
    rows, groups, _ = blocks.shape
    for r in range(0, rows, ROWS):
        n = min(ROWS, rows - r)
        codes = blocks[r : r + n].reshape(-1).long()
        values = table.index_select(0, codes).view(out.dtype).view(n, groups, 32)
        _scale(values, scales[r : r + n].to(torch.int32) - 127)
        out[:, r : r + n].copy_(values.view(n, groups * 32).T)
    return out


def _scale(values: torch.Tensor, exponents: torch.Tensor) -> None:
    """``values`` (rows, groups, 32) times 2 ** ``exponents`` (rows, groups), as
    transformers' ``ldexp`` gives it: a power of two times an e2m1 value is exact, so
    multiplying by the power in a dtype that holds it is the same product (bf16 and
    fp32 hold 2^-127..2^127; fp16 does not, so its factors are float32), at a tenth of
    ldexp's cost. The exponent 128 (the byte 255) is applied as 2^127, then 2."""
    dtype = torch.float32 if values.dtype == torch.float16 else values.dtype
    values.mul_(torch.exp2(exponents.clamp(max=127).to(dtype)).unsqueeze(-1))
    over = exponents > 127
    if bool(over.any()):
        values.mul_(torch.where(over, 2.0, 1.0).to(dtype).unsqueeze(-1))
