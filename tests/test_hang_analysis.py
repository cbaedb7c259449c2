"""The hang rules on hand-made rank snapshots with a fake clock (no processes)."""

from __future__ import annotations

from typing import Any

import pytest

from shoestring.watch import HangPolicy, analyze

POLICY = HangPolicy(multiple=3.0, floor_s=10.0, first_timeout_s=300.0)
STEP_STATS = {
    "train_step": {"n": 50, "p50": 0.1, "p99": 0.2, "max": 0.3},
    "eval": {"n": 5, "p50": 20.0, "p99": 25.0, "max": 25.0},
    "checkpoint": {"n": 5, "p50": 3.0, "p99": 4.0, "max": 4.0},
}


def snap(
    rank: int,
    phase: str,
    since: float,
    *,
    seq: int,
    open_: dict[str, Any] | None = None,
    ts: float = 1000.0,
    stats: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "rank": rank,
        "world_size": 2,
        "pid": 100 + rank,
        "host": "h",
        "ts": ts,
        "status": "running",
        "step": 7,
        "phase": phase,
        "outer_phase": phase,
        "phase_start": since,
        "outer_start": since,
        "seq": seq,
        "open_collectives": [open_] if open_ else [],
        "recent_collectives": [],
        "stats": STEP_STATS if stats is None else stats,
    }


def coll(
    seq: int, op: str = "allreduce[ddp]", shapes: Any = ((278528,),), start: float = 0.0
) -> dict[str, Any]:
    return {
        "seq": seq,
        "op": op,
        "group": "default",
        "shapes": [list(s) for s in shapes],
        "dtype": "torch.float32",
        "start": start,
        "end": None,
    }


def test_rank_that_never_enters_the_collective_is_the_culprit() -> None:
    snaps = {
        0: snap(0, "train_step", 985.0, seq=412, open_=coll(412, start=986.0)),
        1: snap(1, "train_step", 985.0, seq=411),
    }
    v = analyze(snaps, now=1000.0, policy=POLICY, world_size=2)
    assert v is not None and v.kind == "stuck_rank" and v.culprits == [1]
    assert v.collective is not None and v.collective["seq"] == 412
    assert "never entered" in v.summary and "allreduce[ddp] #412" in v.summary


def test_within_budget_is_not_a_hang() -> None:
    snaps = {
        0: snap(0, "train_step", 995.0, seq=412, open_=coll(412, start=996.0)),
        1: snap(1, "train_step", 995.0, seq=411),
    }  # 5 s < max(3 x 0.2, 10)
    assert analyze(snaps, now=1000.0, policy=POLICY, world_size=2) is None


def test_rank0_only_eval_while_peers_wait_is_not_a_hang() -> None:
    # Rank 0 evaluates for 60 s (budget 3 x 25 s); rank 1 waits in the next all-reduce.
    snaps = {
        0: snap(0, "eval", 940.0, seq=411),
        1: snap(1, "train_step", 941.0, seq=412, open_=coll(412, start=941.0)),
    }
    assert analyze(snaps, now=1000.0, policy=POLICY, world_size=2) is None
    # ... but an eval beyond 3 x its own p99 is.
    for s in snaps.values():
        s["ts"] = 1016.0
    v = analyze(snaps, now=940.0 + 76.0, policy=POLICY, world_size=2)
    assert v is not None and v.culprits == [0]


def test_first_occurrence_of_a_phase_gets_the_first_timeout() -> None:
    snaps = {
        0: snap(0, "checkpoint", 900.0, seq=5, stats={}),
        1: snap(1, "checkpoint", 900.0, seq=5, stats={}),
    }
    assert analyze(snaps, now=1000.0, policy=POLICY, world_size=2) is None  # 100 s < 300 s
    for s in snaps.values():
        s["ts"] = 1201.0
    v = analyze(snaps, now=1201.0, policy=POLICY, world_size=2)
    assert v is not None and v.culprits == [0, 1]


