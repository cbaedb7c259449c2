"""Preemption: one flag, many sources (signals now; cloud notices plug in here)."""

from shoestring.preempt.flag import PreemptionFlag, SignalSource

__all__ = ["PreemptionFlag", "SignalSource"]
