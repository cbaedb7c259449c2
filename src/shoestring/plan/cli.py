"""``shoestring plan``: will this fine-tune fit the GPU, how long, and what will it cost."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from shoestring import exitcodes
from shoestring.config import (
    ConfigError,
    Invocation,
    knob,
    non_negative,
    positive,
    unit_interval,
)
from shoestring.gpus import CATALOG, GiB, find_gpu
from shoestring.plan.arch import LINEARS, PRESETS
from shoestring.plan.memory import Method, Parallelism
from shoestring.plan.workload import DEFAULT_GPU
from shoestring.train.config import ComputeDtype, FinetuneConfig, Optimizer, Quantize

if TYPE_CHECKING:
    from shoestring.hub import HubAccess
    from shoestring.plan.workload import PlanRequest

PlanDevice = Literal["auto", "cpu", "cuda"]

PLAN_EPILOG = """\
--model takes a preset ({presets}), a local model directory, a config.json, a Hub id
org/name[@revision] (only its config.json is downloaded) or a folder URL (s3://, gs://).
A pre-quantized bitsandbytes base (*-bnb-4bit) is planned as QLoRA with its own quantization.
With --config, the finetune YAML supplies the defaults (model.path, lora.*, data.max_length,
train.micro_batch_size / batch_size, train.max_steps, train.optimizer,
train.loss_chunk_tokens, train.offload_activations, model.gradient_checkpointing); flags
override it. The keys above can also come from a
YAML of their own: --plan-config FILE.yaml (gpu: T4, seq_len: 2048, ...).
--device cpu plans a CPU run (host RAM, --ram; no time or cost); cuda, the default unless
the config says train.device: cpu, plans for --gpu. Dtype and autocast follow finetune's rule.
--world-size N plans each of N ranks (micro-batch per rank) under --strategy ddp or fsdp, and
the host RAM of --gpus-per-host ranks; the verdict is per GPU.

exit codes: 0 fits; 1 does not fit; 2 bad arguments.
examples:
  shoestring plan --model llama-3-8b --method qlora --seq-len 2048 --gpu T4
  shoestring plan --config configs/llama-7b-lora-spot.yaml --gpu L4 --json
  shoestring plan --config configs/tiny-reverse.yaml --device cpu
  shoestring plan --model llama-3-70b --method qlora --world-size 8 --strategy fsdp --gpu L4
""".format(presets=", ".join(sorted(PRESETS)))


def _known_gpu(name: str) -> str | None:
    if not name:
        return None
    try:
        find_gpu(name)
    except KeyError:
        return f"must be a GPU of the catalog ({', '.join(CATALOG)}; --list-gpus)"
    return None


@dataclass
class PlanConfig:
    """``shoestring plan``: what to plan. Unset keys come from ``config`` (a finetune
    YAML), else the defaults named in their help."""

    config: str = knob(
        "", "A shoestring finetune config (YAML) that supplies the defaults of the keys below."
    )
    model: str = knob(
        "", "Preset name, model directory, config.json, Hub id (org/name[@rev]) or folder URL."
    )
    device: PlanDevice = knob(
        "auto",
        "Plan a run on 'cuda' (a GPU of the catalog, --gpu) or on 'cpu' (host RAM, --ram). "
        "'auto': cuda when --gpu is given, else the config's train.device (its auto is "
        "planned as a GPU run), else cuda.",
    )
    method: Method | None = knob(
        None, "Default: lora, or qlora when the config sets lora.quantize."
    )
    quantize: Quantize | None = knob(None, "Base quantization (qlora defaults to nf4).")
    dtype: ComputeDtype | None = knob(
        None,
        "Base-weight dtype, as model.dtype (default: finetune's auto: float32 on CPU; on "
        "CUDA bfloat16, float16 on GPUs without bf16).",
    )
    r: int | None = knob(None, "LoRA rank (default 16).", check=positive)
    targets: list[str] | None = knob(
        None, f"Comma-separated LoRA targets (default all: {','.join(LINEARS)})."
    )
    lora_dropout: float | None = knob(None, "LoRA dropout (default 0.05).", check=unit_interval)
    seq_len: int | None = knob(None, "Tokens per sample (default 2048).", check=positive)
    micro_batch: int | None = knob(None, "Samples per forward pass (default 1).", check=positive)
    grad_accum: int | None = knob(
        None, "Micro-batches per optimizer step (default 1).", check=positive
    )
    gradient_checkpointing: bool | None = knob(
        None, "Recompute activations in backward (default on; --no-gradient-checkpointing: off)."
    )
    optimizer: Optimizer | None = knob(None, "Optimizer (default adamw).")
    packed: bool = knob(False, "Samples are packed (no attention mask per batch).")
    loss_chunk_tokens: int | None = knob(
        None,
        "Chunked cross-entropy, as train.loss_chunk_tokens: tokens per chunk of the LM "
        "head and loss (default 0: off).",
        check=non_negative,
    )
    offload_activations: bool | None = knob(
        None,
        "Saved activations in host RAM, as train.offload_activations (default off; "
        "--no-offload-activations overrides a config's true).",
    )
    gpu: str = knob(
        "", f"One of {', '.join(CATALOG)} (default {DEFAULT_GPU}; none on CPU).", check=_known_gpu
    )
    ram: float | None = knob(
        None, "--device cpu: host RAM in GiB to fit in (default: this machine's).", check=positive
    )
    steps: int | None = knob(
        None, "Optimizer steps, for time and cost (default 1000).", check=positive
    )
    checkpoint_minutes: float = knob(
        10.0, "Checkpoint interval, for the spot-preemption overhead.", check=positive
    )
    world_size: int = knob(
        1, "Ranks (GPUs) of the run; the memory is then per rank (per GPU).", check=positive
    )
    gpus_per_host: int | None = knob(
        None, "Ranks per host, for the host RAM (default: all on one host).", check=positive
    )
    strategy: Parallelism | None = knob(
        None,
        "How the ranks share the model, as distributed.strategy: 'ddp' (a replica each) or "
        "'fsdp' (FSDP2 shards); 'single' is one process. Default: single for one rank, else "
        "the config's distributed.strategy (ddp).",
    )
    cpu_offload: bool | None = knob(
        None,
        "As distributed.cpu_offload: FSDP2's shards, gradients and optimizer state in host "
        "RAM (default: the config's, else off).",
    )
    json: bool = knob(False, "Print the plan as JSON.")
    list_gpus: bool = knob(False, "Print the GPU catalog and exit.")

    def request(self) -> PlanRequest:
        """The planner's view: unset stays ``None`` (from --config, else the default)."""
        from shoestring.plan.workload import PlanRequest

        return PlanRequest(
            config=Path(self.config) if self.config else None,
            model=self.model or None,
            device=None if self.device == "auto" else self.device,
            gpu=self.gpu or None,
            method=self.method,
            quantize=self.quantize,
            dtype=self.dtype,
            r=self.r,
            targets=tuple(self.targets) if self.targets is not None else None,
            lora_dropout=self.lora_dropout,
            seq_len=self.seq_len,
            micro_batch=self.micro_batch,
            grad_accum=self.grad_accum,
            gradient_checkpointing=self.gradient_checkpointing,
            optimizer=self.optimizer,
            packed=self.packed or None,
            loss_chunk_tokens=self.loss_chunk_tokens,
            offload_activations=self.offload_activations,
            steps=self.steps,
            world_size=self.world_size,
            gpus_per_host=self.gpus_per_host,
            strategy=self.strategy,
            cpu_offload=self.cpu_offload,
        )


def _list_gpus() -> str:
    rows = [
        f"{'gpu':10s} {'memory':>9s} {'bf16 TF':>8s} {'fp16 TF':>8s} {'$/h':>6s} "
        f"{'spot':>6s}  source, date"
    ]
    for g in CATALOG.values():
        rows.append(
            f"{g.name:10s} {g.memory_bytes / GiB:6.1f} GiB {g.bf16_flops / 1e12:8.0f} "
            f"{g.fp16_flops / 1e12:8.0f} {g.on_demand_usd_h:6.2f} {g.spot_usd_h:6.2f}  "
            f"{g.price_source}, {g.price_date}" + (f" ({g.price_note})" if g.price_note else "")
        )
    return "\n".join(rows)


def host_memory_bytes() -> int:
    """This machine's physical memory (what a CPU run of finetune here has)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _hub_access(env: Mapping[str, str], cache: Path) -> HubAccess:
    """A Hub id's config.json comes through huggingface_hub (HF_TOKEN, HF_ENDPOINT,
    HF_HUB_OFFLINE); a bucket URL's folder through the checkpoint store."""
    from shoestring.checkpoint.mirror import fetch_model_folder
    from shoestring.hub import HubAccess

    return HubAccess.from_env(env, cache, buckets=fetch_model_folder)


