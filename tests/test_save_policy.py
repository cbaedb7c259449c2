"""The save policy on a fake clock: steps, seconds, the automatic interval, rank agreement."""

from __future__ import annotations

from shoestring.checkpoint.interval import daly_interval
from shoestring.train.config import CheckpointConfig
from shoestring.train.saves import SavePolicy


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_every_steps_only_at_multiples() -> None:
    p = SavePolicy.from_config(CheckpointConfig(every_steps=4), 0, clock=FakeClock())
    assert [s for s in range(1, 13) if p.due(s)] == [4, 8, 12]
    assert p.due(8) == "steps"


def test_every_seconds_counts_from_the_last_save() -> None:
    clock = FakeClock()
    p = SavePolicy.from_config(CheckpointConfig(every_steps=0, every_seconds=10.0), 0, clock=clock)
    clock.now += 9.9
    assert p.due(1) is None
    clock.now += 0.1
    assert p.due(2) == "seconds"
    p.saved(2, 0.01, background=True)
    clock.now += 5
    assert p.due(3) is None
    clock.now += 5
    assert p.due(4) == "seconds"


def test_seconds_follow_rank_zero_through_share() -> None:
    """A rank whose own clock says 'not yet' still saves when rank 0 says so."""
    clock = FakeClock()
    rank0_elapsed = [0.0]
    p = SavePolicy.from_config(
        CheckpointConfig(every_steps=0, every_seconds=10.0),
        0,
        clock=clock,
        share=lambda v: rank0_elapsed[0] if isinstance(v, float) else v,
    )
    rank0_elapsed[0] = 11.0
    assert p.due(1) == "seconds"  # this rank's clock has not moved
    rank0_elapsed[0] = 3.0
    clock.now += 100
    assert p.due(2) is None  # this rank's clock says yes, rank 0 says no


def test_auto_interval_plans_from_measured_step_and_save_cost() -> None:
    clock = FakeClock()
    c = CheckpointConfig(interval="auto", every_steps=5, mtbf_hours=20.0)
    p = SavePolicy.from_config(c, 10, clock=clock)
    assert [s for s in range(11, 20) if p.due(s)] == [15, 16, 17, 18, 19]  # first save timed
    for _ in range(5):
        p.observe_step(2.0)
        clock.now += 2.0
    event = p.saved(15, 0.5, background=True)
    assert event is not None and event["step"] == 15
    n = event["every_steps"]
    # Young/Daly with this save cost and prior MTBF, in 2 s steps.
    assert abs(n - daly_interval(0.5, 20 * 3600) / 2.0) <= 1
    assert p.next_auto_step == 15 + n
    assert p.due(15 + n - 1) is None and p.due(15 + n) == "auto"
    assert p.saved(15 + n, 0.5, background=True) is None  # same interval: no new event


def test_costlier_saves_get_a_longer_interval_and_sync_saves_do_not_replan() -> None:
    def interval(save_s: float) -> int:
        p = SavePolicy.from_config(
            CheckpointConfig(interval="auto", every_steps=5), 0, clock=FakeClock()
        )
        p.observe_step(1.0)
        event = p.saved(5, save_s, background=True)
        assert event is not None
        return int(event["every_steps"])

    assert interval(4.0) > interval(0.25)
    p = SavePolicy.from_config(
        CheckpointConfig(interval="auto", every_steps=5), 0, clock=FakeClock()
    )
    assert p.saved(5, 1.0, background=False) is None
    assert p.next_auto_step == 5  # an emergency/final save does not move the plan
