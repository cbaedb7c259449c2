"""Data-parallel scaling and sharded-checkpoint blocking, measured on real runs.

Runs ``shoestring finetune`` on the same global batch, data and model:

1. one process;
2. ``--nproc N`` processes under torchrun (DDP, gloo on CPU / nccl on GPU) with
   the DCP checkpoint writer in async mode (``dcp.async_save`` + our seal);
3. the same N-process run with ``--checkpoint.async_mode off`` (synchronous
   ``dcp.save`` + seal on the training thread) — the peer for checkpoint blocking.

Prints tokens/s (median of per-step global tokens / step wall time, checkpoint
and warm-up steps excluded) for 1 vs N processes and the speed-up, and the
training time blocked per sharded checkpoint, async vs synchronous, from the
``checkpoint`` events the runs log.

Usage (repo root)::

    .venv/bin/python benchmarks/scaling.py                  # built-in tiny model, 2 processes
    .venv/bin/python benchmarks/scaling.py --hidden 512 --layers 4 --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import DEFAULT_CACHE, ROOT, model_dir


def run(out: Path, nproc: int, args: list[str], threads: int) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOESTRING_")}
    env.update(
        OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT / "src"), TOKENIZERS_PARALLELISM="false"
    )
    fin = [sys.executable, "-m", "shoestring", "finetune", "--output_dir", str(out), *args]
    cmd = (
        fin
        if nproc == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            "--no-python",
            *fin,
        ]
    )
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"run failed ({r.returncode}):\n{r.stderr[-4000:]}")
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]


def tokens_per_s(events: list[dict], every: int) -> float:
    steps = [
        e for e in events if e["event"] == "step" and e["step"] > 2 and e["step"] % every != 1
    ]  # skip warm-up and the step after each save
    return statistics.median(e["tokens_per_s"] for e in steps)


def blocked(events: list[dict]) -> float:
    return statistics.median(
        e["blocking_ms"]
        for e in events
        if e["event"] == "checkpoint" and e.get("reason") == "steps"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    ap.add_argument("--batch-size", type=int, default=16, help="global batch")
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--lora-r", type=int, default=16)
    a = ap.parse_args()
    mdir = model_dir(DEFAULT_CACHE, a.hidden, a.layers)
    common = [
        "--model.path",
        str(mdir),
        "--train.max_steps",
        str(a.steps),
        "--train.batch_size",
        str(a.batch_size),
        "--train.micro_batch_size",
        str(a.micro_batch_size),
        "--train.num_threads",
        str(a.threads),
        "--train.log_every_steps",
        "1000",
        "--checkpoint.every_steps",
        str(a.every),
        "--checkpoint.keep",
        "2",
        "--data.eval",
        "",
        "--data.max_length",
        "64",
        "--lora.r",
        str(a.lora_r),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        one = run(t / "one", 1, common, a.threads)
        many = run(t / "many", a.nproc, common, a.threads)
        sync = run(t / "sync", a.nproc, [*common, "--checkpoint.async_mode", "off"], a.threads)
    tps1, tpsn = tokens_per_s(one, a.every), tokens_per_s(many, a.every)
    b_async, b_sync, b_one = blocked(many), blocked(sync), blocked(one)
    step_ms = statistics.median(e["step_ms"] for e in many if e["event"] == "step")
    print(
        f"model {mdir.name}, global batch {a.batch_size} (micro {a.micro_batch_size}), "
        f"{a.steps} steps, checkpoint every {a.every}, {a.threads} thread(s)/process, "
        f"cpu_count {os.cpu_count()}"
    )
    print(
        f"tokens/s   1 process: {tps1:,.0f}   {a.nproc} processes (DDP): {tpsn:,.0f}   "
        f"speed-up {tpsn / tps1:.2f}x"
    )
    print(
        f"checkpoint blocked ms (median): {a.nproc} ranks DCP async {b_async:.1f} vs "
        f"synchronous dcp.save {b_sync:.1f} -> ratio {b_async / b_sync:.2f}; "
        f"async = {100 * b_async / step_ms:.1f}% of a {step_ms:.0f} ms step; "
        f"(1 process, our single-file writer: {b_one:.1f})"
    )


if __name__ == "__main__":
    main()
