"""The end-of-run cost ledger: streamed fold vs the whole timeline loaded.

Writes a synthetic supervised history (2 ranks, 3 attempts, each rank's log rotated into
3 segments, a ``metrics`` record of ``--pad`` bytes beside every step: the bulk of a real
long log), then times and traces (tracemalloc peak) both ways of computing the same
ledger: ``run_ledger`` (what a run's end calls: ``timeline.stream`` through
``LedgerFold``) and ``compute(load(...))`` (what ``shoestring report`` does, holding every
record). Prints one JSON object; ``--out`` writes it too.

    .venv/bin/python benchmarks/ledger_memory.py --steps 10000 --out benchmarks/results/ledger-memory-DATE.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from shoestring.report.ledger import compute, run_ledger  # noqa: E402
from shoestring.report.timeline import load  # noqa: E402
from test_ledger import supervised_history  # noqa: E402


def measure(fn: Callable[[], Any]) -> dict[str, float]:
    t = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t
    tracemalloc.start()
    try:
        fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return {"seconds": round(seconds, 3), "peak_traced_mb": round(peak / 1e6, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10000, help="steps per attempt")
    ap.add_argument("--pad", type=int, default=1000)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        supervised_history(run, a.steps, a.pad)
        size = sum(p.stat().st_size for p in run.rglob("*.jsonl"))
        streamed, loaded = measure(lambda: run_ledger(run)), measure(lambda: compute(load(run)))
        same = run_ledger(run)[0] == compute(load(run)).to_json()
    res = {
        "what": "end-of-run cost ledger: streamed fold vs loaded timeline",
        "log_mb": round(size / 1e6, 1),
        "records": 3 * a.steps * 4,
        "streamed": streamed,
        "loaded": loaded,
        "peak_ratio": round(loaded["peak_traced_mb"] / streamed["peak_traced_mb"], 1),
        "same_ledger": same,
    }
    print(json.dumps(res, indent=1))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
