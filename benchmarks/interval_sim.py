"""Checkpoint interval policies on simulated preemption traces: realized waste.

A job needs ``--hours`` of compute in steps of ``--step-s`` seconds. Machines
fail without notice (the lossy case: work since the last checkpoint is lost,
then ``--restart-s`` to come back) with lifetimes drawn from three hazard
models, all with the same mean ``--mtbf-h``:

* poisson  — constant hazard (exponential lifetimes);
* weibull  — shape 0.7: most failures early in a machine's life;
* bathtub  — high hazard in the first hour, low in the middle, rising towards
  the 24 h limit of preemptible VMs (the shape reported for GCP), scaled to the
  same mean.

Each save blocks training for ``δ`` seconds (two scenarios: our asynchronous
writer's measured blocking time and a synchronous save). Waste = (wall time −
useful compute) / useful compute. Policies, on the *same* traces:

* fixed N steps for N on a geometric grid — the best one is the oracle;
* fixed 500 steps (a common default);
* ``auto``: :class:`shoestring.checkpoint.interval.AutoInterval` — the object the
  training loop uses with ``checkpoint.interval: auto`` — starting from a prior
  MTBF of ``--prior-h`` hours (deliberately wrong by default) and learning from
  the saves and failures it sees.

Usage (repo root)::

    .venv/bin/python benchmarks/interval_sim.py            # the table in benchmarks/README.md
    .venv/bin/python benchmarks/interval_sim.py --seeds 50 --hours 24
"""

from __future__ import annotations

import argparse
import functools
import math
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from shoestring.checkpoint.interval import AutoInterval, IntervalPolicy  # noqa: E402

H = 3600.0


def lifetimes(model: str, mtbf_s: float, rng: random.Random, total_s: float) -> list[float]:
    """Machine lifetimes (seconds) until their sum covers ``total_s`` several times over."""
    out: list[float] = []
    if model == "poisson":
        draw: Callable[[], float] = functools.partial(rng.expovariate, 1 / mtbf_s)
    elif model == "weibull":
        k = 0.7
        scale = mtbf_s / math.gamma(1 + 1 / k)
        draw = functools.partial(rng.weibullvariate, scale, k)
    elif model == "bathtub":
        draw = _bathtub(mtbf_s, rng)
    else:
        raise ValueError(model)
    while sum(out) < 4 * total_s:
        out.append(draw())
    return out


def _bathtub(mtbf_s: float, rng: random.Random) -> Callable[[], float]:
    """Lewis–Shedler thinning of h(t) = a·e^(−t/0.5h) + b + c·e^((t−24h)/2h), scaled so the
    mean lifetime is ``mtbf_s`` (scale found once by simulation)."""

    def hazard(t_h: float) -> float:  # per hour, unscaled
        return 1.2 * math.exp(-t_h / 0.5) + 0.05 + 0.8 * math.exp((t_h - 24) / 2)

    def sample(scale: float, r: random.Random) -> float:
        t, hmax = 0.0, 0.0
        while True:
            hmax = scale * max(hazard(t), hazard(t + 2.0))  # hazard is convex: bound on [t, t+2]
            t_next = t + r.expovariate(hmax)
            if t_next > t + 2.0:
                t += 2.0
                continue
            t = t_next
            if r.random() * hmax <= scale * hazard(t):
                return t * H

    probe = random.Random(12345)
    lo, hi = 1e-3, 1e3  # bisect the scale so that the mean matches
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        mean = statistics.fmean(sample(mid, probe) for _ in range(400))
        lo, hi = (lo, mid) if mean < mtbf_s else (mid, hi)
    scale = math.sqrt(lo * hi)
    return lambda: sample(scale, rng)


