"""Straggler detection: a rank whose own work is slower than its peers'.

Step times cannot tell: in synchronous data parallelism every rank's step takes
as long as the slowest one, because the fast ranks wait in the gradient
all-reduce. So each rank reports, per step, the time of work that contains no
collective — building the batch (``data``) and the forward passes
(``forward``; with DDP's per-forward buffer sync off they contain no
communication) — with the padded tokens it covered, since ranks get batches of
different sizes.

Dividing by the token count is not enough: a step also has a fixed cost (Python,
kernel launches, small matrices that do not fill the device), so per-token time
makes the rank that happened to get the shorter batches look slower — on a small
model measured at 10 % with identical ranks. Instead every step is brought to the
same batch size (the ranks' mean) along a cost per token ``b`` that all ranks
share, estimated from how each rank's own step times vary with its batch size (a
within-rank regression, so a rank that is slower *and* got other batch sizes does
not bend it): ``seconds + b · (mean tokens − tokens)``.

A rank's figure is the *lower quartile* of those times over its last ``window``
steps, not the median: contention from other processes (a checkpoint writer, a
neighbour's job, the OS) only ever adds time, so it moves a rank's median and tail
but much less its fast steps, while a slow device or a throttled clock slows every
step. A rank is a straggler when its expected work per step exceeds the median of
the other ranks' by more than ``threshold``, and :class:`StragglerWatch` reports it
only once it has stayed so for ``confirm_steps`` steps, so a burst of contention
lasting a few steps is not an alarm.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PARTS = ("data", "forward")


@dataclass(frozen=True)
class StragglerPolicy:
    threshold: float = 0.10
    """A rank is slower when its work per step exceeds its peers' by more than this."""
    window: int = 30
    """Steps per rank the judgement looks at (the latest ones)."""
    min_steps: int = 20
    """No judgement before every rank has this many steps."""
    confirm_steps: int = 10
    """A rank must stay slower for this many steps before it is reported."""


def _lower_quartile(xs: Sequence[float]) -> float:
    return statistics.quantiles(xs, n=4, method="inclusive")[0]


def shared_cost_per_token(ranks: Sequence[Sequence[tuple[float, float]]]) -> float:
    """Seconds per extra token, the same for every rank: least squares on each rank's
    ``(seconds, tokens)`` steps around that rank's own means (so differences between
    ranks do not enter), kept between 0 and the largest slope that leaves every rank a
    fixed cost >= 0."""
    sxy = sxx = 0.0
    cap = float("inf")
    for steps in ranks:
        mean_t = statistics.fmean(t for _, t in steps)
        mean_s = statistics.fmean(s for s, _ in steps)
        sxy += sum((t - mean_t) * (s - mean_s) for s, t in steps)
        sxx += sum((t - mean_t) ** 2 for _, t in steps)
        if mean_t > 0:
            cap = min(cap, mean_s / mean_t)
    if sxx <= 0:
        return 0.0
    return min(max(sxy / sxx, 0.0), cap)


def straggler(
    snaps: Mapping[int, Mapping[str, Any]], policy: StragglerPolicy, back: int = 0
) -> dict[str, Any] | None:
    """``{"rank", "part", "slower_by", "ms_per_step"}`` for the slowest straggler now, or None.

    Per part, each of a rank's last ``window`` steps is brought to the ranks' mean batch
    size with :func:`shared_cost_per_token`; the lower quartile of those times is the
    rank's figure (``ms_per_step``). A rank is slower when its total over the parts
    exceeds the median of the other ranks' totals by more than ``threshold``; the part
    named is the one with the largest absolute excess, so a noisy but negligible part
    (batch building is microseconds) never decides. ``back`` judges as of that many
    steps earlier (each rank's latest ``back`` steps left out).
    """
    if len(snaps) < 2:
        return None
    recent: dict[int, dict[str, list[tuple[float, float]]]] = {}
    for r, s in snaps.items():
        work = s.get("work") or {}
        recent[r] = {}
        for part in PARTS:
            xs = (work.get(part) or [])[: len(work.get(part) or []) - back]
            if len(xs) < policy.min_steps:
                return None
            recent[r][part] = [(float(x[0]), float(x[1])) for x in xs[-policy.window :]]
    speed: dict[int, dict[str, float]] = {r: {} for r in recent}
    for part in PARTS:
        per_rank = [recent[r][part] for r in recent]
        b = shared_cost_per_token(per_rank)
        size = statistics.fmean(t for steps in per_rank for _, t in steps)
        for r in recent:
            speed[r][part] = _lower_quartile(
                [sec + b * (size - tok) for sec, tok in recent[r][part]]
            )
    total = {r: sum(m.values()) for r, m in speed.items()}
    worst: dict[str, Any] | None = None
    for r, t in total.items():
        peers = [q for q in total if q != r]
        ref = statistics.median(total[q] for q in peers)
        if ref <= 0 or t / ref - 1.0 <= policy.threshold:
            continue
        excess = t / ref - 1.0
        if worst is None or excess > worst["slower_by"]:
            part = max(
                PARTS, key=lambda p: speed[r][p] - statistics.median(speed[q][p] for q in peers)
            )
            worst = {
                "rank": r,
                "part": part,
                "slower_by": round(excess, 4),
                "ms_per_step": {
                    str(q): {p: round(v * 1e3, 4) for p, v in m.items()}
                    for q, m in sorted(speed.items())
                },
            }
    return worst


@dataclass
class StragglerWatch:
    """Turns judgements into alarms: one per rank and part, once confirmed.

    ``observe`` is called on every poll with the running ranks' snapshots. A rank is
    reported when it is the straggler as of each of its last ``policy.confirm_steps``
    steps — judged from the one snapshot, whose work lists carry the step numbers,
    so the confirmation does not depend on how often the snapshots are polled.
    ``slower_since_step`` is the earliest step from which the verdict holds without a
    break, as far back as the snapshot allows.
    """

    policy: StragglerPolicy = StragglerPolicy()
    _reported: set[tuple[int, str]] = field(default_factory=set)

    def observe(self, snaps: Mapping[int, Mapping[str, Any]]) -> dict[str, Any] | None:
        found = straggler(snaps, self.policy)
        if found is None:
            return None
        rank = found["rank"]
        for back in range(1, self.policy.confirm_steps):
            earlier = straggler(snaps, self.policy, back)
            if earlier is None or earlier["rank"] != rank:
                return None
        if (rank, found["part"]) in self._reported:
            return None
        self._reported.add((rank, found["part"]))
        back = self.policy.confirm_steps - 1  # how far back the verdict holds
        while (earlier := straggler(snaps, self.policy, back + 1)) is not None and earlier[
            "rank"
        ] == rank:
            back += 1
        work = snaps[rank]["work"][found["part"]]
        found["step"] = int(snaps[rank].get("step") or work[-1][2])
        found["slower_since_step"] = int(work[-1 - back][2])
        return found
