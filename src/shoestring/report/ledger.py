"""The cost ledger of a run: device-hours, what interruptions cost, and money.

Everything comes from the event log (``timeline``) and a price per device-hour:
the run's own (``run_start`` records the device, the market and the price the
run was configured with), or one given explicitly, or the GPU catalog of
``shoestring plan``. The ledger says what the run spent, what preemptions and
failures cost in recomputed steps, restarts and checkpoint stalls, and what the
same useful work would have cost on on-demand machines, which are never
interrupted (but still checkpoint).
"""

from __future__ import annotations

import statistics
from array import array
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shoestring.exitcodes import RESUMABLE
from shoestring.gpus import CATALOG, detect_gpu_name
from shoestring.report.timeline import SUPERVISOR_RANK, Event, Timeline, stream


@dataclass(frozen=True)
class Price:
    device: str  # catalog name, or "cpu"/"unknown"
    market: str  # spot | on_demand
    usd_per_hour: float | None  # per device, on this market
    on_demand_usd_per_hour: float | None
    source: str = ""


def price_for(device: str | None, market: str = "spot", usd_per_hour: float = 0.0) -> Price:
    """A price from the catalog (or an explicit override) for one device-hour."""
    name = detect_gpu_name(device or "") if device else None
    g = CATALOG.get(name) if name else None
    od = g.on_demand_usd_h if g else None
    if usd_per_hour > 0:
        return Price(
            name or device or "unknown",
            market,
            usd_per_hour,
            od if market == "spot" else usd_per_hour,
            "given",
        )
    if g is None:
        return Price(device or "unknown", market, None, None, "no price for this device")
    rate = g.spot_usd_h if market == "spot" else g.on_demand_usd_h
    return Price(g.name, market, rate, od, f"{g.price_source} ({g.price_date})")


@dataclass(frozen=True)
class Ledger:
    device: str
    devices: int
    market: str
    attempts: int
    preemptions: int
    failures: int  # resumes that had to redo steps
    steps: int
    steps_recomputed: int
    wall_hours: float
    device_hours: float
    recompute_hours: float  # device-hours spent redoing lost steps
    restart_hours: float  # device-hours from each later attempt's process start to its first step
    checkpoint_hours: float  # device-hours training was blocked by saves
    usd: float | None
    on_demand_usd: float | None  # the useful work (without recompute/restarts) on on-demand
    price_source: str

    @property
    def overhead_hours(self) -> float:
        return self.recompute_hours + self.restart_hours + self.checkpoint_hours

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["overhead_hours"] = self.overhead_hours
        return {k: (round(v, 9) if isinstance(v, float) else v) for k, v in d.items()}

    def one_line(self) -> str:
        money = ""
        if self.usd is not None:
            money = f", ${self.usd:.2f} on {self.market.replace('_', '-')}"
            if self.on_demand_usd is not None and self.market == "spot":
                money += f" vs ${self.on_demand_usd:.2f} on-demand"
        return (
            f"cost: {self.device_hours:.3f} {self.device}-hours on {self.devices} "
            f"device(s){money}; {self.preemptions} preemption(s), {self.failures} "
            f"failure(s), {self.steps_recomputed} step(s) recomputed, overhead "
            f"{100 * self.overhead_hours / self.device_hours if self.device_hours else 0:.1f} %"
            f" (recompute {self.recompute_hours * 3600:.0f} s, restarts "
            f"{self.restart_hours * 3600:.0f} s, checkpoint stalls "
            f"{self.checkpoint_hours * 3600:.1f} s)"
        )


