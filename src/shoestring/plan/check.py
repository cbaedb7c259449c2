"""The pre-flight check ``shoestring finetune`` runs before loading the model."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from shoestring.config import ConfigError
from shoestring.gpus import GPU, GiB, detect_gpu_name, find_gpu
from shoestring.plan.estimate import Plan, Schedule, make_plan
from shoestring.plan.workload import NotModelled, arch_for, workload_from_config
from shoestring.train.config import FinetuneConfig

log = logging.getLogger("shoestring.plan")


def target_gpu(spec: str) -> GPU | None:
    """``plan.gpu``: a catalog entry, the detected CUDA device (``auto``), or None."""
    if spec == "none":
        return None
    if spec != "auto":
        try:
            return find_gpu(spec)
        except KeyError as e:
            raise ConfigError(f"plan.gpu: {e.args[0]}") from None
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    known = detect_gpu_name(props.name)
    base = find_gpu(known) if known else find_gpu("L4")
    # The device's real capacity wins over the catalog (MIG slices, other SKUs).
    return replace(
        base, name=props.name if not known else base.name, memory_bytes=int(props.total_memory)
    )


def preflight(cfg: FinetuneConfig, model_dir: Path, world_size: int = 1) -> Plan | None:
    """Plan ``cfg`` (resolved: concrete device and dtype) for its GPU; raise
    :class:`ConfigError` with the plan's advice when it will not fit and ``plan.enforce``
    is on. Returns the plan (None: no GPU to check)."""
    if cfg.plan.gpu == "auto" and not cfg.train.device.startswith("cuda"):
        return None  # training on the CPU: no GPU to fit
    gpu = target_gpu(cfg.plan.gpu)
    if gpu is None:
        return None
    try:
        arch = arch_for(str(model_dir), "model.path")
        workload, steps = workload_from_config(cfg, arch, world_size, device="cuda", gpu=gpu)
    except NotModelled as e:  # the trainer runs what the planner cannot size
        log.warning("no pre-flight memory check: %s", e)
        return None
    plan = make_plan(workload, gpu, Schedule(steps=steps))
    if plan.fits:
        return plan
    lines = [
        f"the plan says this config needs {plan.peak_bytes / GiB:.2f} GiB per GPU but "
        f"{gpu.name} has {gpu.memory_bytes / GiB:.2f} GiB "
        f"(micro-batch {workload.micro_batch}, data.max_length {workload.seq_len})."
    ]
    if plan.max_micro_batch:
        lines.append(
            f"Largest micro-batch that fits: {plan.max_micro_batch} (train.micro_batch_size)."
        )
    for adv in plan.advice[:4]:
        lines.append(
            f"  - {adv['change']}: {adv['peak_bytes'] / GiB:.2f} GiB"
            f"{'' if adv['fits'] else ' (still too big)'}"
        )
    lines.append(
        "See `shoestring plan --config ...` for the breakdown; set plan.enforce "
        "false to start anyway."
    )
    msg = "\n".join(lines)
    if cfg.plan.enforce:
        raise ConfigError(msg)
    log.warning("%s", msg)
    return plan


def preflight_event(
    cfg: FinetuneConfig, model_dir: Path, world_size: int = 1
) -> dict[str, Any] | None:
    """:func:`preflight` as the trainer's hook: the ``plan`` event's fields, or None."""
    plan = preflight(cfg, model_dir, world_size)
    if plan is None:
        return None
    return {
        "gpu": plan.gpu.name,
        "fits": plan.fits,
        "peak_bytes": plan.peak_bytes,
        "gpu_memory_bytes": plan.gpu.memory_bytes,
        "breakdown": plan.breakdown,
    }
