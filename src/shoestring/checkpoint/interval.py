"""A checkpoint interval chosen from what saving costs and how often work is lost.

Too few checkpoints lose work at every unannounced failure; too many pay the
save cost for nothing. With a blocking cost ``δ`` per save and a mean time
``M`` between failures that lose work, the waste per unit of time is about
``δ/T + (T/2 + R)/M``; Young's first-order optimum is ``T = √(2δM)`` and
Daly's higher-order one (used here) is

    T = √(2δM) · [1 + ⅓·√(δ/2M) + (1/9)·(δ/2M)] − δ     for δ < 2M, else T = M.

``δ`` is measured (the training thread's blocking time of the last saves, so
an asynchronous writer earns a short interval). ``M`` starts from a prior
(``checkpoint.mtbf_hours``) and is updated by what the run has seen, with a
Gamma–Poisson estimate: one pseudo-failure over the prior's exposure, plus the
observed lossy failures over the observed hours,

    M̂ = (M₀ + hours observed) / (1 + failures observed).

Only failures that lose work count: a preemption with notice commits an
emergency checkpoint and loses nothing, whatever the interval.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass


def daly_interval(delta_s: float, mtbf_s: float) -> float:
    """Daly's optimum compute time between checkpoints, in seconds."""
    if delta_s <= 0:
        return 0.0
    if delta_s >= 2 * mtbf_s:
        return mtbf_s
    x = delta_s / (2 * mtbf_s)
    return math.sqrt(2 * delta_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - delta_s


@dataclass(frozen=True)
class IntervalPolicy:
    mtbf_hours: float = 20.0  # prior mean time between failures that lose work
    min_steps: int = 1
    max_steps: int = 1_000_000
    window: int = 5  # saves whose blocking time is averaged (median)


class AutoInterval:
    """Tracks δ, step time and failures; answers "how many steps until the next save".

    Pure bookkeeping with no clock of its own, so the training loop and the
    simulation benchmark drive the same object.
    """

    def __init__(
        self, policy: IntervalPolicy, *, failures: int = 0, hours_observed: float = 0.0
    ) -> None:
        self.policy = policy
        self.failures = failures
        self.hours_observed = hours_observed
        self._delta: deque[float] = deque(maxlen=policy.window)
        self._step_s: deque[float] = deque(maxlen=200)

    def observe_save(self, blocking_s: float) -> None:
        self._delta.append(max(blocking_s, 0.0))

    def observe_step(self, seconds: float) -> None:
        self._step_s.append(seconds)

    def observe_failure(self) -> None:
        self.failures += 1

    def observe_hours(self, hours: float) -> None:
        self.hours_observed += hours

    @property
    def mtbf_s(self) -> float:
        p = self.policy
        return 3600.0 * (p.mtbf_hours + self.hours_observed) / (1 + self.failures)

    @property
    def delta_s(self) -> float | None:
        return statistics.median(self._delta) if self._delta else None

    def interval_s(self) -> float | None:
        d = self.delta_s
        return None if d is None else daly_interval(d, self.mtbf_s)

    def interval_steps(self, fallback: int) -> int:
        """Steps between saves; ``fallback`` until a save and a step have been timed."""
        t = self.interval_s()
        if t is None or not self._step_s:
            return max(fallback, self.policy.min_steps)
        step = statistics.median(self._step_s)
        n = round(t / step) if step > 0 else self.policy.max_steps
        return int(min(max(n, self.policy.min_steps), self.policy.max_steps))

    def explain(self) -> dict[str, float | int | None]:
        t = self.interval_s()
        return {
            "delta_ms": None if self.delta_s is None else round(self.delta_s * 1e3, 3),
            "mtbf_s": round(self.mtbf_s, 3),
            "failures": self.failures,
            "hours_observed": round(self.hours_observed, 7),
            "interval_s": None if t is None else round(t, 3),
        }


def history_from_events(records: Iterable[dict[str, object]]) -> tuple[int, float]:
    """(failures that lost work, hours trained) of earlier attempts, from ``events.jsonl``.

    A failure that lost work is a ``resume`` with ``steps_lost > 0`` (a kill without
    notice); hours run from each ``run_start`` to the last record before the next one.
    """
    failures, hours = 0, 0.0
    start: float | None = None
    last: float | None = None
    for r in records:
        ts = r.get("ts")
        if not isinstance(ts, (int, float)) or r.get("rank", 0) not in (0, None):
            continue
        if r.get("event") == "run_start":
            if start is not None and last is not None:
                hours += (last - start) / 3600
            start = float(ts)
        elif r.get("event") == "resume" and int(r.get("steps_lost") or 0) > 0:  # type: ignore[call-overload]
            failures += 1
        last = float(ts)
    if start is not None and last is not None:
        hours += (last - start) / 3600
    return failures, hours
