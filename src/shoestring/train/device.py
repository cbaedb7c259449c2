"""Where training runs and in what precision, resolved once at start.

``train.device``, ``train.precision`` and ``model.dtype`` accept ``auto``. The
machine is probed once (:meth:`Accelerator.probe`) and :func:`resolve` turns
every ``auto`` into a concrete value before anything is hashed, written to
``config.yaml`` or compared with a checkpoint — so a run started on a GPU and
resumed on another machine is checked against what it really computed with.
"""

from __future__ import annotations

import contextlib
import logging
import os
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any

import torch

from shoestring.config import ConfigError
from shoestring.train.compiled import check_compile
from shoestring.train.config import (
    FinetuneConfig,
    PrecisionName,
    ResolvedConfig,
    resolve_numerics,
)
from shoestring.train.kernels import check_kernels

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
log = logging.getLogger("shoestring.finetune")


@dataclass(frozen=True)
class Accelerator:
    """What this machine offers, probed once."""

    cuda_devices: int = 0
    bf16: bool = False  # CUDA device 0 computes bfloat16 natively (Ampere and later)
    name: str = "cpu"
    cpu_bf16: bool = True  # the CPU has AVX512-BF16 or AMX (False: 16-bit GEMMs crawl)

    @classmethod
    def probe(cls) -> Accelerator:
        cpu_bf16 = cpu_computes_bf16()
        if not torch.cuda.is_available():
            return cls(cpu_bf16=cpu_bf16)
        return cls(
            torch.cuda.device_count(),
            bool(torch.cuda.is_bf16_supported(False)),
            str(torch.cuda.get_device_name(0)),
            cpu_bf16,
        )


def cpu_computes_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether oneDNN has bf16 GEMM kernels here (AVX512-BF16 or AMX; Linux flags; True
    where they cannot be read). Without them torch falls back to a reference GEMM."""
    try:
        with open(cpuinfo) as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return True
    return not flags or "avx512_bf16" in flags or "amx_bf16" in flags


#: Why: benchmarks/README.md, "Real size" (a 7B step's bfloat16 products on such a CPU).
CPU_16BIT_WARNING = (
    "model.dtype %s / train.precision %s on a CPU without AVX512-BF16 or AMX: torch has no "
    "fast 16-bit matrix kernels here, and a 7B step's products run about 80x slower than "
    "in float32 (measured on an AMD EPYC). Use model.dtype float32 and train.precision "
    "fp32 (what auto picks on a CPU) unless memory forces 16 bits."
)


def resolve_device(spec: str, local_rank: int, acc: Accelerator) -> str:
    """``train.device`` → ``cpu`` or ``cuda:N``."""
    if spec == "auto":
        spec = "cuda" if acc.cuda_devices else "cpu"
    if spec == "cpu":
        return spec
    if not acc.cuda_devices:
        raise ConfigError(
            f"train.device: {spec} asked for, but torch sees no CUDA device "
            f"(torch {torch.__version__}; a CPU build of torch, or no driver). "
            "Install a CUDA build of torch, or use --train.device cpu"
        )
    index = local_rank if spec == "cuda" else int(spec.split(":")[1])
    if index >= acc.cuda_devices:
        raise ConfigError(
            f"train.device: {spec} -> cuda:{index}, but this machine has "
            f"{acc.cuda_devices} CUDA device(s)"
        )
    return f"cuda:{index}"


def resolve(cfg: FinetuneConfig, acc: Accelerator, local_rank: int) -> ResolvedConfig:
    """``cfg`` with every ``auto`` of device, precision and base dtype made concrete
    (the dtype and precision rule is :func:`shoestring.train.config.resolve_numerics`,
    which ``shoestring plan`` uses too)."""
    device = resolve_device(cfg.train.device, local_rank, acc)
    on_gpu = device.startswith("cuda")
    n = resolve_numerics(cfg.model, cfg.train, "cuda" if on_gpu else "cpu", acc.bf16)
    if cfg.model.attn_implementation == "flash_attention_2":
        _require_flash_attention(on_gpu)
    check_kernels(cfg.train, on_gpu)
    check_compile(cfg.train)
    if not on_gpu and not acc.cpu_bf16 and (n.dtype != "float32" or n.precision != "fp32"):
        log.warning(CPU_16BIT_WARNING, n.dtype, n.precision)
    return ResolvedConfig(
        replace(
            cfg,
            train=replace(cfg.train, device=device, precision=n.precision),
            model=replace(cfg.model, dtype=n.dtype),
        )
    )


def _require_flash_attention(on_gpu: bool) -> None:
    if not on_gpu:
        raise ConfigError(
            "model.attn_implementation: flash_attention_2 runs on CUDA only; use sdpa on CPU"
        )
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        raise ConfigError(
            "model.attn_implementation: flash_attention_2 needs the flash-attn "
            "package: pip install flash-attn --no-build-isolation"
        ) from None


@dataclass(frozen=True)
class Precision:
    """Autocast and gradient scaling for ``train.precision`` on one device."""

    name: PrecisionName
    device: torch.device

    def autocast(self) -> AbstractContextManager[Any]:
        dtype = _AUTOCAST.get(self.name)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def make_scaler(self) -> torch.amp.GradScaler | None:
        """fp16 gradients underflow without loss scaling; bf16 and fp32 need none."""
        if self.name != "fp16":
            return None
        return torch.amp.GradScaler(self.device.type)


def set_deterministic(device: torch.device) -> None:
    """What PyTorch needs for reproducible kernels (``train.deterministic``).

    cuBLAS reads ``CUBLAS_WORKSPACE_CONFIG`` when its handle is created, so this
    runs before the model is loaded. TF32 is turned off: it rounds matmul inputs
    to 10 mantissa bits, which no checkpoint can replay across GPU generations.
    """
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=False)


def to_device(
    batch: dict[str, torch.Tensor], device: torch.device | None
) -> dict[str, torch.Tensor]:
    """Move a collated batch; on CUDA through pinned memory so the copy is asynchronous."""
    if device is None or device.type == "cpu":
        return batch
    if device.type == "cuda":
        return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}
    return {k: v.to(device) for k, v in batch.items()}


def peak_memory(device: torch.device) -> dict[str, int]:
    """``cuda_peak_bytes`` (max_memory_allocated since start) on CUDA; nothing elsewhere."""
    if device.type != "cuda":
        return {}
    return {"cuda_peak_bytes": int(torch.cuda.max_memory_allocated(device))}
