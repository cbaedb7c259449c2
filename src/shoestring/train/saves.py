"""When to save: every N steps, every T seconds, or the automatic (Young/Daly) interval.

A pure policy object: time comes from an injected clock and, in a distributed run,
every decision that depends on time goes through an injected ``share`` function
(rank 0's value broadcast to all ranks), so ranks always agree without the policy
knowing about process groups. Unit-tested with a fake clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from shoestring.checkpoint.interval import AutoInterval, IntervalPolicy
from shoestring.train.config import CheckpointConfig

SaveReason = Literal["steps", "seconds", "auto"]
Clock = Callable[[], float]


def _same(x: Any) -> Any:
    return x


@dataclass
class SavePolicy:
    """Decides after each step whether to save, and learns from each save."""

    every_steps: int
    every_seconds: float = 0.0
    auto: AutoInterval | None = None
    clock: Clock = time.monotonic
    share: Callable[[Any], Any] = _same  # rank 0's value on every rank
    last_save: float = 0.0
    next_auto_step: int = 0
    _auto_clock: float = 0.0
    _auto_last: int = -1

    @classmethod
    def from_config(
        cls,
        c: CheckpointConfig,
        step: int,
        *,
        failures: int = 0,
        hours_observed: float = 0.0,
        clock: Clock = time.monotonic,
        share: Callable[[Any], Any] = _same,
    ) -> SavePolicy:
        """The policy at ``step`` (a resume point or 0); ``failures``/``hours_observed``
        are this run's history (interval 'auto' only)."""
        auto = None
        if c.interval == "auto":
            auto = AutoInterval(
                IntervalPolicy(mtbf_hours=c.mtbf_hours),
                failures=failures,
                hours_observed=hours_observed,
            )
        now = clock()
        # interval 'auto': the first save comes after every_steps (or 100) and times a save.
        return cls(
            c.every_steps,
            c.every_seconds,
            auto,
            clock,
            share,
            last_save=now,
            next_auto_step=step + (c.every_steps or 100),
            _auto_clock=now,
        )

    def observe_step(self, seconds: float) -> None:
        if self.auto is not None:
            self.auto.observe_step(seconds)

    def due(self, step: int) -> SaveReason | None:
        """Why to save after ``step``, or None. Same answer on every rank."""
        if self.auto is not None:
            if step >= self.next_auto_step:
                return "auto"
        elif self.every_steps and step % self.every_steps == 0:
            return "steps"
        if self.every_seconds and self.share(self.clock() - self.last_save) >= self.every_seconds:
            return "seconds"
        return None

    def saved(self, step: int, blocking_s: float, *, background: bool) -> dict[str, Any] | None:
        """Record a save at ``step`` that blocked training ``blocking_s``. With interval
        'auto' a background save re-plans the next one; returns the ``interval`` event
        fields when the interval changed (on rank 0; None elsewhere and otherwise)."""
        self.last_save = self.clock()
        if self.auto is None or not background:
            return None
        self.auto.observe_save(blocking_s)
        now = self.clock()
        self.auto.observe_hours((now - self._auto_clock) / 3600)
        self._auto_clock = now
        n = self.auto.interval_steps(self.every_steps or 100)
        self.next_auto_step = int(self.share(step + n))
        if n == self._auto_last:
            return None
        self._auto_last = n
        return {"step": step, "every_steps": n, **self.auto.explain()}