def simulate(
    life: list[float],
    work_steps: int,
    step_s: float,
    delta_s: float,
    restart_s: float,
    next_interval: Callable[[], int],
    on_save: Callable[[], None],
    on_failure: Callable[[float], None],
) -> float:
    """Run the job over the machine lifetimes ``life``; return the waste fraction."""
    done, wall, i = 0, 0.0, 0
    age, left = 0.0, life[0]
    while done < work_steps:
        n = min(next_interval(), work_steps - done)
        seg = n * step_s + delta_s
        if seg <= left:  # the steps and the save that commits them complete
            left -= seg
            age += seg
            wall += seg
            done += n
            on_save()
            continue
        wall += left + restart_s  # failure: the segment is lost, restart on a new machine
        on_failure(age + left)
        i += 1
        if i >= len(life):
            raise RuntimeError("trace too short")
        age, left = 0.0, life[i]
    useful = work_steps * step_s
    return (wall - useful) / useful


def fixed(n: int) -> tuple[Callable[[], int], Callable[[], None], Callable[[float], None]]:
    return (lambda: n), (lambda: None), (lambda _age: None)


def auto(
    step_s: float, delta_s: float, prior_h: float, first: int
) -> tuple[Callable[[], int], Callable[[], None], Callable[[float], None]]:
    a = AutoInterval(IntervalPolicy(mtbf_hours=prior_h))
    a.observe_step(step_s)
    last = {"n": first}

    def nxt() -> int:
        last["n"] = a.interval_steps(first)
        return last["n"]

    def saved() -> None:
        a.observe_save(delta_s)
        a.observe_hours((last["n"] * step_s + delta_s) / H)

    def failed(age_s: float) -> None:
        a.observe_failure()

    return nxt, saved, failed


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--hours", type=float, default=48.0, help="useful compute of the job")
    ap.add_argument("--step-s", type=float, default=2.0)
    ap.add_argument("--mtbf-h", type=float, default=4.0, help="true mean lifetime")
    ap.add_argument("--prior-h", type=float, default=20.0, help="auto's starting belief")
    ap.add_argument("--restart-s", type=float, default=120.0)
    ap.add_argument(
        "--async-delta-s",
        type=float,
        default=0.3,
        help="blocking time per save of the async writer",
    )
    ap.add_argument(
        "--sync-delta-s", type=float, default=8.0, help="blocking time per synchronous save"
    )
    ap.add_argument("--seeds", type=int, default=100)
    a = ap.parse_args()
    work = int(a.hours * H / a.step_s)
    grid = sorted({int(round(10 * 1.5**k)) for k in range(16)})
    print(
        f"job {a.hours:g} h of compute ({work:,} steps of {a.step_s:g} s), lossy failures "
        f"with mean {a.mtbf_h:g} h, restart {a.restart_s:g} s, auto's prior {a.prior_h:g} h, "
        f"{a.seeds} traces per model\n"
    )
    print(
        "| trace | δ per save | auto | best fixed (N) | fixed 500 | auto / best | "
        "fixed 500 / auto |"
    )
    print("|---|---|---|---|---|---|---|")
    for model in ("poisson", "weibull", "bathtub"):
        traces = [
            lifetimes(model, a.mtbf_h * H, random.Random(1000 * s + 7), a.hours * H * 3)
            for s in range(a.seeds)
        ]
        for label, delta in (("async", a.async_delta_s), ("sync", a.sync_delta_s)):

            def mean_waste(make: Callable[[], tuple], traces=traces, delta=delta) -> float:
                ws = []
                for life in traces:
                    nxt, saved, failed = make()
                    ws.append(
                        simulate(life, work, a.step_s, delta, a.restart_s, nxt, saved, failed)
                    )
                return statistics.fmean(ws)

            by_n = {n: mean_waste(lambda n=n: fixed(n)) for n in grid}
            best_n = min(by_n, key=by_n.__getitem__)
            w500 = mean_waste(lambda: fixed(500))
            wauto = mean_waste(lambda delta=delta: auto(a.step_s, delta, a.prior_h, 500))
            print(
                f"| {model} | {label} {delta:g} s | {100 * wauto:.2f} % | "
                f"{100 * by_n[best_n]:.2f} % ({best_n}) | {100 * w500:.2f} % | "
                f"{wauto / by_n[best_n]:.3f} | {w500 / wauto:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
