"""What feeding the trackers costs a training step, with all three sinks on
(TensorBoard, W&B offline, MLflow file store), on the built-in model.

1. The headline, end to end and in one process: a real ``shoestring finetune`` on the
   built-in model (1 torch thread, as in the other CPU benchmarks: on a small shared
   VM more threads mostly measure the neighbours) with all three sinks open, whose
   step records reach the tracker only in every other block of ``--block`` steps
   (a gate on ``Tracker.submit``; every other record always passes). Each block's
   first ``--skip`` steps are left out of both arms, so the previous block's batch
   (the tracker takes step records once a second) is not counted where it does not
   belong. Per pair of blocks: the fed block's median step over the unfed one's; the
   mean of the pairs and its 95 % interval (Student t) are the result: target < 1 %.
   One process for both arms: separate runs differ by 2-3 % from run to run on this
   VM (measured), more than the effect. Opening the sinks (imports, ``wandb.init``)
   is a one-off at start, on the tracker's thread, and is not in either arm.
2. Why it is small: a :class:`~shoestring.track.Tracker` with all three sinks in a
   temp run directory, fed ``--records`` step records:
   * ``submit`` latency per record (all the training thread itself pays);
   * the background work per record: CPU time of the tracker's thread (which holds
     the GIL for part of it) and of W&B's ``wandb-core`` helper process.

Usage (from the repo root)::

    .venv/bin/python benchmarks/tracker_overhead.py [--pairs 6] [--block 40] [--skip 10]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from _common import ROOT, load_note, median, pct
from shoestring.events import read_events
from shoestring.track import TrackConfig, Tracker

ALL_SINKS = ("--track.to", "tensorboard,wandb,mlflow", "--track.wandb_mode", "offline")


def child_env() -> dict[str, str]:
    """The environment of a benchmark's child run (this checkout; offline trackers)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TORCHDYNAMO_DISABLE": "1"}
    return {**env, "MLFLOW_ALLOW_FILE_STORE": "true", "WANDB_SILENT": "true"}


def finetune_steps(out: Path, steps: int, *extra: str) -> list[dict[str, Any]]:
    """Step records of a short real run on the built-in model."""
    env = child_env()
    cmd = [sys.executable, "-m", "shoestring", "finetune", "--output_dir", str(out)]
    cmd += ["--train.max_steps", str(steps), "--train.num_threads", "1", *extra]
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return [r for r in read_events(out / "events.jsonl") if r.get("event") == "step"]


