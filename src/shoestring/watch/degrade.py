"""Slow degradation: per-window communication and throughput per rank, against a baseline.

A hang stops a job; degradation only makes it cost more — a flapping link, a
throttling GPU, a noisy neighbour. Each rank's recorder keeps cumulative totals
over its quiet training steps (steps, tokens, time in ``train_step``, time in
collectives). At every window boundary (``window_s``, one minute by default,
longer if fewer than ``min_steps`` steps fell into it) the watchdog takes the
deltas: a :class:`Window` per rank with the
communication time per step and the training throughput (tokens per second of
``train_step`` time, so evals, saves and restarts do not count as a drop).

The first complete windows of an attempt set the baseline (their median, after
one warm-up window). An alarm fires when a rank's communication time per step
is more than ``comm_rise`` above its baseline, or its throughput more than
``throughput_drop`` below it, for ``consecutive`` windows in a row — one noisy
window never alarms. An alarm is raised once per rank and kind until the
metric recovers.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class DegradePolicy:
    window_s: float = 60.0
    comm_rise: float = 0.10
    throughput_drop: float = 0.05
    consecutive: int = 3
    warmup_windows: int = 1
    baseline_windows: int = 3
    min_steps: int = 5


@dataclass(frozen=True)
class Window:
    rank: int
    t0: float
    t1: float
    steps: int
    tokens: int
    train_s: float
    comm_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.train_s if self.train_s > 0 else 0.0

    @property
    def comm_s_per_step(self) -> float:
        return self.comm_s / self.steps if self.steps else 0.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            tokens_per_s=round(self.tokens_per_s, 3),
            comm_s_per_step=round(self.comm_s_per_step, 6),
            comm_share=round(self.comm_s / self.train_s, 4) if self.train_s > 0 else 0.0,
        )
        for k in ("t0", "t1", "train_s", "comm_s"):
            d[k] = round(d[k], 6)
        return d


@dataclass
class _RankState:
    start: tuple[float, dict[str, float]] | None = None
    history: list[Window] = field(default_factory=list)
    baseline: dict[str, float] | None = None
    streak: dict[str, int] = field(default_factory=lambda: {"comm": 0, "throughput": 0})
    alarmed: set[str] = field(default_factory=set)


class DegradationMonitor:
    """Feed it snapshots (:meth:`observe`); it returns closed windows and alarms.

    Each rank's window closes when ``window_s`` has passed *and* it holds at least
    ``min_steps`` quiet steps, so a slow machine gets longer windows instead of
    windows too small to judge; an eval or a save inside a window does not count
    (only ``train_step`` time does).
    """

    def __init__(self, policy: DegradePolicy) -> None:
        self.policy = policy
        self._ranks: dict[int, _RankState] = {}

    def observe(
        self, now: float, snaps: Mapping[int, Mapping[str, Any]]
    ) -> tuple[list[Window], list[dict[str, Any]]]:
        """Close the windows whose time has come: ``(windows, alarms)``, both maybe empty."""
        windows: list[Window] = []
        alarms: list[dict[str, Any]] = []
        for r, s in sorted(snaps.items()):
            tot = s.get("totals")
            if not tot:
                continue
            st = self._ranks.setdefault(r, _RankState())
            if st.start is None or tot["steps"] < st.start[1]["steps"]:
                st.start = (now, dict(tot))  # first sight, or a new process: start over
                continue
            t0, prev = st.start
            steps = int(tot["steps"] - prev["steps"])
            if now - t0 < self.policy.window_s or steps < self.policy.min_steps:
                continue
            st.start = (now, dict(tot))
            w = Window(
                rank=r,
                t0=t0,
                t1=now,
                steps=steps,
                tokens=int(tot["tokens"] - prev["tokens"]),
                train_s=tot["train_s"] - prev["train_s"],
                comm_s=tot["comm_s"] - prev["comm_s"],
            )
            windows.append(w)
            alarms.extend(self._judge(st, w))
        return windows, alarms

    def _judge(self, st: _RankState, w: Window) -> list[dict[str, Any]]:
        p = self.policy
        st.history.append(w)
        n = len(st.history)
        if st.baseline is None:
            if n >= p.warmup_windows + p.baseline_windows:
                base = st.history[p.warmup_windows :]
                st.baseline = {
                    "comm": statistics.median(x.comm_s_per_step for x in base),
                    "throughput": statistics.median(x.tokens_per_s for x in base),
                }
            return []
        del st.history[: -p.consecutive]  # bounded memory
        b = st.baseline
        bad = {
            "comm": b["comm"] > 0 and w.comm_s_per_step > b["comm"] * (1 + p.comm_rise),
            "throughput": b["throughput"] > 0
            and w.tokens_per_s < b["throughput"] * (1 - p.throughput_drop),
        }
        out = []
        for kind, is_bad in bad.items():
            st.streak[kind] = st.streak[kind] + 1 if is_bad else 0
            if not is_bad:
                st.alarmed.discard(kind)
            if st.streak[kind] >= p.consecutive and kind not in st.alarmed:
                st.alarmed.add(kind)
                recent = st.history[-p.consecutive :]
                if kind == "comm":
                    now_v = statistics.median(x.comm_s_per_step for x in recent)
                    change = now_v / b["comm"] - 1.0
                    msg = (
                        f"communication time per step {now_v * 1e3:.2f} ms is "
                        f"{change:+.0%} vs baseline {b['comm'] * 1e3:.2f} ms"
                    )
                else:
                    now_v = statistics.median(x.tokens_per_s for x in recent)
                    change = now_v / b["throughput"] - 1.0
                    msg = (
                        f"throughput {now_v:,.0f} tokens/s is {change:+.0%} vs "
                        f"baseline {b['throughput']:,.0f}"
                    )
                out.append(
                    {
                        "kind": "comm_degraded" if kind == "comm" else "throughput_drop",
                        "rank": w.rank,
                        "windows": p.consecutive,
                        "window_s": p.window_s,
                        "baseline": round(b[kind], 6),
                        "current": round(now_v, 6),
                        "change": round(change, 4),
                        "message": msg,
                    }
                )
        return out
