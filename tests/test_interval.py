"""checkpoint.interval auto: Young/Daly from the measured save cost and the failures seen."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from conftest import CLI, FAST, read_events
from shoestring.checkpoint.interval import (
    AutoInterval,
    IntervalPolicy,
    daly_interval,
    history_from_events,
)


def test_daly_is_young_plus_small_corrections_and_minimises_waste() -> None:
    delta, m = 2.0, 4 * 3600.0
    t = daly_interval(delta, m)
    assert t == pytest.approx(math.sqrt(2 * delta * m), rel=0.02)

    def waste(T: float) -> float:  # first-order expected waste per unit of compute
        return delta / T + (T + delta) / (2 * m)

    assert waste(t) <= min(waste(t * f) for f in (0.5, 0.8, 0.9, 1.1, 1.25, 2.0))
    assert daly_interval(10.0, 4.0) == 4.0  # save slower than the failures: cap at M
    assert daly_interval(0.0, m) == 0.0


def test_auto_interval_learns_from_saves_steps_and_failures() -> None:
    a = AutoInterval(IntervalPolicy(mtbf_hours=20.0))
    assert a.interval_steps(fallback=100) == 100  # nothing timed yet
    a.observe_step(2.0)
    a.observe_save(0.5)
    first = a.interval_steps(100)
    assert first == round(daly_interval(0.5, 20 * 3600) / 2.0)
    for _ in range(8):  # 8 failures in 16 hours: the MTBF estimate drops from 20 h
        a.observe_failure()
    a.observe_hours(16)
    assert a.mtbf_s == pytest.approx(3600 * (20 + 16) / 9)
    assert a.interval_steps(100) < first * 0.5
    a.observe_save(8.0)  # a slow save (median of the window still counts the fast one)
    a.observe_save(8.0)
    assert a.delta_s == 8.0 and a.interval_steps(100) > first * 0.5


def test_history_counts_lossy_resumes_and_attempt_hours() -> None:
    ev = [
        {"event": "run_start", "ts": 0.0, "rank": 0},
        {"event": "step", "ts": 3600.0, "rank": 0},
        {"event": "resume", "ts": 4000.0, "rank": 0, "steps_lost": 3},  # killed, no notice
        {"event": "run_start", "ts": 4001.0, "rank": 0},
        {"event": "step", "ts": 4001.0 + 1800, "rank": 0},
        {"event": "resume", "ts": 9000.0, "rank": 0, "steps_lost": 0},  # preempted w/ notice
        {"event": "run_start", "ts": 9000.0, "rank": 0},
        {"event": "step", "ts": 9000.0 + 360, "rank": 0},
        {"event": "step", "ts": 1e9, "rank": 1},
    ]  # other ranks' clocks do not count
    failures, hours = history_from_events(ev)
    assert failures == 1
    # Each attempt runs from its run_start to its last record: 4000 s + 4999 s + 360 s.
    assert hours == pytest.approx((4000 + 4999 + 360) / 3600)


def test_finetune_with_auto_interval_saves_at_the_chosen_steps(cli: CLI, tmp_path: Path) -> None:
    out = tmp_path / "run"
    # MTBF of 1.8 s: Daly says save every few steps; the first save (step 5) times δ.
    r = cli.run(
        out,
        *FAST,
        "--train.max_steps",
        "40",
        "--checkpoint.interval",
        "auto",
        "--checkpoint.mtbf_hours",
        "0.0005",
        "--checkpoint.every_steps",
        "5",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    ev = read_events(out)
    intervals = {e["step"]: e for e in ev if e["event"] == "interval"}
    assert 5 in intervals
    for iv in intervals.values():
        # MTBF: the 1.8 s prior plus the seconds trained so far (no failure seen).
        assert iv["every_steps"] >= 1 and iv["failures"] == 0
        assert iv["mtbf_s"] == pytest.approx(1.8 + 3600 * iv["hours_observed"], abs=2e-3)
        assert iv["interval_s"] == pytest.approx(
            daly_interval(iv["delta_ms"] / 1e3, iv["mtbf_s"]), rel=0.01, abs=1e-3
        )
    saves = [e["step"] for e in ev if e["event"] == "checkpoint" and e["reason"] == "auto"]
    assert saves[0] == 5 and len(saves) >= 2
    every = None
    for a, b in zip(saves, saves[1:]):
        every = intervals[a]["every_steps"] if a in intervals else every
        assert b - a == every
