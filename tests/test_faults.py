"""The fault plan hands its call sites typed actions (what to skip, add or slow down)."""

from __future__ import annotations

import pytest

from shoestring.checkpoint.faults import Delay, Extra, FaultPlan, Skip, Slow


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


@pytest.mark.parametrize("spec", ["step.nowhere", "step.end:explode", "step.end:kill:rankX"])
def test_bad_specs_are_refused_naming_the_part(spec: str) -> None:
    with pytest.raises(ValueError, match="SHOESTRING_FAULTS"):
        FaultPlan.parse(spec)
