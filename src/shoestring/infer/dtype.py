"""The dtype the job computes in: chosen once, then pinned in ``run.json``."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from shoestring.infer.config import Compress, ModelDtype


def compute_dtype(
    choice: ModelDtype,
    stored: torch.dtype,
    scheme: Compress,
    device: torch.device,
    pinned: str | None = None,
) -> torch.dtype:
    """The dtype the job computes in.

    A rerun keeps the one its run directory pinned (``pinned``; "stored" for run
    directories from before the choice was pinned), so outputs cannot change between
    chunks. 'auto' is exact (the checkpoint's dtype) unless compression is on and the
    checkpoint is float32: then bfloat16 if a bf16 matmul measures faster here. The
    output is already inexact with compression, and on CPUs with native bf16 dot
    products (AVX512-BF16, AMX) the matmuls of a streamed layer run several times
    faster (measured: docs/inference.md)."""
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if pinned == "stored":
        return stored
    if pinned:
        return names[pinned]
    if choice != "auto":
        return names[choice]
    if scheme == "none" or stored != torch.float32:
        return stored
    return torch.bfloat16 if bf16_is_faster(device) else stored


def bf16_is_faster(device: torch.device, reps: int = 5) -> bool:
    """Time a decode-sized matmul in fp32 and bf16 on ``device`` (well under a second on a CPU)."""
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    times: dict[torch.dtype, float] = {}
    g = torch.Generator().manual_seed(0)  # leaves the global RNG alone
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(64, 2048, generator=g).to(dt)
        w = torch.randn(2048, 2048, generator=g).to(dt)
        torch.nn.functional.linear(x, w)
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.nn.functional.linear(x, w)
        times[dt] = time.perf_counter() - t0
    return times[torch.bfloat16] * 1.3 < times[torch.float32]


def config_dtype(doc: Mapping[str, Any]) -> torch.dtype:
    """The dtype a checkpoint stored quantized computes in: its config's
    ``dtype``/``torch_dtype`` (the one its unquantized tensors are stored in), else
    bfloat16."""
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    for name in (doc.get("dtype"), doc.get("torch_dtype")):
        if isinstance(name, str) and name.removeprefix("torch.") in names:
            return names[name.removeprefix("torch.")]
    return torch.bfloat16
