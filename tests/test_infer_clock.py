"""The chunk loop's pass clock (infer/clock.py) and the pass counts it keeps in Stats."""

from __future__ import annotations

from shoestring.infer.clock import PassClock
from shoestring.infer.report import Stats


class _FakeTime:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_first_pass_of_a_chunk_is_its_prefill_and_the_rest_are_decode_passes() -> None:
    now = _FakeTime()
    clock, stats = PassClock(now), Stats()
    now.t += 3.0
    assert clock.end_pass(stats) == 3.0
    clock.start_pass()
    now.t += 0.5
    assert clock.end_pass(stats) == 0.5
    assert (stats.passes, stats.pass_s, stats.prefill_s) == (2, 3.5, 3.0)
    assert (stats.decode_passes, stats.decode_s, stats.chunk_pass) == (1, 0.5, 2)
    # A chunk resumed from a saved state after 4 passes: no prefill to count.
    stats.chunk_pass = 4
    clock.start_chunk()
    now.t += 1.0
    clock.end_pass(stats)
    assert (stats.passes, stats.prefill_s, stats.decode_passes) == (3, 3.0, 2)


def test_pass_time_is_measured_from_the_start_of_the_pass_not_the_last_save() -> None:
    now = _FakeTime()
    clock, stats = PassClock(now), Stats()
    now.t += 2.0
    clock.end_pass(stats)
    clock.saved()  # the save after the pass is not part of the next pass
    now.t += 5.0
    clock.start_pass()
    now.t += 1.0
    assert clock.end_pass(stats) == 1.0


def test_a_periodic_save_is_due_every_so_many_seconds_and_never_at_zero() -> None:
    now = _FakeTime()
    clock = PassClock(now)
    assert not clock.save_due(10.0)
    now.t += 9.9
    assert not clock.save_due(10.0)
    now.t += 0.1
    assert clock.save_due(10.0) and not clock.save_due(0.0)
    clock.saved()
    assert not clock.save_due(10.0)
    now.t += 10.0
    clock.start_chunk()  # a new chunk has nothing unsaved yet
    assert not clock.save_due(10.0)
    assert clock.save_due(1e-9) is False  # no time has passed at all
    now.t += 1e-6
    assert clock.save_due(1e-9)
