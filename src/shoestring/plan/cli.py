"""``shoestring plan``: will this fine-tune fit the GPU, how long, and what will it cost."""

from __future__ import annotations

import argparse
from pathlib import Path

from shoestring import exitcodes
from shoestring.config import ConfigError
from shoestring.plan.arch import LINEARS, PRESETS
from shoestring.plan.gpus import CATALOG, GiB

EPILOG = """\
--model takes a preset ({presets}), a local model directory or a config.json.
With --config, the finetune YAML supplies the defaults (model.path, lora.*, data.max_length,
train.micro_batch_size / batch_size, train.max_steps, train.optimizer,
model.gradient_checkpointing); flags override it.

exit codes: 0 fits; 1 does not fit; 2 bad arguments.
examples:
  shoestring plan --model llama-3-8b --method qlora --seq-len 2048 --gpu T4
  shoestring plan --config configs/llama-7b-lora-spot.yaml --gpu L4 --json
"""


def plan_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "plan", help="predict peak GPU memory, time and cost of a fine-tune before running it",
        description="Predict whether a fine-tune fits a GPU (memory breakdown by component), the "
                    "largest micro-batch and sequence that fit, what to change if it does not, "
                    "and time and cost on demand and on spot. Nothing is loaded or downloaded.",
        epilog=EPILOG.format(presets=", ".join(sorted(PRESETS))),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE.yaml", help="a shoestring finetune config")
    p.add_argument("--model", help="preset name, model directory or config.json")
    p.add_argument("--method", choices=("full", "lora", "qlora"), help="default: lora, or "
                   "qlora when the config sets lora.quantize")
    p.add_argument("--quantize", choices=("none", "nf4", "int8"), help="base quantization "
                   "(qlora defaults to nf4)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                   help="compute dtype (default bfloat16; float16 on GPUs without bf16)")
    p.add_argument("--r", type=int, help="LoRA rank (default 16)")
    p.add_argument("--targets", help=f"comma-separated LoRA targets (default all: {','.join(LINEARS)})")
    p.add_argument("--lora-dropout", type=float, help="LoRA dropout (default 0.05)")
    p.add_argument("--seq-len", type=int, help="tokens per sample (default 2048)")
    p.add_argument("--micro-batch", type=int, help="samples per forward pass (default 1)")
    p.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step (default 1)")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction,
                   default=None, help="recompute activations in backward (default on)")
    p.add_argument("--optimizer", choices=("adamw", "adamw8bit", "paged_adamw8bit"))
    p.add_argument("--packed", action="store_true", default=None,
                   help="samples are packed (no attention mask per batch)")
    p.add_argument("--gpu", default=None, help=f"one of {', '.join(CATALOG)} (default L4)")
    p.add_argument("--steps", type=int, help="optimizer steps, for time and cost (default 1000)")
    p.add_argument("--checkpoint-minutes", type=float, default=10.0,
                   help="checkpoint interval, for the spot-preemption overhead (default 10)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--list-gpus", action="store_true", help="print the GPU catalog and exit")
    return p


def _list_gpus() -> str:
    rows = [f"{'gpu':10s} {'memory':>9s} {'bf16 TF':>8s} {'fp16 TF':>8s} {'$/h':>6s} "
            f"{'spot':>6s}  source, date"]
    for g in CATALOG.values():
        rows.append(f"{g.name:10s} {g.memory_bytes / GiB:6.1f} GiB {g.bf16_flops / 1e12:8.0f} "
                    f"{g.fp16_flops / 1e12:8.0f} {g.on_demand_usd_h:6.2f} {g.spot_usd_h:6.2f}  "
                    f"{g.price_source}, {g.price_date}"
                    + (f" ({g.price_note})" if g.price_note else ""))
    return "\n".join(rows)


def run_plan(args: argparse.Namespace, rest: list[str], env: dict[str, str]) -> int:
    from shoestring.plan.estimate import Schedule, make_plan
    from shoestring.plan.gpus import find_gpu
    from shoestring.plan.report import to_json, to_text
    from shoestring.plan.workload import PlanRequest, resolve_request

    if args.list_gpus:
        print(_list_gpus())
        return exitcodes.OK
    if rest:
        raise ConfigError(f"plan: unexpected arguments {' '.join(rest)}")
    try:
        gpu = find_gpu(args.gpu or "L4")
    except KeyError as e:
        raise ConfigError(f"--gpu: {e.args[0]}") from None
    req = PlanRequest(
        config=Path(args.config) if args.config else None, model=args.model,
        method=args.method, quantize=args.quantize, dtype=args.dtype, r=args.r,
        targets=tuple(t.strip() for t in args.targets.split(",") if t.strip())
        if args.targets else None, lora_dropout=args.lora_dropout, seq_len=args.seq_len,
        micro_batch=args.micro_batch, grad_accum=args.grad_accum,
        gradient_checkpointing=args.gradient_checkpointing, optimizer=args.optimizer,
        packed=args.packed, steps=args.steps)
    workload, steps = resolve_request(req, gpu, cache_dir=Path(env.get("SHOESTRING_CACHE") or
                                                              Path.home() / ".cache" / "shoestring"))
    if args.checkpoint_minutes <= 0:
        raise ConfigError(f"--checkpoint-minutes: must be > 0, got {args.checkpoint_minutes}")
    plan = make_plan(workload, gpu, Schedule(steps=steps,
                                             checkpoint_minutes=args.checkpoint_minutes))
    print(to_json(plan) if args.json else to_text(plan))
    return exitcodes.OK if plan.fits else exitcodes.FAILED
