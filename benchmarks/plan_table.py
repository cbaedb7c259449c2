"""The docs table: every shipped config (configs/*.yaml) planned on the catalog GPUs.

Prints markdown rows: config, GPU, fits, predicted peak, largest micro-batch, time,
on-demand and spot cost. A config whose model.path is not on this machine is planned
with the preset its directory name matches (e.g. /models/Llama-2-7b-hf -> llama-2-7b).

    .venv/bin/python benchmarks/plan_table.py [--gpus T4,L4,A10G,A100-80GB,H100]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from shoestring.config import load  # noqa: E402
from shoestring.gpus import GiB, find_gpu  # noqa: E402
from shoestring.plan.arch import PRESETS  # noqa: E402
from shoestring.plan.estimate import Schedule, make_plan  # noqa: E402
from shoestring.plan.workload import arch_for, workload_from_config  # noqa: E402
from shoestring.train.config import FinetuneConfig  # noqa: E402


def _arch(path: str) -> tuple[object, str]:
    p = Path(path)
    if path.startswith("builtin:") or p.is_dir():
        return arch_for(path, "model.path"), path
    key = p.name.lower().removesuffix("-hf").removeprefix("meta-")
    if key in PRESETS:
        return PRESETS[key], f"preset {key}"
    raise SystemExit(f"{path}: not here and no preset named {key!r}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", default="T4,L4,A10G,A100-80GB,H100")
    args = ap.parse_args()
    print(
        "| config | model | GPU | fits | predicted peak | largest micro-batch | time (h) "
        "| on-demand $ | spot $ |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for f in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = load(FinetuneConfig, str(f), [])
        arch, label = _arch(cfg.model.path)
        w, steps = workload_from_config(cfg, arch)  # type: ignore[arg-type]
        for name in args.gpus.split(","):
            gpu = find_gpu(name)
            plan = make_plan(
                w,
                gpu,
                Schedule(steps=steps, checkpoint_minutes=cfg.checkpoint.every_seconds / 60 or 10.0),
            )
            print(
                f"| {f.name} | {label} | {gpu.name} | {'yes' if plan.fits else 'no'} "
                f"| {plan.peak_bytes / GiB:.2f} GiB | {plan.max_micro_batch or '-'} "
                f"| {plan.hours:.3g} | {plan.cost_usd:.3g} | {plan.cost_spot_usd:.3g} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
