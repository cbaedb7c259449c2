"""What feeding the trackers costs a training step: ``Tracker.submit`` with all three
sinks on (TensorBoard, W&B offline, MLflow file store) vs the built-in model's step time.

1. A short real ``shoestring finetune`` on the built-in model (1 torch thread, as the
   other CPU benchmarks: on a small shared VM, more threads mostly measure the
   neighbours) gives the median ``step_ms`` (and the step records used below).
2. A :class:`~shoestring.track.Tracker` with all three sinks in a temp run directory:
   * ``submit`` latency per step record (what the training thread pays, the headline:
     target < 1 % of a step);
   * the tracker's background work per record: CPU time of its thread (it holds the GIL
     part of that time) and of W&B's ``wandb-core`` helper process;
   * an in-process check: a synthetic step (torch matmuls sized to the median step),
     100-step blocks with and without the tracker fed every step, alternated, median
     step time per arm (this includes GIL and CPU contention from the sinks; 1 torch
     thread, so a spare core is there for the tracker thread as on a GPU host).

Usage (from the repo root)::

    .venv/bin/python benchmarks/tracker_overhead.py [--steps 20] [--records 2000]
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


def finetune_steps(out: Path, steps: int) -> list[dict[str, Any]]:
    """Step records of a short real run on the built-in model."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TORCHDYNAMO_DISABLE": "1"}
    cmd = [sys.executable, "-m", "shoestring", "finetune", "--output_dir", str(out)]
    cmd += ["--train.max_steps", str(steps), "--train.num_threads", "1"]
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return [r for r in read_events(out / "events.jsonl") if r.get("event") == "step"]


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


def synthetic_step(size: int, reps: int) -> None:
    """``reps`` matmul + tanh layers; the weights keep activations O(1) (no denormals)."""
    a = torch.randn(size, size)
    w = torch.randn(size, size) / size**0.5
    for _ in range(reps):
        a = torch.tanh(a @ w)


def calibrate(step_ms: float, size: int = 256) -> int:
    t0 = time.perf_counter()
    synthetic_step(size, 20)
    per = (time.perf_counter() - t0) * 1e3 / 20
    return max(1, round(step_ms / per))


def contention(
    tracker: Tracker, template: dict[str, Any], reps: int, blocks: int
) -> dict[str, float]:
    """Median synthetic step (ms) with and without feeding the tracker, alternated blocks."""
    times: dict[bool, list[float]] = {True: [], False: []}
    step = 10**5
    for b in range(2 * blocks):
        fed = b % 2 == 1
        for _ in range(100):
            t0 = time.perf_counter()
            synthetic_step(256, reps)
            if fed:
                step += 1
                tracker.submit({**template, "step": step, "ts": time.time()})
            times[fed].append((time.perf_counter() - t0) * 1e3)
    on, off = median(times[True]), median(times[False])
    return {"step_ms_tracked": on, "step_ms_plain": off, "slowdown_pct": 100 * (on / off - 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="steps of the real finetune run")
    ap.add_argument("--records", type=int, default=2000, help="step records submitted")
    ap.add_argument("--blocks", type=int, default=3, help="100-step blocks per arm")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="tracker-overhead-") as tmp:
        steps = finetune_steps(Path(tmp) / "ft", args.steps)
        step_ms = median([float(r["step_ms"]) for r in steps[1:]])  # step 1 warms up
        template = {k: v for k, v in steps[-1].items() if k != "step"}
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        tracker = open_tracker(Path(tmp) / "run")
        cost = submit_cost(tracker, template, args.records)
        reps = calibrate(step_ms)
        cont = contention(tracker, template, reps, args.blocks)
        tracker.close("completed")
    print(f"# tracker overhead ({load_note()}; torch threads {torch.get_num_threads()})")
    print(f"built-in model, median step_ms over {len(steps) - 1} steps: {step_ms:.1f} ms")
    print(
        f"sinks: tensorboard + wandb (offline) + mlflow (file store); {args.records} step records"
    )
    print(
        f"submit: median {cost['submit_us_median']:.2f} µs, p99 {cost['submit_us_p99']:.2f} µs "
        f"-> {100 * cost['submit_us_median'] / 1e3 / step_ms:.4f} % of a step (target < 1 %)"
    )
    print(
        f"background per record: tracker thread {cost['thread_cpu_ms']:.3f} ms CPU "
        f"({100 * cost['thread_cpu_ms'] / step_ms:.2f} % of a step), wandb-core "
        f"{cost['wandb_core_cpu_ms']:.3f} ms CPU; {args.records} records drained in "
        f"{cost['drain_s']:.2f} s; dropped {cost['dropped']}"
    )
    print(
        f"synthetic {step_ms:.0f} ms step, {args.blocks}x100 steps per arm: plain "
        f"{cont['step_ms_plain']:.2f} ms, tracked {cont['step_ms_tracked']:.2f} ms "
        f"-> {cont['slowdown_pct']:+.2f} %"
    )
    print(json.dumps({"step_ms": step_ms, **cost, **cont}))


if __name__ == "__main__":
    main()
