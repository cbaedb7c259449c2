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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shoestring.gpus import CATALOG, detect_gpu_name
from shoestring.report.timeline import Timeline, load


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


def _spans_and_restarts(tl: Timeline) -> tuple[dict[int, tuple[float, float]], float]:
    """Each attempt's (start, end), and the seconds of restart overhead: a later attempt's
    process start -> its first step; one that never stepped (killed while loading) was
    restart overhead for its whole span."""
    by_attempt: dict[int, list[float]] = {}
    first_step: dict[int, float] = {}
    for e in tl.events:
        by_attempt.setdefault(e.attempt, []).extend((e.ts, e.until))
        if e.kind == "step" and e.attempt not in first_step:
            first_step[e.attempt] = e.ts
    spans = {a: (min(ts), max(ts)) for a, ts in by_attempt.items()}
    for att in tl.attempts:  # the supervisor's records bound an attempt exactly
        lo, hi = spans.get(att.index, (att.start, att.end or att.start))
        spans[att.index] = (min(lo, att.start), max(hi, att.end or hi))
    restart = sum(
        (first_step[a] if a in first_step else spans[a][1]) - spans[a][0]
        for a in spans
        if a > min(spans)
    )
    return spans, restart


def compute(tl: Timeline, price: Price | None = None) -> Ledger:
    """The ledger of a run directory's timeline."""
    rs = tl.run_start
    devices = tl.world_size
    if price is None:
        device = str(rs.get("device") or "unknown") if rs else "unknown"
        market = str(rs.get("market") or "spot") if rs else "spot"
        price = price_for(device, market, float(rs.get("usd_per_hour") or 0) if rs else 0.0)
    spans, restart = _spans_and_restarts(tl)
    wall = sum(hi - lo for lo, hi in spans.values())
    step_ms = [s.step_ms for s in tl.steps().get(0, []) if s.step_ms]
    med_step_s = statistics.median(step_ms) / 1e3 if step_ms else 0.0
    recomputed = sum(int(e.get("steps_lost") or 0) for e in tl.of("resume") if e.rank == 0)
    blocked = sum(float(e.get("blocking_ms") or 0) for e in tl.checkpoints()) / 1e3
    preempted = {e.attempt for e in tl.preemptions()}
    # A failure that cost work: a resume that had to redo steps (a kill without notice, a
    # crash, a hang); a preemption with notice resumes with nothing lost.
    failures = sum(1 for e in tl.of("resume") if e.rank == 0 and int(e.get("steps_lost") or 0))
    h = 1 / 3600
    device_hours = wall * h * devices
    recompute_h = recomputed * med_step_s * h * devices
    restart_h = restart * h * devices
    ckpt_h = blocked * h * devices
    usd = od = None
    if price.usd_per_hour is not None:
        usd = device_hours * price.usd_per_hour
    if price.on_demand_usd_per_hour is not None:
        od = (device_hours - recompute_h - restart_h) * price.on_demand_usd_per_hour
    return Ledger(
        device=price.device,
        devices=devices,
        market=price.market,
        attempts=max(len(spans), 1),
        preemptions=len(preempted),
        failures=failures,
        steps=tl.last_step(),
        steps_recomputed=recomputed,
        wall_hours=wall * h,
        device_hours=device_hours,
        recompute_hours=recompute_h,
        restart_hours=restart_h,
        checkpoint_hours=ckpt_h,
        usd=usd,
        on_demand_usd=od,
        price_source=price.source,
    )


def run_ledger(run_dir: Path) -> tuple[dict[str, Any], str]:
    """The ledger of every attempt in ``run_dir`` so far: the ``cost`` event's fields and
    its one-line summary (the trainer's end-of-run hook)."""
    led = compute(load(run_dir))
    return led.to_json(), led.one_line()
