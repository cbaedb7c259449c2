"""The fault plan hands its call sites typed actions (what to skip, add or slow down)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoestring.checkpoint.faults import SAVE_THREADS, Delay, Extra, FaultPlan, Skip, Slow


def test_hits_return_typed_actions_from_their_nth_hit() -> None:
    plan = FaultPlan.parse("step.forward@2:slow50,comm.ddp@1:delay20,step.agree@2:skip")
    assert [plan.hit("step.forward") for _ in range(3)] == [None, Slow(50), Slow(50)]
    assert plan.hit("comm.ddp") == Delay(20)
    assert [plan.hit("step.agree") for _ in range(3)] == [None, Skip(), None]
    assert FaultPlan.parse("step.agree:extra").hit("step.agree") == Extra()
    assert plan.hit("step.end") is None


def test_a_rule_for_another_rank_is_not_this_processes() -> None:
    plan = FaultPlan.parse("step.agree@1:skip:rank1", rank=0)
    assert plan.hit("step.agree") is None


@pytest.mark.parametrize(
    "spec", ["step.nowhere", "step.end:explode", "step.end:kill:rankX", "step.end:kill:safe"]
)
def test_bad_specs_are_refused_naming_the_part(spec: str) -> None:
    with pytest.raises(ValueError, match="SHOESTRING_FAULTS"):
        FaultPlan.parse(spec)


def test_a_saved_rule_fires_only_once_the_save_in_flight_committed(tmp_path: Path) -> None:
    """``saved``: a fault at a step's end lands after the background save before it."""
    import torch

    from shoestring.checkpoint import FileWriter, SaveRequest, make_snapshot
    from shoestring.checkpoint.local import committed_steps
    from shoestring.checkpoint.sharded import ShardedWriter
    from shoestring.events import EventLog

    # The writers' threads are the ones it waits for.
    assert all(f"{w.thread_name}-4".startswith(SAVE_THREADS) for w in (FileWriter, ShardedWriter))
    plan = FaultPlan.parse("step.end@1:enospc:saved")
    w = FileWriter(
        tmp_path / "ck", keep=2, mode="thread", events=EventLog(tmp_path / "ev.jsonl", run_id="t")
    )
    try:  # 16 MB: written, hashed and fsynced in the background for far longer than a hit
        snap = make_snapshot(4, {"w.safetensors": {"w": torch.ones(1 << 22)}}, {}, {})
        w.submit(SaveRequest.files(snap), reason="steps")
        with pytest.raises(OSError, match="fault step.end"):
            plan.hit("step.end")
        assert committed_steps(tmp_path / "ck") == [4]
    finally:
        w.close()
