"""``shoestring plan``: will this fine-tune fit the GPU, how long, and what will it cost."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shoestring import exitcodes
from shoestring.config import Invocation, knob, positive, unit_interval
from shoestring.gpus import CATALOG, GiB, find_gpu
from shoestring.plan.arch import LINEARS, PRESETS
from shoestring.plan.memory import Method
from shoestring.train.config import ComputeDtype, Optimizer, Quantize

if TYPE_CHECKING:
    from shoestring.plan.workload import PlanRequest

PLAN_EPILOG = """\
--model takes a preset ({presets}), a local model directory or a config.json.
With --config, the finetune YAML supplies the defaults (model.path, lora.*, data.max_length,
train.micro_batch_size / batch_size, train.max_steps, train.optimizer,
model.gradient_checkpointing); flags override it. The keys above can also come from a
YAML of their own: --plan-config FILE.yaml (gpu: T4, seq_len: 2048, ...).

exit codes: 0 fits; 1 does not fit; 2 bad arguments.
examples:
  shoestring plan --model llama-3-8b --method qlora --seq-len 2048 --gpu T4
  shoestring plan --config configs/llama-7b-lora-spot.yaml --gpu L4 --json
""".format(presets=", ".join(sorted(PRESETS)))


def _known_gpu(name: str) -> str | None:
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
    model: str = knob("", "Preset name, model directory or config.json.")
    method: Method | None = knob(
        None, "Default: lora, or qlora when the config sets lora.quantize."
    )
    quantize: Quantize | None = knob(None, "Base quantization (qlora defaults to nf4).")
    dtype: ComputeDtype | None = knob(
        None, "Compute dtype (default bfloat16; float16 on GPUs without bf16)."
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
    gpu: str = knob("L4", f"One of {', '.join(CATALOG)}.", check=_known_gpu)
    steps: int | None = knob(
        None, "Optimizer steps, for time and cost (default 1000).", check=positive
    )
    checkpoint_minutes: float = knob(
        10.0, "Checkpoint interval, for the spot-preemption overhead.", check=positive
    )
    json: bool = knob(False, "Print the plan as JSON.")
    list_gpus: bool = knob(False, "Print the GPU catalog and exit.")

    def request(self) -> PlanRequest:
        """The planner's view: unset stays ``None`` (from --config, else the default)."""
        from shoestring.plan.workload import PlanRequest

        return PlanRequest(
            config=Path(self.config) if self.config else None,
            model=self.model or None,
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
            steps=self.steps,
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


def run_plan(cfg: PlanConfig, call: Invocation) -> int:
    from shoestring.plan.estimate import Schedule, make_plan
    from shoestring.plan.report import to_json, to_text
    from shoestring.plan.workload import resolve_request

    if cfg.list_gpus:
        print(_list_gpus())
        return exitcodes.OK
    gpu = find_gpu(cfg.gpu)  # checked by the knob
    cache = Path(call.env.get("SHOESTRING_CACHE") or Path.home() / ".cache" / "shoestring")
    workload, steps = resolve_request(cfg.request(), gpu, cache_dir=cache)
    plan = make_plan(
        workload, gpu, Schedule(steps=steps, checkpoint_minutes=cfg.checkpoint_minutes)
    )
    print(to_json(plan) if cfg.json else to_text(plan))
    return exitcodes.OK if plan.fits else exitcodes.FAILED