def test_mismatched_collectives_at_the_same_sequence_number() -> None:
    snaps = {
        0: snap(
            0,
            "train_step",
            980.0,
            seq=412,
            open_=coll(412, op="all_reduce", shapes=((2,),), start=981.0),
        ),
        1: snap(1, "train_step", 980.0, seq=412, open_=coll(412, start=982.0)),
    }
    v = analyze(snaps, now=1000.0, policy=POLICY, world_size=2)
    assert v is not None and v.kind == "collective_mismatch"
    assert "rank 0: all_reduce #412" in v.summary and "rank 1: allreduce[ddp] #412" in v.summary


def test_everyone_in_the_same_collective_for_too_long() -> None:
    snaps = {r: snap(r, "train_step", 980.0, seq=9, open_=coll(9, start=985.0 + r)) for r in (0, 1)}
    assert analyze(snaps, now=990.0, policy=POLICY, world_size=2) is None
    v = analyze(snaps, now=1000.0, policy=POLICY, world_size=2)
    assert v is not None and v.kind == "collective_hang" and v.culprits == [0, 1]


def test_frozen_rank_is_stale_and_missing_ranks_mean_not_started() -> None:
    snaps = {
        0: snap(0, "train_step", 999.0, seq=3),
        1: snap(1, "train_step", 960.0, seq=3, ts=970.0),
    }
    v = analyze(snaps, now=1000.0, policy=POLICY, world_size=2)
    assert v is not None and v.kind == "stale" and v.culprits == [1]
    assert analyze({0: snaps[0]}, now=1000.0, policy=POLICY, world_size=2) is None


def _work(data: float, fwd: float, n: int = 30, tokens: int = 100) -> dict[str, list]:
    """Steps of ``tokens`` tokens whose work takes ``data`` and ``fwd`` seconds per token."""
    return {"data": [[data * tokens, tokens]] * n, "forward": [[fwd * tokens, tokens]] * n}


def test_straggler_is_named_with_its_slow_part() -> None:
    from shoestring.watch.straggler import StragglerPolicy, straggler

    pol = StragglerPolicy(threshold=0.10, window=30, min_steps=20)
    snaps = {
        0: {"work": _work(7e-6, 600e-6)},
        1: {"work": _work(7e-6, 680e-6)},
        2: {"work": _work(7e-6, 610e-6)},
    }
    found = straggler(snaps, pol)
    assert found is not None and found["rank"] == 1 and found["part"] == "forward"
    assert abs(found["slower_by"] - (687 / 612 - 1)) < 1e-3  # peers: median of 607 and 617
    assert found["ms_per_step"]["1"]["forward"] == pytest.approx(68.0)
    # 5 % slower is within the threshold; a noisy but negligible part never decides.
    snaps[1] = {"work": _work(9e-6, 630e-6)}
    assert straggler(snaps, pol) is None
    # Too few steps yet: no judgement.
    snaps[1] = {"work": _work(7e-6, 900e-6, n=10)}
    assert straggler(snaps, pol) is None


def test_straggler_speed_is_a_lower_quartile_so_contention_spikes_do_not_count() -> None:
    from shoestring.watch.straggler import StragglerPolicy, straggler

    pol = StragglerPolicy(threshold=0.10, window=30, min_steps=20)
    # Rank 1 is as fast as rank 0 but a neighbour steals its CPU on 60 % of its steps
    # (+50 %): its median moves, its fast steps do not.
    spiky = [[0.06 * (1.5 if i % 5 in (1, 2, 3) else 1.0), 100] for i in range(30)]
    snaps = {
        0: {"work": _work(7e-6, 600e-6)},
        1: {"work": {"data": [[7e-4, 100]] * 30, "forward": spiky}},
    }
    assert straggler(snaps, pol) is None
    # A device 20 % slower on every step is still one.
    snaps[1] = {"work": {"data": [[7e-4, 100]] * 30, "forward": [[s * 1.2, t] for s, t in spiky]}}
    found = straggler(snaps, pol)
    assert found is not None and found["rank"] == 1 and found["slower_by"] > 0.15


