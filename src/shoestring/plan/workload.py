"""Turn a finetune config and/or ``shoestring plan`` flags into a :class:`Workload`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shoestring.config import ConfigError, load
from shoestring.gpus import GPU
from shoestring.plan.arch import LINEARS, Arch, from_hf_config, load_arch
from shoestring.plan.memory import Method, Workload
from shoestring.train.config import FinetuneConfig


def builtin_arch() -> Arch:
    """The shape of ``builtin:tiny`` without materializing it."""
    from shoestring.train.builtin import MODEL_PARAMS, SPECIAL_TOKENS, padded_vocab

    cfg = {**MODEL_PARAMS, "vocab_size": padded_vocab(256 + len(SPECIAL_TOKENS))}
    return from_hf_config(cfg, "builtin:tiny")


def arch_for(path: str, where: str) -> Arch:
    """The architecture of ``model.path`` (or a ``--model`` value), naming ``where`` on error."""
    from shoestring.train.builtin import BUILTIN_MODEL

    if path == BUILTIN_MODEL:
        return builtin_arch()
    try:
        return load_arch(path)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def _targets(names: list[str] | tuple[str, ...], where: str) -> tuple[str, ...]:
    if list(names) == ["all-linear"]:
        return LINEARS
    bad = [n for n in names if n not in LINEARS]
    if bad:
        raise ConfigError(
            f"{where}: the planner knows the Llama-style linears "
            f"{', '.join(LINEARS)} (or all-linear); got {', '.join(bad)}"
        )
    return tuple(names)


def workload_from_config(
    cfg: FinetuneConfig,
    arch: Arch,
    world_size: int = 1,
    device: str = "cuda",
    gpu: GPU | None = None,
) -> tuple[Workload, int]:
    """The per-rank workload of a finetune config, and its optimizer steps. A
    ``model.dtype`` of 'auto' is planned as finetune resolves it on ``gpu``."""
    t = cfg.train
    dtype = cfg.model.dtype
    if dtype == "auto":
        dtype = "bfloat16" if gpu is None or gpu.bf16_flops else "float16"
    precision = t.precision
    if precision == "auto":  # as train.device.resolve: 16-bit autocast on a GPU
        precision = "fp32" if device == "cpu" else "bf16"
    mb = t.micro_batch_size or max(t.batch_size // world_size, 1)
    accum = max(t.batch_size // (mb * world_size), 1)
    method: Method = "qlora" if cfg.lora.quantize != "none" else "lora"
    w = Workload(
        arch=arch,
        method=method,
        quantize=cfg.lora.quantize,
        dtype=dtype,
        lora_r=cfg.lora.r,
        lora_targets=_targets(cfg.lora.target_modules, "lora.target_modules"),
        lora_dropout=cfg.lora.dropout,
        seq_len=cfg.data.max_length,
        micro_batch=mb,
        grad_accum=accum,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        optimizer=t.optimizer,
        # Packed rows get a block-diagonal mask (per-sample position ids), except under
        # flash attention, which packs by position ids without a mask.
        padded=not cfg.data.packing or cfg.model.attn_implementation != "flash_attention_2",
        device=device,
        autocast=precision != "fp32" and dtype != "float32",
    )
    return w, t.max_steps


@dataclass(frozen=True)
class PlanRequest:
    """``shoestring plan`` flags; ``None`` means "from --config, else the default"."""

    config: Path | None = None
    model: str | None = None
    method: str | None = None
    quantize: str | None = None
    dtype: str | None = None
    r: int | None = None
    targets: tuple[str, ...] | None = None
    lora_dropout: float | None = None
    seq_len: int | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    gradient_checkpointing: bool | None = None
    optimizer: str | None = None
    packed: bool | None = None
    steps: int | None = None


def _check_positive(flag: str, v: Any) -> None:
    if v is not None and v <= 0:
        raise ConfigError(f"{flag}: must be > 0, got {v}")


def resolve_request(
    req: PlanRequest, gpu: GPU, cache_dir: Path | None = None
) -> tuple[Workload, int]:
    """The workload a ``shoestring plan`` invocation describes, and its steps."""
    for flag, v in (
        ("--r", req.r),
        ("--seq-len", req.seq_len),
        ("--micro-batch", req.micro_batch),
        ("--grad-accum", req.grad_accum),
        ("--steps", req.steps),
    ):
        _check_positive(flag, v)
    if req.lora_dropout is not None and not 0 <= req.lora_dropout < 1:
        raise ConfigError(f"--lora-dropout: must be in [0, 1), got {req.lora_dropout}")
    if req.config is not None:
        cfg = load(FinetuneConfig, str(req.config), [])
        model = req.model or cfg.model.path
        arch = arch_for(model, "--model" if req.model else f"{req.config}: model.path")
        w, steps = workload_from_config(cfg, arch, gpu=gpu)
        w = replace(w, gradient_checkpointing=cfg.model.gradient_checkpointing)
    else:
        if not req.model:
            raise ConfigError("plan: give --model (a preset, model dir or config.json) or --config")
        w = Workload(
            arch=arch_for(req.model, "--model"),
            gradient_checkpointing=True,
            dtype="bfloat16" if gpu.bf16_flops else "float16",
            autocast=True,  # finetune's train.precision auto on a GPU
        )
        steps = 1000
    method = req.method or w.method
    quantize = req.quantize or (w.quantize if req.method in (None, "qlora") else "none")
    if method == "qlora" and quantize == "none":
        quantize = "nf4"
    if method == "full" and quantize != "none":
        raise ConfigError(
            "--quantize: full fine-tuning trains the base weights; they cannot "
            "be quantized (use --method qlora)"
        )
    if method == "lora" and quantize != "none":
        method = "qlora"
    changes: dict[str, Any] = {"method": method, "quantize": quantize}
    asked: tuple[tuple[str, Any], ...] = (
        ("dtype", req.dtype),
        ("lora_r", req.r),
        ("lora_dropout", req.lora_dropout),
        ("seq_len", req.seq_len),
        ("micro_batch", req.micro_batch),
        ("grad_accum", req.grad_accum),
        ("gradient_checkpointing", req.gradient_checkpointing),
        ("optimizer", req.optimizer),
    )
    for key, v in asked:
        if v is not None:
            changes[key] = v
    if req.targets is not None:
        changes["lora_targets"] = _targets(req.targets, "--targets")
    if req.packed:
        changes["padded"] = False
    return replace(w, **changes), req.steps or steps
