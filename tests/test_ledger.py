"""The cost ledger: device-hours, interruption overhead and money from the event log."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from conftest import CLI, FAST, read_events
from shoestring.gpus import CATALOG
from shoestring.report.html import render
from shoestring.report.ledger import compute, price_for, run_ledger
from shoestring.report.timeline import load


def write_events(run: Path, records: list[dict]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    with open(run / "events.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps({"v": 1, "run_id": "r1", "rank": 0, **r}) + "\n")


def test_ledger_of_a_preempted_and_killed_run_on_two_l4s(tmp_path: Path) -> None:
    start = {
        "event": "run_start",
        "world_size": 2,
        "device": "NVIDIA L4",
        "market": "spot",
        "usd_per_hour": 0.0,
    }
    step = lambda ts, n: {"event": "step", "ts": ts, "step": n, "step_ms": 1000.0}  # noqa: E731
    recs = [
        {**start, "ts": 0.0},
        step(10.0, 1),
        step(11.0, 2),
        {"event": "checkpoint", "ts": 11.5, "step": 2, "blocking_ms": 500.0},
        step(12.0, 3),
        {"event": "preempt", "ts": 13.0, "step": 3, "saved": True},
        # attempt 2: resumed with nothing lost after a notice, then killed without notice
        {"event": "resume", "ts": 100.0, "from_step": 3, "steps_lost": 0},
        {**start, "ts": 100.0},
        step(110.0, 4),
        step(111.0, 5),
        step(112.0, 6),
        # attempt 3: resumed from step 3: steps 4-6 are redone
        {"event": "resume", "ts": 200.0, "from_step": 3, "steps_lost": 3},
        {**start, "ts": 200.0},
        step(220.0, 4),
        step(221.0, 5),
        step(222.0, 6),
        {"event": "run_end", "ts": 222.0, "step": 6},
    ]
    write_events(tmp_path / "run", recs)
    led = compute(load(tmp_path / "run"))
    l4 = CATALOG["L4"]
    wall = 13.0 + 12.0 + 22.0  # each attempt from its first to its last record
    assert led.device == "L4" and led.devices == 2 and led.attempts == 3
    assert led.preemptions == 1 and led.failures == 1 and led.steps_recomputed == 3
    assert led.device_hours == pytest.approx(2 * wall / 3600)
    assert led.recompute_hours == pytest.approx(2 * 3 * 1.0 / 3600)
    assert led.restart_hours == pytest.approx(2 * (10.0 + 20.0) / 3600)  # start -> first step
    assert led.checkpoint_hours == pytest.approx(2 * 0.5 / 3600)
    assert led.usd == pytest.approx(2 * wall / 3600 * l4.spot_usd_h)
    useful = 2 * (wall - 3.0 - 30.0) / 3600
    assert led.on_demand_usd == pytest.approx(useful * l4.on_demand_usd_h)
    assert "1 preemption(s), 1 failure(s), 3 step(s) recomputed" in led.one_line()
    page = render(load(tmp_path / "run"))
    assert 'id="cost"' in page and f"${led.usd:,.2f}" in page


def supervised_history(run: Path, steps_per_attempt: int, pad: int = 0) -> None:
    """Two ranks, three supervised attempts (a preemption with notice, then a kill without
    notice that lost 3 steps), each rank's log rotated into segments mid-attempt, with
    ``metrics`` records of ``pad`` bytes between steps (the bulk of a real long log)."""
    logs: dict[int, list[dict]] = {0: [], 1: []}
    sup = lambda ts, ev, **kw: logs[0].append({"event": ev, "ts": ts, "rank": -1, **kw})  # noqa: E731
    ts, step = 0.0, 0
    for attempt in range(3):
        sup(ts, "attempt_start", attempt=attempt)
        for rank in (0, 1):
            logs[rank].append(
                {
                    "event": "run_start",
                    "ts": ts + 2,
                    "rank": rank,
                    "world_size": 2,
                    "device": "NVIDIA L4",
                    "market": "spot",
                }  # fmt: skip
            )
            if attempt:
                lost = 3 if attempt == 2 else 0
                logs[rank].append({"event": "resume", "ts": ts + 3, "rank": rank,
                                   "steps_lost": lost})  # fmt: skip
        step -= 3 if attempt == 2 else 0
        for i in range(steps_per_attempt):
            ts, step = ts + 1.0, step + 1
            for rank in (0, 1):
                logs[rank].append({"event": "step", "ts": ts + 5, "rank": rank, "step": step,
                                   "step_ms": 900.0 + (i % 7) * 20})  # fmt: skip
                logs[rank].append({"event": "metrics", "ts": ts + 5.5, "rank": rank,
                                   "host": {"load1": 1.0, "note": "x" * pad}})  # fmt: skip
            if i % 50 == 49:
                logs[0].append({"event": "checkpoint", "ts": ts + 5.6, "rank": 0,
                                "step": step, "blocking_ms": 40.0})  # fmt: skip
        ts += 10
        if attempt == 0:
            logs[0].append({"event": "preempt", "ts": ts, "rank": 0, "saved": True})
        sup(ts + 1, "attempt_end", attempt=attempt, exit_code=(75, -9, 0)[attempt])
        ts += 30
    for rank, recs in logs.items():
        d = run if rank == 0 else run / "ranks" / f"rank{rank}"
        d.mkdir(parents=True, exist_ok=True)
        third = len(recs) // 3
        for name, part in (
            ("events.1.jsonl", recs[:third]),
            ("events.2.jsonl", recs[third : 2 * third]),
            ("events.jsonl", recs[2 * third :]),
        ):
            (d / name).write_text(
                "".join(json.dumps({"v": 1, "run_id": "r", **r}) + "\n" for r in part)
            )


def test_end_of_run_ledger_streams_a_rotated_history(tmp_path: Path) -> None:
    """The end-of-run ledger (every attempt, every rank, every rotated segment) equals the
    one of the whole loaded timeline, and folds the logs one record at a time: its memory
    does not grow with the history (a week-long run's logs would not fit)."""
    small = tmp_path / "small"
    supervised_history(small, steps_per_attempt=120)
    fields, line = run_ledger(small)
    led = compute(load(small))
    assert fields == led.to_json() and line == led.one_line()
    assert led.attempts == 3 and led.preemptions == 1 and led.failures == 1
    assert led.steps_recomputed == 3 and led.devices == 2 and led.steps == 357

    big = tmp_path / "big"
    supervised_history(big, steps_per_attempt=2000, pad=1000)
    size = sum(p.stat().st_size for p in big.rglob("*.jsonl"))
    assert size > 12e6
    tracemalloc.start()
    try:
        fields, _ = run_ledger(big)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert fields["attempts"] == 3 and fields["steps"] == 3 * 2000 - 3
    assert peak < size / 20, f"ledger peak {peak / 1e6:.1f} MB for {size / 1e6:.1f} MB of logs"


def test_explicit_price_and_unknown_devices() -> None:
    assert price_for("cpu").usd_per_hour is None
    p = price_for("cpu", "on_demand", 1.25)
    assert p.usd_per_hour == 1.25 and p.on_demand_usd_per_hour == 1.25
    assert price_for("Tesla T4").device == "T4"


def test_finetune_ends_with_a_cost_line_and_event(cli: CLI, tmp_path: Path) -> None:
    out = tmp_path / "run"
    # Killed without notice while finishing step 7 (last logged: 6, last save: 4, committed
    # by then: ``saved``): the rerun redoes steps 5 and 6.
    env = {"SHOESTRING_FAULTS": "step.end@7:kill:saved"}
    r = cli.run(out, *FAST, "--cost.usd_per_hour", "0.75", env=env)
    assert r.returncode != 0
    r = cli.run(out, *FAST, "--cost.usd_per_hour", "0.75")
    assert r.returncode == 0, r.stderr[-2000:]
    (cost,) = [e for e in read_events(out) if e["event"] == "cost"]
    assert cost["failures"] == 1 and cost["steps_recomputed"] == 2 and cost["attempts"] == 2
    assert cost["usd"] == pytest.approx(cost["device_hours"] * 0.75, rel=1e-3)
    assert "1 failure(s), 2 step(s) recomputed" in r.stderr