def test_straggler_compares_ranks_at_the_same_batch_size() -> None:
    from shoestring.watch.straggler import StragglerPolicy, straggler

    pol = StragglerPolicy(threshold=0.10, window=30, min_steps=20)

    def steps(sizes: list[int], fixed: float, per_token: float, slow: float = 1.0) -> dict:
        return {
            "data": [[1e-4, t] for t in sizes],
            "forward": [[(fixed + per_token * t) * slow, t] for t in sizes],
        }

    # A step's forward has a fixed cost (50 ms) besides 0.1 ms per token; rank 1 happens
    # to get shorter batches. Per token it would look 25-30 % slower; it is not slower.
    long = [70 + (7 * i) % 21 for i in range(30)]
    short = [50 + (5 * i) % 21 for i in range(30)]
    snaps = {0: {"work": steps(long, 0.05, 1e-4)}, 1: {"work": steps(short, 0.05, 1e-4)}}
    assert straggler(snaps, pol) is None
    # A forward whose time does not depend on the batch size at all: not slower either.
    snaps = {0: {"work": steps(long, 0.05, 0.0)}, 1: {"work": steps(short, 0.05, 0.0)}}
    assert straggler(snaps, pol) is None
    # The same rank 12 % slower on every step is one, by how much it is slower.
    snaps = {0: {"work": steps(long, 0.05, 1e-4)}, 1: {"work": steps(short, 0.05, 1e-4, slow=1.12)}}
    found = straggler(snaps, pol)
    assert found is not None and found["rank"] == 1 and found["part"] == "forward"
    assert found["slower_by"] == pytest.approx(0.12, abs=0.01)


def test_straggler_is_reported_once_after_it_stays_slow() -> None:
    from shoestring.watch.straggler import StragglerPolicy, StragglerWatch

    def snaps(n: int, slow: range) -> dict[int, dict]:
        """Steps 1..n of two ranks; rank 1's forward is 20 % slower on the steps in ``slow``."""

        def work(r: int) -> dict[str, list]:
            fwd = [[0.06 * (1.2 if r == 1 and s in slow else 1.0), 100, s] for s in range(1, n + 1)]
            return {"data": [[7e-4, 100, s] for s in range(1, n + 1)], "forward": fwd}

        return {r: {"step": n, "work": work(r)} for r in (0, 1)}

    # Slower for 10 steps in the middle of the run: a burst, never an alarm (a quarter of
    # the window stays fast, and the alarm needs 10 steps of verdicts in a row).
    burst = StragglerWatch(StragglerPolicy(confirm_steps=10))
    assert all(burst.observe(snaps(n, range(21, 31))) is None for n in range(20, 61))
    # Slower from the first step: judged from step 20 (min_steps), reported once it has
    # been the verdict for 10 steps — from one snapshot, however rarely polled.
    watch = StragglerWatch(StragglerPolicy(confirm_steps=10))
    assert watch.observe(snaps(28, range(1, 99))) is None
    found = watch.observe(snaps(29, range(1, 99)))
    assert found is not None and found["rank"] == 1 and found["part"] == "forward"
    assert found["step"] == 29 and found["slower_since_step"] == 20
    assert watch.observe(snaps(30, range(1, 99))) is None  # once per rank and part
    late = StragglerWatch(StragglerPolicy(confirm_steps=10))  # first poll at step 45
    assert late.observe(snaps(45, range(1, 99)))["slower_since_step"] == 20  # type: ignore
    # Slow from step 15 on, polled every step: one report, 9 steps after the verdict began
    # (the lower quartile turns once most of the 30-step window is slow).
    onset = StragglerWatch(StragglerPolicy(confirm_steps=10))
    reports = [f for n in range(20, 90) if (f := onset.observe(snaps(n, range(15, 99))))]
    assert len(reports) == 1 and reports[0]["step"] - reports[0]["slower_since_step"] == 9
    assert reports[0]["slower_since_step"] > 15