def run_plan(cfg: PlanConfig, call: Invocation) -> int:
    from shoestring.plan.estimate import Schedule, host_target, make_plan
    from shoestring.plan.report import to_json, to_text
    from shoestring.plan.workload import resolve_request

    if cfg.list_gpus:
        print(_list_gpus())
        return exitcodes.OK
    cache = Path(call.env.get("SHOESTRING_CACHE") or Path.home() / ".cache" / "shoestring")
    r = resolve_request(cfg.request(), cache_dir=cache, hub=_hub_access(call.env, cache))
    if r.gpu is not None and cfg.ram is not None:
        raise ConfigError("--ram: this plans a CUDA run (GPU memory); --device cpu plans host RAM")
    if r.gpu is not None:
        target = r.gpu
    elif cfg.ram is not None:
        target = host_target(int(cfg.ram * GiB), "--ram")
    else:
        target = host_target(host_memory_bytes(), "this machine")
    plan = make_plan(
        r.workload,
        target,
        Schedule(steps=r.steps, checkpoint_minutes=cfg.checkpoint_minutes),
        gpus_per_host=r.gpus_per_host,
    )
    if not cfg.json:
        print(planned_from(cfg.config))
    print(to_json(plan) if cfg.json else to_text(plan))
    return exitcodes.OK if plan.fits else exitcodes.FAILED


def planned_from(config: str) -> str:
    """The first line: which config was planned. Without --config, plan's own defaults
    (a realistic fine-tune) are not ``shoestring finetune``'s (a two-minute demo)."""
    if config:
        return f"planned  {config} (finetune's config), with the flags given here"
    d = FinetuneConfig()
    micro = d.train.micro_batch_size or d.train.batch_size
    return (
        "planned  plan's defaults (micro-batch 1, seq 2048, gradient checkpointing on) and "
        f"the flags given here; finetune with no arguments differs (micro-batch {micro}, "
        f"data.max_length {d.data.max_length}, gradient checkpointing "
        f"{'on' if d.model.gradient_checkpointing else 'off'}): --config FILE.yaml plans a "
        "finetune config"
    )
