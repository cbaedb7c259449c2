"""Slow degradation: per-window communication and throughput per rank, against a baseline.

A hang stops a job; degradation only makes it cost more — a flapping link, a
throttling GPU, a noisy neighbour. Each rank's recorder keeps cumulative totals
over its quiet training steps (steps, tokens, time in ``train_step``, time in
collectives). At every window boundary (``window_s``, one minute by default,
longer if fewer than ``min_steps`` steps fell into it) the watchdog takes the
deltas: a :class:`Window` per rank with the
communication time per step and the training throughput (tokens per second of
``train_step`` time, so evals, saves and restarts do not count as a drop).

Each rank's baseline is the best level it has *held*: over any run of
``baseline_windows`` (5) windows in a row after its first, warm-up window, the
least good of them (the most communication time per step, the fewest tokens per
second). It only improves. So a slow start (a busy neighbour, a cold page cache)
is forgotten once the rank has run at its true speed for 5 windows; lucky
windows cannot lower it (every window of the run must be better); and it never
moves toward a degradation — a slow drift is judged against the best level, not
against its own recent past.
An alarm fires when a rank's communication time per step is more than
``comm_rise`` above its baseline, or its throughput more than ``throughput_drop``
below it, for ``consecutive`` windows in a row — one noisy window never alarms.
An alarm is raised once per rank and kind until the metric recovers; it names
the windows that held the baseline and how long ago. A new process (its step
counter went back) starts over: warm-up, baseline and all.

A baseline that only improves is the best of many runs, so it sits on the lucky
side of the window-to-window noise, and how far decides the false alarms. Over
steady 1000-window traces with 2 % noise, the best *median* of 5 windows raised a
false throughput alarm on 86 % of them, the least good of 5 on 1 % (the old fixed
median of windows 2-4: 2.5 %); after a 2x slow start, a degradation of 1.2x the
margin was still seen on 96 % (communication) and 86 % (throughput) of traces, by
the old rule on none (``benchmarks/degrade_baseline.py``, 2026-12-06). Noise
within about half the margin (``rise / (2 + rise)``) can never alarm; much more
(3 % against the 5 % throughput margin) alarms often, and needs a wider margin.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from operator import attrgetter
from typing import Any, Literal


@dataclass(frozen=True)
class DegradePolicy:
    window_s: float = 60.0
    comm_rise: float = 0.10
    throughput_drop: float = 0.05
    consecutive: int = 3
    warmup_windows: int = 1
    baseline_windows: int = 5
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


@dataclass(frozen=True)
class Held:
    """A level a rank held over a run of windows: the least good window of the run."""

    value: float
    first: int  # the run's window numbers in this process (1-based, inclusive)
    last: int
    t0: float  # the run's first window's start and last window's end
    t1: float


@dataclass(frozen=True)
class Gauge:
    """One judged quantity of a window, and which way is worse."""

    alarm: Literal["comm_degraded", "throughput_drop"]  # the alarm's ``kind``
    label: str
    of: Callable[[Window], float]
    higher_is_better: bool
    fmt: str  # shows a value, after ``scale``
    scale: float = 1.0

    def worse(self, a: float, b: float, by: float) -> bool:
        """Whether ``a`` is worse than ``b`` by more than the fraction ``by``."""
        return a < b * (1 - by) if self.higher_is_better else a > b * (1 + by)

    def least_good(self, values: Sequence[float]) -> float:
        return min(values) if self.higher_is_better else max(values)

    def show(self, v: float) -> str:
        return self.fmt.format(v * self.scale)


COMM = Gauge(
    "comm_degraded",
    "communication time per step",
    attrgetter("comm_s_per_step"),
    higher_is_better=False,
    fmt="{:.2f} ms",
    scale=1e3,
)
THROUGHPUT = Gauge(
    "throughput_drop",
    "throughput",
    attrgetter("tokens_per_s"),
    higher_is_better=True,
    fmt="{:,.0f} tokens/s",
)


@dataclass
class _Track:
    """One gauge of one rank: its baseline and the current run of bad windows."""

    gauge: Gauge
    margin: float  # the alarm's fraction (``comm_rise`` / ``throughput_drop``)
    baseline: Held | None = None
    streak: int = 0
    alarmed: bool = False

    def is_bad(self, w: Window) -> bool:
        b = self.baseline
        return (
            b is not None
            and b.value > 0
            and self.gauge.worse(self.gauge.of(w), b.value, self.margin)
        )

    def judge(self, w: Window, consecutive: int) -> bool:
        """Count ``w``; true when it completes a new episode of ``consecutive`` bad windows."""
        bad = self.is_bad(w)
        self.streak = self.streak + 1 if bad else 0
        if not bad:
            self.alarmed = False
        if self.streak >= consecutive and not self.alarmed:
            self.alarmed = True
            return True
        return False

    def offer(self, run: Sequence[Window], last: int) -> None:
        """Take the level ``run`` held as the baseline if it is the first or a better one."""
        held = Held(
            value=self.gauge.least_good([self.gauge.of(x) for x in run]),
            first=last - len(run) + 1,
            last=last,
            t0=run[0].t0,
            t1=run[-1].t1,
        )
        b = self.baseline
        if b is None or self.gauge.worse(b.value, held.value, 0.0):
            self.baseline = held


@dataclass
class _RankState:
    start: tuple[float, dict[str, float]]
    tracks: tuple[_Track, ...]
    recent: deque[Window]
    closed: int = 0  # windows closed by this process


def _ago(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


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
            st = self._ranks.get(r)
            if st is None or tot["steps"] < st.start[1]["steps"]:
                self._ranks[r] = self._fresh(now, tot)  # first sight, or a new process
                continue
            w = self._close(r, st, now, tot)
            if w is not None:
                windows.append(w)
                alarms.extend(self._judge(st, w))
        return windows, alarms

    def _fresh(self, now: float, tot: Mapping[str, float]) -> _RankState:
        p = self.policy
        return _RankState(
            start=(now, dict(tot)),
            tracks=(_Track(COMM, p.comm_rise), _Track(THROUGHPUT, p.throughput_drop)),
            recent=deque(maxlen=max(p.baseline_windows, p.consecutive)),
        )

    def _close(
        self, rank: int, st: _RankState, now: float, tot: Mapping[str, float]
    ) -> Window | None:
        t0, prev = st.start
        steps = int(tot["steps"] - prev["steps"])
        if now - t0 < self.policy.window_s or steps < self.policy.min_steps:
            return None
        st.start = (now, dict(tot))
        return Window(
            rank=rank,
            t0=t0,
            t1=now,
            steps=steps,
            tokens=int(tot["tokens"] - prev["tokens"]),
            train_s=tot["train_s"] - prev["train_s"],
            comm_s=tot["comm_s"] - prev["comm_s"],
        )

    def _judge(self, st: _RankState, w: Window) -> list[dict[str, Any]]:
        """Judge ``w`` against the baseline held so far, then let it improve the baseline."""
        p = self.policy
        st.closed += 1
        st.recent.append(w)
        bad_run = list(st.recent)[-p.consecutive :]
        out = [self._alarm(t, bad_run) for t in st.tracks if t.judge(w, p.consecutive)]
        if st.closed >= p.warmup_windows + p.baseline_windows:
            run = list(st.recent)[-p.baseline_windows :]
            for t in st.tracks:
                t.offer(run, st.closed)
        return out

    def _alarm(self, t: _Track, bad_run: Sequence[Window]) -> dict[str, Any]:
        """The alarm record: the median of the bad windows against the baseline, and
        which windows held that baseline and when, so a reader can judge it."""
        p, g, b, w = self.policy, t.gauge, t.baseline, bad_run[-1]
        assert b is not None  # judge() only alarms against a baseline
        now_v = statistics.median(g.of(x) for x in bad_run)
        change = now_v / b.value - 1.0
        msg = (
            f"{g.label} {g.show(now_v)} is {change:+.0%} vs baseline {g.show(b.value)} "
            f"(the best level it held, windows {b.first}-{b.last} of this process, "
            f"{_ago(w.t1 - b.t1)} ago)"
        )
        return {
            "kind": g.alarm,
            "rank": w.rank,
            "windows": p.consecutive,
            "window_s": p.window_s,
            "baseline": round(b.value, 6),
            "baseline_windows": [b.first, b.last],
            "baseline_t0": round(b.t0, 6),
            "baseline_t1": round(b.t1, 6),
            "current": round(now_v, 6),
            "change": round(change, 4),
            "message": msg,
        }