def test_ranks_that_never_start_are_named_after_the_first_phase_timeout() -> None:
    from shoestring.watch.hang import not_started

    pol = HangPolicy(first_timeout_s=60.0)
    starting = {
        "rank": 0,
        "world_size": 3,
        "pid": 1,
        "host": "h",
        "ts": 1000.0,
        "status": "starting",
        "step": 0,
        "phase": "start",
        "seq": 0,
    }
    snaps = {0: starting, 2: dict(starting, rank=2)}
    # Within the timeout: no verdict; after it, the rank that never announced itself.
    assert not_started(snaps, now=1050.0, policy=pol, world_size=3, since=1000.0) is None
    v = not_started(snaps, now=1061.0, policy=pol, world_size=3, since=1000.0)
    assert v is not None and v.kind == "not_started" and v.culprits == [1]
    assert "rank(s) [1] never started" in v.summary and "[0, 2] wait" in v.summary
    # Everyone arrived but nobody got past forming the group: all of them.
    snaps[1] = dict(starting, rank=1)
    v = not_started(snaps, now=1061.0, policy=pol, world_size=3, since=1000.0)
    assert v is not None and v.culprits == [0, 1, 2]
    # Training ranks, or a command that publishes nothing: not judged.
    running = {r: dict(starting, rank=r, status="running") for r in range(3)}
    assert not_started(running, now=5000.0, policy=pol, world_size=3, since=1000.0) is None
    assert not_started({}, now=5000.0, policy=pol, world_size=3, since=1000.0) is None


def test_a_straggler_confirmed_as_the_run_ends_is_still_reported(tmp_path: Any) -> None:
    """A short run can finish between two polls right after its straggler is confirmed:
    the watchdog judges the snapshots the ranks published as they finished."""
    import json
    import time

    from shoestring.watch.recorder import LIVE
    from shoestring.watch.watchdog import Watchdog

    alarms: list[tuple[str, dict[str, Any]]] = []
    wd = Watchdog(
        tmp_path,
        POLICY,
        on_hang=lambda v: None,
        on_alarm=lambda kind, f: alarms.append((kind, f)),
        poll_s=3600.0,
    )

    def publish(status: str, slow: float) -> None:
        for r in (0, 1):
            fwd = [[0.06 * (slow if r == 1 else 1.0), 100, s] for s in range(1, 51)]
            snap = {
                "rank": r,
                "world_size": 2,
                "pid": 1,
                "host": "h",
                "ts": time.time(),
                "status": status,
                "step": 50,
                "work": {"data": [[7e-4, 100, s] for s in range(1, 51)], "forward": fwd},
            }
            d = tmp_path / "ranks" / f"rank{r}"
            d.mkdir(parents=True, exist_ok=True)
            (d / LIVE).write_text(json.dumps(snap))

    with wd:  # never polled while running (poll_s is an hour)
        publish("done", 1.2)
    assert [(k, f["rank"], f["part"], f["step"]) for k, f in alarms] == [
        ("straggler", 1, "forward", 50)
    ]
    alarms.clear()
    with Watchdog(
        tmp_path,
        POLICY,
        on_hang=lambda v: None,
        poll_s=3600.0,
        on_alarm=lambda kind, f: alarms.append((kind, f)),
    ):
        publish("failed", 1.2)  # not a clean finish: no last look
    with Watchdog(
        tmp_path,
        POLICY,
        on_hang=lambda v: None,
        poll_s=3600.0,
        on_alarm=lambda kind, f: alarms.append((kind, f)),
    ):
        publish("done", 1.0)  # healthy
    assert alarms == []