def gated_child(out: str, steps: int, block: int) -> None:
    """(In the child process.) The real finetune with all three sinks, step records
    gated: only blocks ``1, 3, 5, ...`` (counting from 0) of ``block`` steps reach them."""
    from shoestring import cli

    submit = Tracker.submit

    def gated(self: Tracker, record: Any) -> None:
        step = record.get("step")
        if record.get("event") != "step" or (isinstance(step, int) and (step // block) % 2):
            submit(self, record)

    Tracker.submit = gated  # type: ignore[method-assign]
    args = ["finetune", "--output_dir", out, "--train.max_steps", str(steps)]
    raise SystemExit(cli.main([*args, "--train.num_threads", "1", *ALL_SINKS]))


def gated_run(tmp: Path, pairs: int, block: int, skip: int) -> dict[str, Any]:
    """The headline: per pair of blocks, the fed block's median step over the unfed
    one's (each without its first ``skip`` steps), in %; their mean and 95 % interval."""
    out, steps = tmp / "gated", 2 * pairs * block + block
    cmd = [sys.executable, __file__, "--gated-child", str(out), str(steps), str(block)]
    subprocess.run(cmd, env=child_env(), check=True, capture_output=True, text=True)
    ms: dict[int, list[float]] = {}
    for r in read_events(out / "events.jsonl"):
        if r.get("event") == "step" and r["step"] % block >= skip:
            ms.setdefault(r["step"] // block, []).append(float(r["step_ms"]))
    blocks = {b: median(v) for b, v in ms.items() if b >= 1}  # block 0 warms up
    per_pair = [100 * (blocks[2 * i + 1] / blocks[2 * i + 2] - 1) for i in range(pairs)]
    fed = median([x for b, v in ms.items() if b % 2 for x in v])
    unfed = median([x for b, v in ms.items() if b >= 1 and not b % 2 for x in v])
    return {
        "gated_pct_pairs": per_pair,
        "gated_pct": sum(per_pair) / len(per_pair),
        "gated_pct_ci95": ci95(per_pair),
        "gated_ms_fed": fed,
        "gated_ms_unfed": unfed,
    }


#: Student t quantiles (0.975) by degrees of freedom, for the 95 % interval (2.0 past 30).
T975 = dict(
    enumerate(
        [12.71, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228]
        + [2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086]
        + [2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042],
        start=1,
    )
)


def ci95(xs: list[float]) -> float:
    """Half-width of the 95 % interval of the mean of ``xs`` (inf for one value)."""
    n = len(xs)
    if n < 2:
        return float("inf")
    mean = sum(xs) / n
    sd = (sum((x - mean) ** 2 for x in xs) / (n - 1)) ** 0.5
    return T975.get(n - 1, 2.0) * sd / n**0.5


def open_tracker(run: Path) -> Tracker:
    os.environ.setdefault("WANDB_SILENT", "true")
    cfg = TrackConfig(to=["tensorboard", "wandb", "mlflow"], wandb_mode="offline")
    tracker = Tracker.open(cfg, run)
    tracker.submit({"event": "run_start", "ts": time.time(), "step": 0, "max_steps": 10**6})
    if not tracker.flush(120):  # sinks open (imports, wandb.init) outside the timing
        raise SystemExit("trackers did not open within 120 s")
    return tracker


def thread_cpu(tid: int | None) -> float:
    for t in psutil.Process().threads():
        if t.id == tid:
            return float(t.user_time + t.system_time)
    return 0.0


def core_cpu() -> float:
    kids = psutil.Process().children(recursive=True)
    return sum(float(p.cpu_times().user + p.cpu_times().system) for p in kids)


def tracker_thread(tracker: Tracker) -> threading.Thread:
    return next(t for t in threading.enumerate() if t.name == "shoestring-track")


def submit_cost(tracker: Tracker, template: dict[str, Any], n: int) -> dict[str, float]:
    """Per-record submit latency (µs) and background CPU (ms) per record."""
    tid = tracker_thread(tracker).native_id
    cpu0, core0 = thread_cpu(tid), core_cpu()
    lat = []
    t_all = time.perf_counter()
    for i in range(n):
        rec = {**template, "step": 10 + i, "ts": time.time()}
        t0 = time.perf_counter_ns()
        tracker.submit(rec)
        lat.append((time.perf_counter_ns() - t0) / 1e3)
    t_submit = time.perf_counter() - t_all
    tracker.flush(300)
    drain = time.perf_counter() - t_all
    return {
        "submit_us_median": median(lat),
        "submit_us_p99": pct(lat, 99),
        "submit_s_total": t_submit,
        "drain_s": drain,
        "thread_cpu_ms": (thread_cpu(tid) - cpu0) * 1e3 / n,
        "wandb_core_cpu_ms": (core_cpu() - core0) * 1e3 / n,
        "dropped": tracker.dropped,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pairs", type=int, default=6, help="pairs of blocks (0: skip)")
    ap.add_argument("--block", type=int, default=40, help="steps per block")
    ap.add_argument("--skip", type=int, default=10, help="first steps of a block left out")
    ap.add_argument("--records", type=int, default=2000, help="step records submitted")
    ap.add_argument("--gated-child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.gated_child:
        out, steps, block = args.gated_child
        gated_child(out, int(steps), int(block))
    torch.set_num_threads(1)
    print(f"# tracker overhead ({load_note()}; torch threads 1)")
    with tempfile.TemporaryDirectory(prefix="tracker-overhead-") as tmp:
        gated = gated_run(Path(tmp), args.pairs, args.block, args.skip) if args.pairs else {}
        steps = finetune_steps(Path(tmp) / "ft", 20)
        step_ms = median([float(r["step_ms"]) for r in steps[1:]])  # step 1 warms up
        template = {k: v for k, v in steps[-1].items() if k != "step"}
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        tracker = open_tracker(Path(tmp) / "run")
        cost = submit_cost(tracker, template, args.records)
        tracker.close("completed")
    report(args, gated, step_ms, cost)
    print(json.dumps({"step_ms": step_ms, **cost, **gated}))


def report(
    args: argparse.Namespace, gated: dict[str, Any], step_ms: float, cost: dict[str, float]
) -> None:
    if gated:
        pairs = ", ".join(f"{x:+.2f}" for x in gated["gated_pct_pairs"])
        print(f"pairs of {args.block}-step blocks (fed vs not, %): {pairs}")
        print(
            f"real finetune, all three sinks fed vs not, one process: median step "
            f"{gated['gated_ms_fed']:.1f} vs {gated['gated_ms_unfed']:.1f} ms; "
            f"{gated['gated_pct']:+.2f} % +- {gated['gated_pct_ci95']:.2f} % (95 %) of a "
            f"step (target < 1 %)"
        )
    print(f"built-in model, median step over 19 steps: {step_ms:.1f} ms; {args.records} records")
    print(
        f"submit: median {cost['submit_us_median']:.2f} µs, p99 {cost['submit_us_p99']:.2f} µs "
        f"-> {100 * cost['submit_us_median'] / 1e3 / step_ms:.4f} % of a step"
    )
    print(
        f"background per record: tracker thread {cost['thread_cpu_ms']:.3f} ms CPU "
        f"({100 * cost['thread_cpu_ms'] / step_ms:.2f} % of a step), wandb-core "
        f"{cost['wandb_core_cpu_ms']:.3f} ms CPU; drained in {cost['drain_s']:.2f} s; "
        f"dropped {cost['dropped']}"
    )


if __name__ == "__main__":
    main()