@dataclass
class LedgerFold:
    """What the ledger sums, fed one record at a time in any order: :func:`compute` feeds
    it a loaded timeline, the end-of-run ledger streams the logs through it (a long run's
    history is never held whole). Each attempt spans its first to its last record;
    restart overhead is a later attempt's process start -> its first step (its whole
    span if it never stepped); lost steps are priced at rank 0's median step time."""

    spans: dict[int, list[float]] = field(default_factory=dict)
    first_step: dict[int, float] = field(default_factory=dict)
    step_ms: array[float] = field(default_factory=lambda: array("d"))  # rank 0's
    run_start: Event | None = None  # the latest by rank 0 or the supervisor
    any_run_start: Event | None = None
    ranks: set[int] = field(default_factory=set)
    last_step: int = 0
    recomputed: int = 0
    failures: int = 0  # resumes that had to redo steps
    blocked_ms: dict[bool, float] = field(default_factory=lambda: {True: 0.0, False: 0.0})
    rank0_saved: bool = False
    preempted: set[int] = field(default_factory=set)

    def add(self, e: Event) -> None:
        span = self.spans.setdefault(e.attempt, [e.ts, e.until])
        span[0], span[1] = min(span[0], e.ts), max(span[1], e.until)
        if e.rank >= 0:
            self.ranks.add(e.rank)
        fold = _FOLDS.get(e.kind)
        if fold is not None:
            fold(self, e)

    def _run_start(self, e: Event) -> None:
        if self.any_run_start is None or e.ts >= self.any_run_start.ts:
            self.any_run_start = e
        if e.rank in (0, SUPERVISOR_RANK) and (self.run_start is None or e.ts >= self.run_start.ts):
            self.run_start = e

    def _step(self, e: Event) -> None:
        self.last_step = max(self.last_step, int(e.get("step", 0)))
        if e.ts < self.first_step.get(e.attempt, float("inf")):
            self.first_step[e.attempt] = e.ts
        ms = e.get("step_ms")
        if (
            e.rank == 0
            and isinstance(ms, (int, float))
            and not isinstance(ms, bool)
            and ms == ms
            and ms
        ):
            self.step_ms.append(float(ms))

    def _resume(self, e: Event) -> None:
        lost = int(e.get("steps_lost") or 0)
        if e.rank == 0:
            self.recomputed += lost
            self.failures += 1 if lost else 0  # a preemption with notice loses nothing

    def _checkpoint(self, e: Event) -> None:
        self.blocked_ms[e.rank == 0] += float(e.get("blocking_ms") or 0)
        self.rank0_saved |= e.rank == 0

    def _preempt(self, e: Event) -> None:
        self.preempted.add(e.attempt)

    def _attempt_end(self, e: Event) -> None:
        if e.get("exit_code") in RESUMABLE:  # died before it could log its ``preempt``
            self.preempted.add(e.attempt)

    @property
    def restart_s(self) -> float:
        if not self.spans:
            return 0.0
        first = min(self.spans, key=lambda a: (self.spans[a][0], a))
        return sum(
            self.first_step.get(a, hi) - lo for a, (lo, hi) in self.spans.items() if a != first
        )

    @property
    def world_size(self) -> int:
        rs = self.run_start or self.any_run_start
        ws = int(rs.get("world_size") or 1) if rs else 1
        return max([ws] + [r + 1 for r in self.ranks])

    def price(self) -> Price:
        """The run's own price: the device, market and rate its ``run_start`` names."""
        rs = self.run_start or self.any_run_start
        if rs is None:
            return price_for("unknown", "spot", 0.0)
        return price_for(
            str(rs.get("device") or "unknown"),
            str(rs.get("market") or "spot"),
            float(rs.get("usd_per_hour") or 0),
        )

    def ledger(self, price: Price | None = None) -> Ledger:
        price = price or self.price()
        devices = self.world_size
        h = devices / 3600  # device-hours per second of wall time
        wall = sum(hi - lo for lo, hi in self.spans.values())
        med_step_s = statistics.median(self.step_ms) / 1e3 if self.step_ms else 0.0
        blocked = self.blocked_ms[True] if self.rank0_saved else self.blocked_ms[False]
        device_hours, recompute_h = wall * h, self.recomputed * med_step_s * h
        restart_h, ckpt_h = self.restart_s * h, blocked / 1e3 * h
        rate, od_rate = price.usd_per_hour, price.on_demand_usd_per_hour
        return Ledger(
            device=price.device,
            devices=devices,
            market=price.market,
            attempts=max(len(self.spans), 1),
            preemptions=len(self.preempted),
            failures=self.failures,
            steps=self.last_step,
            steps_recomputed=self.recomputed,
            wall_hours=wall / 3600,
            device_hours=device_hours,
            recompute_hours=recompute_h,
            restart_hours=restart_h,
            checkpoint_hours=ckpt_h,
            usd=None if rate is None else device_hours * rate,
            on_demand_usd=None
            if od_rate is None
            else (device_hours - recompute_h - restart_h) * od_rate,
            price_source=price.source,
        )


_FOLDS: dict[str, Callable[[LedgerFold, Event], None]] = {
    "run_start": LedgerFold._run_start,
    "step": LedgerFold._step,
    "resume": LedgerFold._resume,
    "checkpoint": LedgerFold._checkpoint,
    "preempt": LedgerFold._preempt,
    "attempt_end": LedgerFold._attempt_end,
}


def fold(events: Iterable[Event]) -> LedgerFold:
    f = LedgerFold()
    for e in events:
        f.add(e)
    return f


def compute(tl: Timeline, price: Price | None = None) -> Ledger:
    """The ledger of a loaded timeline (``shoestring report``)."""
    return fold(tl.events).ledger(price)


def stream_ledger(run_dir: Path, price: Price | None = None) -> Ledger:
    """The ledger of every attempt in ``run_dir`` so far, streamed from its logs one
    record at a time (memory independent of the history's length)."""
    return fold(stream(run_dir)).ledger(price)


def run_ledger(run_dir: Path) -> tuple[dict[str, Any], str]:
    """The ``cost`` event's fields and its one-line summary (the trainer's end-of-run
    hook)."""
    led = stream_ledger(run_dir)
    return led.to_json(), led.one_line()
