"""Turn a finetune config and/or ``shoestring plan`` flags into a :class:`Workload`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

from shoestring.config import ConfigError, load
from shoestring.gpus import GPU, find_gpu
from shoestring.hub import HubAccess, looks_remote, resolve
from shoestring.plan.arch import (
    ALL_LINEARS,
    PRESETS,
    Arch,
    Unmodelled,
    from_hf_config,
    load_arch,
)
from shoestring.plan.memory import Method, Parallelism, Workload
from shoestring.train.config import (
    ComputeDtype,
    DeviceKind,
    FinetuneConfig,
    Numerics,
    Quantize,
    device_kind,
    resolve_numerics,
)


class NotModelled(ConfigError):
    """A model or layout the planner does not size (the trainer may still run it)."""


def builtin_arch() -> Arch:
    """The shape of ``builtin:tiny`` without materializing it."""
    from shoestring.train.builtin import MODEL_PARAMS, SPECIAL_TOKENS, padded_vocab

    cfg = {**MODEL_PARAMS, "vocab_size": padded_vocab(256 + len(SPECIAL_TOKENS))}
    return from_hf_config(cfg, "builtin:tiny")


def arch_for(path: str, where: str, hub: HubAccess | None = None) -> Arch:
    """The architecture of ``model.path`` (or a ``--model`` value), naming ``where`` on
    error. A Hub id or a bucket URL is read through ``hub``: its config.json only."""
    from shoestring.train.builtin import BUILTIN_MODEL

    if path == BUILTIN_MODEL:
        return builtin_arch()
    if hub is not None and path not in PRESETS and looks_remote(path):
        path = str(resolve(path, hub, key=where, want="config").path)
    try:
        return load_arch(path)
    except Unmodelled as e:
        raise NotModelled(f"{where}: {e}") from None
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def _targets(names: list[str] | tuple[str, ...], where: str) -> tuple[str, ...]:
    if list(names) == ["all-linear"]:
        return ALL_LINEARS  # those the model has (Workload.adapted)
    bad = [n for n in names if n not in ALL_LINEARS]
    if bad:
        raise ConfigError(
            f"{where}: the planner knows the linears {', '.join(ALL_LINEARS)} "
            f"(or all-linear); got {', '.join(bad)}"
        )
    return tuple(names)


def numerics_fields(n: Numerics) -> dict[str, Any]:
    """The :class:`Workload` fields that :func:`resolve_numerics` decides."""
    return {"dtype": n.dtype, "device": n.device, "autocast": n.autocast}


def _gpu_bf16(gpu: GPU | None) -> bool:
    return gpu is None or bool(gpu.bf16_flops)


def workload_from_config(
    cfg: FinetuneConfig,
    arch: Arch,
    world_size: int = 1,
    device: DeviceKind = "cuda",
    gpu: GPU | None = None,
) -> tuple[Workload, int]:
    """The per-rank workload of a finetune config on ``device`` (a ``gpu`` of the
    catalog for cuda), and its optimizer steps. Dtype and precision are resolved by
    finetune's own rule (:func:`resolve_numerics`)."""
    t = cfg.train
    n = resolve_numerics(cfg.model, t, device, _gpu_bf16(gpu))
    mb = t.micro_batch_size or max(t.batch_size // world_size, 1)
    accum = max(t.batch_size // (mb * world_size), 1)
    # dpo/orpo: the batch counts pairs, each a chosen and a rejected sequence; grpo:
    # prompts, each trained with its group of sampled completions (a prompt of up to
    # data.max_length tokens and up to grpo.max_completion_tokens more).
    grpo = t.objective == "grpo"
    sequences = {"sft": 1, "grpo": cfg.grpo.generations}.get(t.objective, 2)
    seq_len = cfg.data.max_length + (cfg.grpo.max_completion_tokens if grpo else 0)
    # A pre-quantized base stays as its checkpoint stored it, whatever lora.quantize says.
    quantize = (
        cast(Quantize, arch.prequantized) if arch.prequantized != "none" else cfg.lora.quantize
    )
    method: Method = "qlora" if quantize != "none" else "lora"
    w = Workload(
        arch=arch,
        method=method,
        quantize=quantize,
        lora_r=cfg.lora.r,
        lora_targets=_targets(cfg.lora.target_modules, "lora.target_modules"),
        lora_parameters=tuple(cfg.lora.target_parameters),
        lora_dropout=cfg.lora.dropout,
        seq_len=seq_len,
        micro_batch=mb * sequences,
        grad_accum=accum,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        optimizer=t.optimizer,
        # Packed rows get a block-diagonal mask (per-sample position ids), except under
        # flash attention, which packs by position ids without a mask.
        padded=not cfg.data.packing or cfg.model.attn_implementation != "flash_attention_2",
        loss_chunk_tokens=t.loss_chunk_tokens,
        offload_activations=t.offload_activations,
        parallelism=parallelism_of(cfg.distributed.strategy, world_size),
        world_size=world_size,
        cpu_offload=cfg.distributed.cpu_offload
        and parallelism_of(cfg.distributed.strategy, world_size) == "fsdp",
        reference_forward=(t.objective == "dpo" and not cfg.dpo.precompute_ref)
        or (grpo and cfg.grpo.beta > 0),
        sampled=grpo,
        logits_read=t.objective != "sft",
        kernels=t.kernels,
        **numerics_fields(n),
    )
    check_experts(w)
    return w, t.max_steps


@dataclass(frozen=True)
class PlanRequest:
    """``shoestring plan`` flags; ``None`` means "from --config, else the default"."""

    config: Path | None = None
    model: str | None = None
    device: DeviceKind | None = None  # None: --gpu given -> cuda, else train.device, else cuda
    gpu: str | None = None  # None: L4 (a CUDA plan), or none (a CPU plan)
    method: str | None = None
    quantize: str | None = None
    dtype: ComputeDtype | None = None
    r: int | None = None
    targets: tuple[str, ...] | None = None
    lora_dropout: float | None = None
    seq_len: int | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    gradient_checkpointing: bool | None = None
    optimizer: str | None = None
    packed: bool | None = None
    loss_chunk_tokens: int | None = None
    offload_activations: bool | None = None
    steps: int | None = None
    world_size: int = 1
    gpus_per_host: int | None = None  # None: every rank on one host
    strategy: Parallelism | None = None  # None: single for one rank, else the config's
    cpu_offload: bool | None = None


@dataclass(frozen=True)
class Resolved:
    """What a ``shoestring plan`` invocation plans: the workload (its ``device`` says
    cpu or cuda), the optimizer steps, and the catalog GPU (None for a CPU run)."""

    workload: Workload
    steps: int
    gpu: GPU | None
    gpus_per_host: int = 1


#: The GPU a CUDA plan is made for when ``--gpu`` is not given.
DEFAULT_GPU = "L4"


def plan_device(req: PlanRequest, train_device: str | None) -> DeviceKind:
    """``--device``, else cuda when ``--gpu`` names one, else the config's
    ``train.device`` (its ``auto`` is planned as a GPU run: finetune picks CUDA
    wherever there is one), else cuda."""
    if req.device == "cpu" and req.gpu:
        raise ConfigError(
            "--gpu: a CPU run (--device cpu) has no GPU; drop --gpu, or plan --device cuda"
        )
    if req.device is not None:
        return req.device
    if req.gpu or train_device is None:
        return "cuda"
    return device_kind(train_device, cuda_available=True)


def _prequantized(arch: Arch, method: str, quantize: str) -> tuple[str, str]:
    """A pre-quantized base (``*-bnb-4bit``) is QLoRA with its own quantization."""
    if arch.prequantized == "none":
        return method, quantize
    if method == "full":
        raise ConfigError(
            f"--method full: {arch.name} is pre-quantized ({arch.prequantized}); its base "
            "weights cannot be trained (use --method qlora)"
        )
    return "qlora", arch.prequantized


def _check_positive(flag: str, v: Any) -> None:
    if v is not None and v <= 0:
        raise ConfigError(f"{flag}: must be > 0, got {v}")


def _check_flags(req: PlanRequest) -> None:
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


def _base_workload(req: PlanRequest, hub: HubAccess | None) -> Resolved:
    """The workload before the flags that override it: from --config, else the defaults.
    ``--dtype`` goes through finetune's dtype rule as ``model.dtype`` would."""
    cfg = load(FinetuneConfig, str(req.config), []) if req.config else FinetuneConfig()
    if req.dtype is not None:
        cfg = replace(cfg, model=replace(cfg.model, dtype=req.dtype))
    device = plan_device(req, cfg.train.device if req.config else None)
    gpu = find_gpu(req.gpu or DEFAULT_GPU) if device == "cuda" else None
    if req.config is not None:
        model = req.model or cfg.model.path
        arch = arch_for(model, "--model" if req.model else f"{req.config}: model.path", hub)
        w, steps = workload_from_config(cfg, arch, req.world_size, device=device, gpu=gpu)
        return Resolved(w, steps, gpu)
    if not req.model:
        raise ConfigError("plan: give --model (a preset, model dir or config.json) or --config")
    n = resolve_numerics(cfg.model, cfg.train, device, _gpu_bf16(gpu))
    arch = arch_for(req.model, "--model", hub)
    w = Workload(arch=arch, gradient_checkpointing=True, **numerics_fields(n))
    if arch.experts is not None:  # peft's LoRA on fused experts refuses dropout
        w = replace(w, lora_dropout=0.0)
    return Resolved(w, 1000, gpu)


def resolve_request(
    req: PlanRequest, cache_dir: Path | None = None, hub: HubAccess | None = None
) -> Resolved:
    """The workload a ``shoestring plan`` invocation describes, its steps and its GPU.
    ``hub``: how a Hub id or bucket URL in --model/model.path is read (config.json only)."""
    _check_flags(req)
    base = _base_workload(req, hub)
    w = base.workload
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
    method, quantize = _prequantized(w.arch, method, quantize)
    changes: dict[str, Any] = {"method": method, "quantize": quantize}
    asked: tuple[tuple[str, Any], ...] = (
        ("lora_r", req.r),
        ("lora_dropout", req.lora_dropout),
        ("seq_len", req.seq_len),
        ("micro_batch", req.micro_batch),
        ("grad_accum", req.grad_accum),
        ("gradient_checkpointing", req.gradient_checkpointing),
        ("optimizer", req.optimizer),
        ("loss_chunk_tokens", req.loss_chunk_tokens),
        ("offload_activations", req.offload_activations),
    )
    for key, v in asked:
        if v is not None:
            changes[key] = v
    if req.targets is not None:
        changes["lora_targets"] = _targets(req.targets, "--targets")
    if req.packed:
        changes["padded"] = False
    w = replace(w, **changes, **_layout(req, w))
    check_layout(w)
    return replace(base, workload=w, steps=req.steps or base.steps, gpus_per_host=_per_host(req))


def parallelism_of(strategy: str, world_size: int) -> Parallelism:
    """How finetune runs ``distributed.strategy`` at ``world_size``: FSDP2 also in one
    process (a mesh of one); DDP of one rank is a plain process."""
    if strategy == "fsdp":
        return "fsdp"
    return "single" if world_size == 1 else "ddp"


def _layout(req: PlanRequest, w: Workload) -> dict[str, Any]:
    """--strategy / --world-size / --cpu-offload over the config's distributed.*."""
    if req.world_size > 1 and req.strategy == "single":
        raise ConfigError(
            f"--strategy single: one process; --world-size {req.world_size} needs ddp or fsdp"
        )
    multi = req.world_size > 1 or req.strategy not in (None, "single")
    config_strategy = w.parallelism if w.parallelism != "single" else "ddp"
    parallelism = (req.strategy or config_strategy) if multi else "single"
    offload = w.cpu_offload if req.cpu_offload is None else req.cpu_offload
    return {"parallelism": parallelism, "world_size": req.world_size, "cpu_offload": offload}


def _per_host(req: PlanRequest) -> int:
    n, per = req.world_size, req.gpus_per_host or req.world_size
    if per > n or n % per:
        raise ConfigError(
            f"--gpus-per-host: {per} does not divide --world-size {n} into whole hosts"
        )
    return per


def check_experts(w: Workload) -> None:
    """What the planner does not model of a mixture of experts, or peft refuses."""
    if w.arch.experts is None:
        return
    fused = {"gate_proj", "up_proj"} & set(w.lora_targets)
    if len(fused) == 1:
        raise ConfigError(
            f"lora.target_modules: {fused.pop()} without its other half: peft adapts an "
            "MoE's gate and up projections together, as the one fused gate_up_proj"
        )
    unknown = set(w.lora_parameters) - {"gate_up_proj", "down_proj"}
    if unknown:
        raise ConfigError(
            f"lora.target_parameters: the planner models the experts' gate_up_proj and "
            f"down_proj; got {', '.join(sorted(unknown))}"
        )
    if w.expert_lora and w.lora_dropout > 0:
        raise ConfigError(
            f"lora.dropout: {w.lora_dropout}; peft's LoRA on fused experts "
            f"({', '.join(p for p, _ in w.expert_lora)}) refuses dropout: set it to 0"
        )
    if w.method == "full" or w.parallelism == "fsdp":
        raise NotModelled(
            f"{'--method full' if w.method == 'full' else '--strategy fsdp'}: the planner "
            f"models a mixture of experts ({w.arch.name}) under LoRA/QLoRA in one process "
            "or DDP"
        )


def check_layout(w: Workload) -> None:
    """What the trainer refuses for this layout (``train/strategy.py``), refused here."""
    check_experts(w)
    fsdp = w.parallelism == "fsdp"
    if w.parallelism != "single" and w.device == "cpu":
        raise ConfigError(
            "--world-size: the planner plans multi-rank runs on GPUs (--device cuda); "
            "a CPU plan is one process"
        )
    if fsdp and w.quant == "int8":
        raise ConfigError(
            "--quantize: int8 (LLM.int8) cannot be sharded by FSDP2; use nf4 with "
            "--strategy fsdp, or --strategy ddp"
        )
    if fsdp and w.optimizer != "adamw":
        raise ConfigError(
            f"--optimizer: {w.optimizer} cannot step FSDP2's sharded parameters; use adamw "
            "with --strategy fsdp"
        )
    if w.cpu_offload and not fsdp:
        raise ConfigError("--cpu-offload: needs --strategy fsdp")
