"""Watchdog benchmarks: recorder overhead, and time-to-detect vs PyTorch's own timeout.

1. **Overhead**: the same 2-process DDP run with the recorder on
   (``--watch.enabled true``: phases, traced collectives via the DDP comm hook,
   live.json every 0.5 s) and off, alternating, ``--rounds`` times each. Reports
   the median step time of each side and the ratio (target: < 1 % slower).
2. **Time to detect** the same injected hang (rank 1 sleeps after step 6):
   ours = ``detected_after_s`` of the watchdog's verdict (``shoestring run``,
   default policy: max(3 x p99 phase time, 10 s)); the peer = PyTorch's own
   collective timeout on the same job without our watchdog
   (``--distributed.timeout_s``, default here 120 s; torch's gloo default is
   1800 s), measured from the last step event to the job's exit.

Usage (repo root)::

    .venv/bin/python benchmarks/watchdog.py
    .venv/bin/python benchmarks/watchdog.py --rounds 3 --peer-timeout 300
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import DEFAULT_CACHE, ROOT, model_dir


def env(extra: dict[str, str] | None = None) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("SHOESTRING_")}
    e.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"), TOKENIZERS_PARALLELISM="false")
    e.update(extra or {})
    return e


def job(
    out: Path,
    args: list[str],
    run_args: list[str],
    extra_env: dict[str, str] | None = None,
) -> tuple[int, float]:
    cmd = [
        sys.executable,
        "-m",
        "shoestring",
        "run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        "--run-dir",
        str(out),
        *run_args,
        "--",
        sys.executable,
        "-m",
        "shoestring",
        "finetune",
        "--output_dir",
        str(out),
        *args,
    ]
    t0 = time.time()
    r = subprocess.run(cmd, env=env(extra_env), capture_output=True, text=True)
    return r.returncode, time.time() - t0


def events(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines() if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--peer-timeout", type=float, default=120.0)
    a = ap.parse_args()
    mdir = model_dir(DEFAULT_CACHE)
    common = [
        "--model.path",
        str(mdir),
        "--train.batch_size",
        "16",
        "--train.micro_batch_size",
        "4",
        "--train.num_threads",
        "1",
        "--data.max_length",
        "64",
        "--data.eval",
        "",
        "--checkpoint.every_steps",
        "20",
        "--train.log_every_steps",
        "1000",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        med: dict[str, list[float]] = {"on": [], "off": []}
        for i in range(a.rounds):
            for side in ("on", "off"):
                out = t / f"{side}{i}"
                rc, _ = job(
                    out,
                    [
                        *common,
                        "--train.max_steps",
                        str(a.steps),
                        "--watch.enabled",
                        "true" if side == "on" else "false",
                    ],
                    [] if side == "on" else ["--no-watch"],
                )
                assert rc == 0, f"{side} run failed"
                ms = [e["step_ms"] for e in events(out) if e["event"] == "step" and e["step"] > 2]
                med[side].append(statistics.median(ms))
        on, off = statistics.median(med["on"]), statistics.median(med["off"])
        print(
            f"recorder overhead: median step {on:.2f} ms on vs {off:.2f} ms off "
            f"-> {100 * (on / off - 1):+.2f} % (per round on {med['on']}, off {med['off']})"
        )

        hang = {"SHOESTRING_FAULTS": "step.end@6:hang:rank1"}
        ours = t / "ours"
        job(ours, [*common, "--train.max_steps", "40"], [], hang)
        verdict = [e for e in events(ours) if e["event"] == "hang"][0]
        peer = t / "peer"
        rc, _ = job(
            peer,
            [*common, "--train.max_steps", "40", "--distributed.timeout_s", str(a.peer_timeout)],
            ["--no-watch"],
            hang,
        )
        ev = events(peer)
        last_step = max(e["ts"] for e in ev if e["event"] == "step")
        end = [e["ts"] for e in ev if e["event"] == "attempt_end"][-1]
        peer_s = end - last_step
        print(
            f"time to detect the same hang: ours {verdict['detected_after_s']:.1f} s "
            f"(verdict: {verdict['summary'][:120]}...) vs PyTorch timeout "
            f"{peer_s:.1f} s (timeout_s={a.peer_timeout:.0f}; job exit {rc}) -> ratio "
            f"{verdict['detected_after_s'] / peer_s:.3f}"
        )


if __name__ == "__main__":
    main()
