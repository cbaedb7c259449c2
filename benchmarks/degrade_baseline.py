"""Degradation baselines on simulated windows: false alarms on a steady job, and
alarms after a slow start.

Each trace is a sequence of one-minute windows of one rank: communication time per
step and step time, each with Gaussian window-to-window noise of ``sigma``. Three
baseline rules judge the *same* traces with the same alarm rule (3 windows in a
row more than the margin worse: communication +10 %, throughput -5 %):

* ``first-median`` — shoestring before 2026-12-06: the median of windows 2-4,
  fixed for the attempt;
* ``best-median`` — the best median of any 5 windows in a row so far (the rank's
  historical best, as nvidia-resiliency-ext's individual straggler score uses the
  best median it has seen);
* ``held`` (ours) — :class:`shoestring.watch.degrade.DegradationMonitor` itself, fed
  cumulative totals like the watchdog: the best level held over 5 windows in a
  row (the least good of them).

Scenarios: ``steady`` (no change at all: any alarm is false) and ``slow-start``
(the first 6 windows ``slow``x slower, 60 at true speed, then 10 windows
degraded by ``deg``x the margin — 1.2: communication +12 %, throughput -6 %;
1.5: +15 %, -7.5 % — an alarm in those 10 windows is a detection).

Usage (repo root)::

    .venv/bin/python benchmarks/degrade_baseline.py            # the README table
    .venv/bin/python benchmarks/degrade_baseline.py --trials 50 --windows 300
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from shoestring.watch.degrade import DegradationMonitor, DegradePolicy

POLICY = DegradePolicy()
STEPS, TOKENS = 100, 512  # per window, per step
Trace = list[tuple[float, float]]  # (step_s, comm_s) per window


def ours(trace: Trace) -> dict[str, list[int]]:
    """Windows (0-based) at which DegradationMonitor raised each kind of alarm."""
    mon = DegradationMonitor(POLICY)
    tot = {"steps": 0, "tokens": 0, "train_s": 0.0, "comm_s": 0.0}
    mon.observe(0.0, {0: {"totals": dict(tot)}})
    out: dict[str, list[int]] = {"comm_degraded": [], "throughput_drop": []}
    for i, (step_s, comm_s) in enumerate(trace):
        tot["steps"] += STEPS
        tot["tokens"] += STEPS * TOKENS
        tot["train_s"] += STEPS * step_s
        tot["comm_s"] += STEPS * comm_s
        _, alarms = mon.observe(POLICY.window_s * (i + 1), {0: {"totals": dict(tot)}})
        for a in alarms:
            out[a["kind"]].append(i)
    return out


def reference(trace: Trace, rule: str, k: int) -> dict[str, list[int]]:
    """The same alarm rule with a ``first-median`` or ``best-median`` baseline of ``k``."""
    comm = [c for _, c in trace]
    tput = [TOKENS / s for s, _ in trace]
    return {
        "comm_degraded": _alarms(comm, POLICY.comm_rise, lambda a, b: a < b, rule, k),
        "throughput_drop": _alarms(tput, POLICY.throughput_drop, lambda a, b: a > b, rule, k),
    }


def _alarms(
    xs: Sequence[float],
    margin: float,
    better: Callable[[float, float], bool],
    rule: str,
    k: int,
) -> list[int]:
    warm, need = POLICY.warmup_windows, POLICY.consecutive
    base: float | None = None
    streak, open_, out = 0, False, []
    for i, x in enumerate(xs):
        if base is not None:
            bad = x > base * (1 + margin) if better(0, 1) else x < base * (1 - margin)
            streak = streak + 1 if bad else 0
            open_ = open_ and bad
            if streak >= need and not open_:
                open_ = True
                out.append(i)
        if i + 1 >= warm + k:
            m = statistics.median(xs[i + 1 - k : i + 1])
            if base is None or (rule == "best-median" and better(m, base)):
                base = m
    return out


def steady(rng: random.Random, n: int, sigma: float) -> Trace:
    return [(0.1 * (1 + rng.gauss(0, sigma)), 0.01 * (1 + rng.gauss(0, sigma))) for _ in range(n)]


def slow_start(rng: random.Random, slow: float, deg: float, sigma: float) -> Trace:
    worse = (1 / (1 - deg * POLICY.throughput_drop), 1 + deg * POLICY.comm_rise)
    levels = [(slow, slow)] * 6 + [(1.0, 1.0)] * 60 + [worse] * 10
    return [
        (0.1 * s * (1 + rng.gauss(0, sigma)), 0.01 * c * (1 + rng.gauss(0, sigma)))
        for s, c in levels
    ]


RULES: dict[str, Callable[[Trace], dict[str, list[int]]]] = {
    "first-median": lambda t: reference(t, "first-median", 3),
    "best-median": lambda t: reference(t, "best-median", POLICY.baseline_windows),
    "held": ours,
}


def rates(traces: list[Trace], after: int) -> dict[str, dict[str, float]]:
    """Per rule and kind: the share of traces with an alarm at window ``after`` or later."""
    out: dict[str, dict[str, float]] = {}
    for name, rule in RULES.items():
        hits = [rule(t) for t in traces]
        out[name] = {
            kind: round(sum(any(i >= after for i in h[kind]) for h in hits) / len(traces), 3)
            for kind in ("comm_degraded", "throughput_drop")
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--windows", type=int, default=1000, help="steady traces' length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/degrade-baseline-2026-12-06.json")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []
    for sigma in (0.01, 0.02, 0.03):
        traces = [steady(rng, args.windows, sigma) for _ in range(args.trials)]
        rows.append({"scenario": "steady", "sigma": sigma, "false_alarm": rates(traces, 0)})
    for slow in (1.0, 1.1, 1.5, 2.0):
        for deg in (1.2, 1.5):
            traces = [slow_start(rng, slow, deg, 0.02) for _ in range(args.trials)]
            rows.append(
                {
                    "scenario": "slow-start",
                    "slow": slow,
                    "deg": deg,
                    "sigma": 0.02,
                    "detected": rates(traces, 66),
                }
            )
    for r in rows:
        what = r.get("false_alarm") or r["detected"]
        label = f"{r['scenario']} sigma={r['sigma']:.0%}" + (
            f" slow={r['slow']}x deg={r['deg']}x" if "slow" in r else f" {args.windows} windows"
        )
        cells = "  ".join(
            f"{n}: comm {v['comm_degraded']:.3f} tput {v['throughput_drop']:.3f}"
            for n, v in what.items()
        )
        print(f"{label:36s} {cells}")
    Path(args.out).write_text(
        json.dumps({"trials": args.trials, "windows": args.windows, "rows": rows}, indent=1) + "\n"
    )
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
