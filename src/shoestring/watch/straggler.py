"""Straggler detection: a rank whose own work is slower than its peers'.

Step times cannot tell: in synchronous data parallelism every rank's step takes
as long as the slowest one, because the fast ranks wait in the gradient
all-reduce. So each rank reports, per step, the time of work that contains no
collective — building the batch (``data``) and the forward passes
(``forward``; with DDP's per-forward buffer sync off they contain no
communication) — normalised per padded token, since ranks get batches of
different lengths. A rank is a straggler when the median of its last
``window`` steps is more than ``threshold`` above the median of the other
ranks' medians, for any of those parts; the verdict names the part.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Mapping

PARTS = ("data", "forward")


@dataclass(frozen=True)
class StragglerPolicy:
    threshold: float = 0.10
    window: int = 30
    min_steps: int = 20


def straggler(snaps: Mapping[int, Mapping[str, Any]], policy: StragglerPolicy
              ) -> dict[str, Any] | None:
    """``{"rank", "part", "slower_by", ...}`` for the slowest straggler, or None.

    A rank is slower when its total collective-free work per token (the sum of the
    parts' medians) exceeds the median of the other ranks' totals by more than
    ``threshold``; the part named is the one with the largest absolute excess, so a
    noisy but negligible part (batch building is microseconds) never decides.
    """
    if len(snaps) < 2:
        return None
    med: dict[int, dict[str, float]] = {}
    for r, s in snaps.items():
        work = s.get("work") or {}
        med[r] = {}
        for part in PARTS:
            xs = work.get(part) or []
            if len(xs) < policy.min_steps:
                return None
            med[r][part] = statistics.median(xs[-policy.window:])
    total = {r: sum(m.values()) for r, m in med.items()}
    worst: dict[str, Any] | None = None
    for r, t in total.items():
        peers = [q for q in total if q != r]
        ref = statistics.median(total[q] for q in peers)
        if ref <= 0 or t / ref - 1.0 <= policy.threshold:
            continue
        excess = t / ref - 1.0
        if worst is None or excess > worst["slower_by"]:
            part = max(PARTS, key=lambda p: med[r][p] - statistics.median(med[q][p] for q in peers))
            worst = {"rank": r, "part": part, "slower_by": round(excess, 4),
                     "us_per_token": {str(q): {p: round(v * 1e6, 3) for p, v in m.items()}
                                      for q, m in sorted(med.items())}}
    return worst
