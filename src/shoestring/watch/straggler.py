"""Straggler detection: a rank whose own work is slower than its peers'.

Step times cannot tell: in synchronous data parallelism every rank's step takes
as long as the slowest one, because the fast ranks wait in the gradient
all-reduce. So each rank reports, per step, the time of work that contains no
collective — building the batch (``data``) and the forward passes
(``forward``; with DDP's per-forward buffer sync off they contain no
communication) — normalised per padded token, since ranks get batches of
different lengths.

A rank's speed is the *lower quartile* of its last ``window`` steps, not the
median: contention from other processes (a checkpoint writer, a neighbour's
job, the OS) only ever adds time, so it moves a rank's median and tail but
much less its fast steps, while a slow device or a throttled clock slows every
step. A rank is a straggler when that figure exceeds the median of the other
ranks' by more than ``threshold``, and :class:`StragglerWatch` reports it only
once it has stayed so for ``confirm_steps`` steps, so a burst of contention
lasting a few steps is not an alarm.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

PARTS = ("data", "forward")


@dataclass(frozen=True)
class StragglerPolicy:
    threshold: float = 0.10
    """A rank is slower when its work per token exceeds its peers' by more than this."""
    window: int = 30
    """Steps per rank the judgement looks at (the latest ones)."""
    min_steps: int = 20
    """No judgement before every rank has this many steps."""
    confirm_steps: int = 10
    """A rank must stay slower for this many steps before it is reported."""


def _lower_quartile(xs: Sequence[float]) -> float:
    return statistics.quantiles(xs, n=4, method="inclusive")[0]


def straggler(snaps: Mapping[int, Mapping[str, Any]], policy: StragglerPolicy
              ) -> dict[str, Any] | None:
    """``{"rank", "part", "slower_by", ...}`` for the slowest straggler now, or None.

    A rank is slower when its total collective-free work per token (the sum of the
    parts' lower quartiles) exceeds the median of the other ranks' totals by more than
    ``threshold``; the part named is the one with the largest absolute excess, so a
    noisy but negligible part (batch building is microseconds) never decides.
    """
    if len(snaps) < 2:
        return None
    speed: dict[int, dict[str, float]] = {}
    for r, s in snaps.items():
        work = s.get("work") or {}
        speed[r] = {}
        for part in PARTS:
            xs = work.get(part) or []
            if len(xs) < policy.min_steps:
                return None
            speed[r][part] = _lower_quartile(xs[-policy.window:])
    total = {r: sum(m.values()) for r, m in speed.items()}
    worst: dict[str, Any] | None = None
    for r, t in total.items():
        peers = [q for q in total if q != r]
        ref = statistics.median(total[q] for q in peers)
        if ref <= 0 or t / ref - 1.0 <= policy.threshold:
            continue
        excess = t / ref - 1.0
        if worst is None or excess > worst["slower_by"]:
            part = max(PARTS, key=lambda p: speed[r][p]
                       - statistics.median(speed[q][p] for q in peers))
            worst = {"rank": r, "part": part, "slower_by": round(excess, 4),
                     "us_per_token": {str(q): {p: round(v * 1e6, 3) for p, v in m.items()}
                                      for q, m in sorted(speed.items())}}
    return worst


@dataclass
class StragglerWatch:
    """Turns successive judgements into alarms: one per rank and part, once confirmed.

    ``observe`` is called on every poll with the running ranks' snapshots (which
    carry ``step``); it returns the alarm fields the first time a rank has been the
    straggler for ``policy.confirm_steps`` steps in a row, else None.
    """

    policy: StragglerPolicy = StragglerPolicy()
    _suspect: dict[int, int] = field(default_factory=dict)  # rank -> first step it was slower
    _reported: set[tuple[int, str]] = field(default_factory=set)

    def observe(self, snaps: Mapping[int, Mapping[str, Any]]) -> dict[str, Any] | None:
        found = straggler(snaps, self.policy)
        if found is None:
            self._suspect.clear()
            return None
        rank = found["rank"]
        step = int(snaps[rank].get("step") or 0)
        since = self._suspect.get(rank, step)
        self._suspect = {rank: since}
        if step - since < self.policy.confirm_steps or (rank, found["part"]) in self._reported:
            return None
        self._reported.add((rank, found["part"]))
        found["step"], found["slower_since_step"] = step, since
        return found
