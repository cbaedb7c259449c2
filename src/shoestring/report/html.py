"""``shoestring report``: one self-contained HTML file for a run directory.

The page is a list of sections, each made by a function of the
:class:`~shoestring.report.timeline.Timeline` (and the ranks' last live
snapshots). A function returns ``None`` when its data is absent, so a report
of a single-process run without a supervisor simply has fewer sections.
Later sections (the cost ledger) plug in by appending a function to
:data:`DEFAULT_SECTIONS` or passing their own list to :func:`render`.

Everything is inline (CSS, SVG); there is no script and no network access.
All text from the run directory goes through :func:`html.escape`.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

from shoestring import exitcodes
from shoestring.fsio import atomic_write
from shoestring.report import svg
from shoestring.report.live import read_live
from shoestring.report.timeline import Alarm, Attempt, Timeline, load, load_phase_text, median

#: Event-band and rule colours (rank colours come from :data:`svg.PALETTE`).
COLORS = {
    "ok": "#4caf50",
    "failed": "#e53935",
    "hung": "#b71c1c",
    "preempted": "#fb8c00",
    "running": "#90a4ae",
    "checkpoint": "#1565c0",
    "restart": "#6a1b9a",
    "eval": "#00897b",
    "hang": "#b71c1c",
    "straggler": "#fb8c00",
    "alarm": "#8e24aa",
    "preempt": "#fb8c00",
}


@dataclass
class Context:
    """What section functions read: the timeline plus the ranks' last snapshots."""

    tl: Timeline
    live: dict[int, dict[str, Any]] = field(default_factory=dict)

    def elapsed(self, ts: float) -> float:
        return ts - (self.tl.t0 or ts)


@dataclass(frozen=True)
class Section:
    id: str
    title: str
    body: str  # trusted HTML: built by this package, every run-dir string escaped
    note: str = ""  # plain text, escaped when rendered


SectionFn = Callable[[Context], "Section | None"]


# ---------------------------------------------------------------------- helpers
def utc(ts: float | None) -> str:
    if ts is None:
        return "—"
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def duration(s: float) -> str:
    s = max(0.0, s)
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60)} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60)} min"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], cls: str = "") -> str:
    head = "".join(f"<th>{escape(str(h))}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{escape(_cell(c))}</td>" for c in r) + "</tr>" for r in rows
    )
    return (
        f'<table class="{escape(cls)}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
    )


def _cell(c: Any) -> str:
    if c is None:
        return "—"
    if isinstance(c, float):
        return f"{c:,.1f}" if abs(c) >= 100 else f"{c:.3g}"
    return str(c)


def _attempt_color(a: Attempt, tl: Timeline) -> tuple[str, str]:
    preempted = {e.attempt for e in tl.preemptions()}
    if a.hung:
        return COLORS["hung"], "hung"
    if a.index in preempted or a.exit_code in exitcodes.RESUMABLE:
        return COLORS["preempted"], "preempted"
    if a.exit_code == 0:
        return COLORS["ok"], "completed"
    if a.exit_code is None:
        return COLORS["running"], "running or unknown"
    return COLORS["failed"], f"exit {a.exit_code}"


def _alarm_color(a: Alarm) -> str:
    if a.kind.startswith("hang"):
        return COLORS["hang"]
    return COLORS.get(a.kind, COLORS["alarm"])


def _time_range(ctx: Context) -> tuple[float, float]:
    """The shared x range of every plot over time, so they line up on the page."""
    return 0.0, ctx.tl.wall_s * 1.015 or 1.0


def _rules(ctx: Context) -> list[svg.Rule]:
    """Restarts and hangs as vertical lines on time plots."""
    rules = [
        svg.Rule(
            ctx.elapsed(e.ts),
            COLORS["restart"],
            f"restart {e.get('attempt')}: {e.get('reason', '')}",
        )
        for e in ctx.tl.restarts()
    ]
    rules += [
        svg.Rule(ctx.elapsed(a.ts), _alarm_color(a), f"{a.kind}: {a.message}", dash=False)
        for a in ctx.tl.alarms()
        if a.kind.startswith("hang")
    ]
    return rules


# ---------------------------------------------------------------------- sections
def summary(ctx: Context) -> Section:
    tl = ctx.tl
    rs = tl.run_start
    steps = tl.of("step")
    cks = tl.checkpoints()
    ev = tl.final_eval()
    redone = sum(int(e.get("steps_lost") or 0) for e in tl.of("resume") if e.rank in (0, -1))
    end = tl.of("run_end")
    status = "completed" if end else ("gave up" if tl.of("gave_up") else "incomplete / running")
    blocking_s = sum(float(e.get("blocking_ms") or 0) for e in cks) / 1e3
    items: list[tuple[str, Any]] = [
        ("run id", tl.run_id),
        ("status", status),
        ("model", rs.get("model") if rs else None),
        ("world size", f"{tl.world_size} ({rs.get('strategy', '?')})" if rs else tl.world_size),
        ("steps done", f"{tl.last_step()} / {rs.get('max_steps', '?')}" if rs else tl.last_step()),
        ("steps redone after resumes", redone),
        ("started", utc(tl.t0)),
        ("wall time", duration(tl.wall_s)),
        ("loading, per attempt", _loading(tl)),
        ("attempts", len(tl.attempts)),
        ("restarts", len(tl.restarts())),
        ("preemptions", len(tl.preemptions())),
        ("checkpoints", f"{len(cks)} (blocking {blocking_s:.2f} s in total)"),
        ("alarms", len(tl.alarms())),
        ("final train loss", tl.final_loss()),
        (
            "final eval",
            f"loss {ev.get('loss'):.4g} (step {ev.get('step')}, {ev.get('tag')})" if ev else None,
        ),
        (
            "tokens fed (incl. redone)",
            sum(int(e.get("tokens") or 0) for e in steps if e.rank == 0) or None,
        ),
    ]
    body = (
        '<dl class="summary">'
        + "".join(f"<dt>{escape(k)}</dt><dd>{escape(_cell(v))}</dd>" for k, v in items)
        + "</dl>"
    )
    return Section("summary", "Summary", body)


def _loading(tl: Timeline) -> str | None:
    """Each attempt's process start → first step, and its load phases."""
    first_step: dict[int, float] = {}
    for e in tl.of("step"):
        first_step.setdefault(e.attempt, e.ts)
    lines = []
    for a in tl.attempts:
        phases = [load_phase_text(e.data) for e in tl.of("load") if e.attempt == a.index]
        if not phases:
            continue
        to_step = (
            f"{first_step[a.index] - a.start:.1f} s to the first step: "
            if (a.index in first_step)
            else ""
        )
        lines.append(f"#{a.index}: {to_step}{'; '.join(phases)}")
    return " | ".join(lines) or None


def cost_ledger(ctx: Context) -> Section | None:
    """Device-hours, what interruptions cost, and money (``report.ledger``)."""
    from shoestring.report.ledger import compute

    if not ctx.tl.of("step"):
        return None
    led = compute(ctx.tl)

    def usd(v: float | None) -> str:
        return "—" if v is None else f"${v:,.2f}"

    rows = [
        ("device-hours", f"{led.device_hours:.4f} ({led.devices} × {led.device})"),
        (f"spent ({led.market.replace('_', '-')})", usd(led.usd)),
        ("same useful work on on-demand", usd(led.on_demand_usd)),
        ("preemptions / failures that lost work", f"{led.preemptions} / {led.failures}"),
        ("steps recomputed", f"{led.steps_recomputed} ({led.recompute_hours * 3600:.1f} device-s)"),
        ("restart overhead", f"{led.restart_hours * 3600:.1f} device-s"),
        ("checkpoint stalls", f"{led.checkpoint_hours * 3600:.2f} device-s"),
        (
            "overhead share",
            f"{100 * led.overhead_hours / led.device_hours:.2f} %" if led.device_hours else "—",
        ),
    ]
    return Section(
        "cost",
        "Cost ledger",
        table(("item", "value"), rows, "ledger"),
        note=f"price: {led.price_source or 'none'}",
    )


def step_times(ctx: Context) -> Section | None:
    per_rank = ctx.tl.steps()
    if not per_rank:
        return None
    by_time, by_step = _step_series(ctx, per_rank)
    chart = svg.line_chart(
        by_time,
        title="step time per rank over time",
        x_label="time since start",
        y_label="step time (ms)",
        x_fmt=svg.fmt_elapsed,
        rules=_rules(ctx),
        x_range=_time_range(ctx),
    )
    chart_by_step = svg.line_chart(
        by_step,
        title="step time per rank by step",
        x_label="step",
        y_label="step time (ms)",
        layout=svg.Layout(height=220),
        x_integer=True,
    )
    rows = [_step_row(rank, steps) for rank, steps in sorted(per_rank.items())]
    return Section(
        "step-time",
        "Step time per rank",
        chart
        + "<h3>By step</h3>"
        + chart_by_step
        + table(("rank", "steps logged", "median ms", "max ms", "median tokens/s"), rows),
        note="Each attempt is drawn as its own line; dashed lines are restarts, solid "
        "red ones hang verdicts. Steps redone after a resume appear again.",
    )


def _step_series(ctx: Context, per_rank: Any) -> tuple[list[svg.Series], list[svg.Series]]:
    """Per rank, step time over time and by step; one segment per attempt."""
    by_time, by_step = [], []
    for rank, steps in sorted(per_rank.items()):
        t_segs: dict[int, list[svg.Point]] = {}
        s_segs: dict[int, list[svg.Point]] = {}
        for s in steps:
            if s.step_ms is not None:
                t_segs.setdefault(s.attempt, []).append((ctx.elapsed(s.ts), s.step_ms))
                s_segs.setdefault(s.attempt, []).append((float(s.step), s.step_ms))
        color, name = svg.rank_color(rank), f"rank {rank}"
        attrs = {"data-rank": str(rank)}
        by_time.append(
            svg.Series(name, color, list(t_segs.values()), attrs={**attrs, "data-x": "time"})
        )
        by_step.append(
            svg.Series(name, color, list(s_segs.values()), attrs={**attrs, "data-x": "step"})
        )
    return by_time, by_step


def _step_row(rank: int, steps: Any) -> tuple[Any, ...]:
    ms = [s.step_ms for s in steps if s.step_ms is not None]
    return (
        rank,
        len(steps),
        median(ms),
        max(ms) if ms else None,
        median(s.tokens_per_s for s in steps),
    )


def comm_share(ctx: Context) -> Section | None:
    """Share of training-step time with a collective in flight, per rank.

    Over time from per-step ``comm_ms`` in step records when they carry it, else from
    the watchdog's per-minute ``window`` records; per rank for the latest attempt from
    the recorder's cumulative totals in ``live.json``."""
    series = _comm_series(ctx)
    series += _window_series(
        ctx, "comm_share", 100.0, skip={str(s.attrs["data-rank"]) for s in series}
    )
    body = ""
    if series:
        body += svg.line_chart(
            series,
            title="communication share over time",
            x_label="time since start",
            y_label="comm share (%)",
            x_fmt=svg.fmt_elapsed,
            rules=_rules(ctx),
            x_range=_time_range(ctx),
            y_max=100.0,
        )
    bars = _comm_bars(ctx.live)
    if bars:
        body += svg.bar_chart(
            bars,
            title="communication share per rank",
            x_max=100.0,
            x_label="% of training-step time (latest attempt)",
        )
    tput = _window_series(ctx, "tokens_per_s", 1.0)
    if tput:
        body += "<h3>Throughput per window</h3>" + svg.line_chart(
            tput,
            title="throughput per rank",
            x_label="time since start",
            y_label="tokens/s of step time",
            x_fmt=svg.fmt_elapsed,
            rules=_rules(ctx),
            x_range=_time_range(ctx),
            layout=svg.Layout(height=220),
        )
    if not body:
        return None
    return Section(
        "comm",
        "Communication share",
        body,
        note="Share of training-step time with a collective in flight (steps that "
        "overlapped a checkpoint write are left out). DDP's gradient all-reduce "
        "overlaps the backward pass, so this bounds the time lost to "
        "communication from above.",
    )


def _comm_series(ctx: Context) -> list[svg.Series]:
    """Per rank, comm share over time from steps that carry ``comm_ms``."""
    series = []
    for rank, steps in sorted(ctx.tl.steps().items()):
        segs: dict[int, list[svg.Point]] = {}
        for s in steps:
            if s.comm_ms is not None and s.step_ms:
                segs.setdefault(s.attempt, []).append(
                    (ctx.elapsed(s.ts), 100.0 * s.comm_ms / s.step_ms)
                )
        if segs:
            attrs = {"data-rank": str(rank)}
            series.append(
                svg.Series(f"rank {rank}", svg.rank_color(rank), list(segs.values()), attrs=attrs)
            )
    return series


def _comm_bars(live: dict[int, dict[str, Any]]) -> list[svg.Bar]:
    """Per rank, compute vs communication share of the latest attempt (live totals)."""
    bars = []
    for rank, snap in live.items():
        tot = snap.get("totals") or {}
        train, comm = float(tot.get("train_s") or 0), float(tot.get("comm_s") or 0)
        if train <= 0:
            continue
        share = min(comm / train, 1.0)
        parts = (
            (100 * (1 - share), "#b0bec5", "compute"),
            (100 * share, svg.rank_color(rank), "communication"),
        )
        bars.append(
            svg.Bar(f"rank {rank}", parts, note=f"{share:.1%} of {int(tot.get('steps', 0))} steps")
        )
    return bars


def _window_series(
    ctx: Context, key: str, scale: float, skip: Collection[str] = ()
) -> list[svg.Series]:
    """One line per rank from the ``window`` records (a point at each window's end)."""
    per_rank: dict[int, dict[int, list[svg.Point]]] = {}
    for e in ctx.tl.of("window"):
        v, rank = e.get(key), e.get("rank")
        if (
            isinstance(v, (int, float))
            and isinstance(rank, int)
            and rank >= 0
            and str(rank) not in skip
        ):
            x = ctx.elapsed(float(e.get("t1") or e.ts))
            per_rank.setdefault(rank, {}).setdefault(e.attempt, []).append((x, scale * v))
    return [
        svg.Series(
            f"rank {r}",
            svg.rank_color(r),
            list(segs.values()),
            attrs={"data-rank": str(r), "data-window": key},
        )
        for r, segs in sorted(per_rank.items())
    ]


def loss_curve(ctx: Context) -> Section | None:
    steps = ctx.tl.steps()
    rank0 = steps.get(0) or next(iter(steps.values()), [])
    segs: dict[int, list[svg.Point]] = {}
    for s in rank0:
        if s.loss is not None:
            segs.setdefault(s.attempt, []).append((float(s.step), s.loss))
    series = [
        svg.Series(
            "train loss", svg.PALETTE[0], list(segs.values()), attrs={"data-series": "train"}
        )
    ]
    evals = [
        (float(e.get("step", 0)), float(e.get("loss")))
        for e in ctx.tl.of("eval")
        if isinstance(e.get("loss"), (int, float)) and e.rank in (0, -1)
    ]
    if evals:
        series.append(
            svg.Series(
                "eval loss", COLORS["eval"], [evals], dots=True, attrs={"data-series": "eval"}
            )
        )
    if not segs and not evals:
        return None
    return Section(
        "loss",
        "Loss",
        svg.line_chart(
            series, title="loss", x_label="step", y_label="loss (per target token)", x_integer=True
        ),
    )


def event_band(ctx: Context) -> Section | None:
    tl = ctx.tl
    if not tl.events:
        return None
    chart = svg.band_chart(
        _lanes(ctx),
        title="run timeline",
        x0=0.0,
        x1=tl.wall_s,
        x_fmt=svg.fmt_elapsed,
        x_label="time since start",
    )
    legend = " ".join(
        f'<span class="key" style="background:{c}"></span>{escape(n)}'
        for n, c in (
            ("completed", COLORS["ok"]),
            ("hung", COLORS["hung"]),
            ("failed", COLORS["failed"]),
            ("preempted", COLORS["preempted"]),
            ("checkpoint", COLORS["checkpoint"]),
            ("restart", COLORS["restart"]),
            ("straggler", COLORS["straggler"]),
            ("other alarm", COLORS["alarm"]),
        )
    )
    return Section(
        "timeline",
        "Timeline",
        chart + f'<p class="legend">{legend}</p>',
        note="Hover a mark for details.",
    )


def _lanes(ctx: Context) -> list[tuple[str, list[svg.Mark]]]:
    """The event band's lanes: attempts, checkpoints, restarts, preemptions, alarms, evals."""
    tl, at = ctx.tl, ctx.elapsed
    lanes: list[tuple[str, list[svg.Mark]]] = []
    if tl.attempts:
        lanes.append(("attempts", [_attempt_mark(ctx, a) for a in tl.attempts]))
    checkpoints = [
        svg.Mark(
            at(e.ts),
            COLORS["checkpoint"],
            f"checkpoint step {e.get('step')} "
            f"({e.get('reason')}), blocking {e.get('blocking_ms')} ms",
            kind="checkpoint",
        )
        for e in tl.checkpoints()
    ]
    restarts = [
        svg.Mark(
            at(e.ts),
            COLORS["restart"],
            f"restart {e.get('attempt')}: {e.get('reason')}",
            kind="restart",
        )
        for e in tl.restarts()
    ]
    preemptions = [
        svg.Mark(
            at(e.ts),
            COLORS["preempt"],
            f"preempted at step {e.get('step')}: "
            f"{e.get('reason', 'exit ' + str(e.get('exit_code')))}",
            kind="preempt",
        )
        for e in tl.preemptions()
    ]
    alarms = [
        svg.Mark(at(a.ts), _alarm_color(a), f"{a.kind}: {a.message}", kind=a.kind)
        for a in tl.alarms()
    ]
    lanes += [
        ("checkpoints", checkpoints),
        ("restarts", restarts),
        ("preemptions", preemptions),
        ("alarms", alarms),
    ]
    evals = [
        svg.Mark(
            at(e.ts),
            COLORS["eval"],
            f"eval step {e.get('step')}: loss {e.get('loss')}",
            kind="eval",
        )
        for e in tl.of("eval")
        if e.rank in (0, -1)
    ]
    if evals:
        lanes.append(("evals", evals))
    return lanes


def _attempt_mark(ctx: Context, a: Attempt) -> svg.Mark:
    color, what = _attempt_color(a, ctx.tl)
    end = (a.end if a.end is not None else ctx.tl.t1) or a.start
    return svg.Mark(
        ctx.elapsed(a.start),
        color,
        f"attempt {a.index}: {what}, {duration(end - a.start)}",
        x1=ctx.elapsed(end),
        kind="attempt",
    )


def alarms_table(ctx: Context) -> Section:
    alarms = ctx.tl.alarms()
    if not alarms:
        return Section(
            "alarms",
            "Alarms and verdicts",
            "<p>No alarms: no hang, straggler, degradation or checkpoint failure was recorded.</p>",
        )
    rows = [
        (
            f"+{svg.fmt_elapsed(ctx.elapsed(a.ts))}",
            a.attempt,
            a.kind,
            ", ".join(map(str, a.ranks)) or "—",
            a.collective or "—",
            a.message,
        )
        for a in alarms
    ]
    files = [
        str(a.event.get("verdict_file"))
        for a in alarms
        if a.event is not None and a.event.get("verdict_file")
    ]
    extra = ""
    if files:
        extra = (
            "<p>Verdicts with every rank's Python stacks: "
            + ", ".join(f"<code>{escape(f)}</code>" for f in files)
            + "</p>"
        )
    return Section(
        "alarms",
        "Alarms and verdicts",
        table(("when", "attempt", "kind", "rank(s)", "collective", "what"), rows, "alarms") + extra,
    )


def checkpoints_table(ctx: Context) -> Section | None:
    cks = ctx.tl.checkpoints()
    if not cks:
        return None
    rows = [
        (
            e.get("step"),
            e.get("reason"),
            f"+{svg.fmt_elapsed(ctx.elapsed(e.ts))}",
            e.attempt,
            e.get("format", "files"),
            fmt_bytes(e.get("bytes")),
            e.get("blocking_ms"),
            e.get("background_ms", e.get("seal_ms")),
            e.get("upload_ms"),
        )
        for e in cks
    ]
    resumes = [
        (
            e.get("from_step"),
            e.get("source"),
            e.get("steps_lost"),
            f"{e.get('from_world_size', '?')} → {e.get('world_size', '?')}",
        )
        for e in ctx.tl.of("resume")
        if e.rank in (0, -1)
    ]
    body = table(
        (
            "step",
            "reason",
            "when",
            "attempt",
            "format",
            "size",
            "blocking ms",
            "background / seal ms",
            "upload ms",
        ),
        rows,
    )
    if resumes:
        body += "<h3>Resumes</h3>" + table(
            ("from step", "source", "steps redone", "world size"), resumes
        )
    return Section("checkpoints", "Checkpoints and resumes", body)


def phases_table(ctx: Context) -> Section | None:
    rows = []
    for rank, snap in ctx.live.items():
        for phase, st in sorted((snap.get("stats") or {}).items()):
            if isinstance(st, dict):
                rows.append(
                    (
                        rank,
                        phase,
                        st.get("n"),
                        _ms(st.get("p50")),
                        _ms(st.get("p99")),
                        _ms(st.get("max")),
                    )
                )
    if not rows:
        return None
    return Section(
        "phases",
        "Phase durations (latest attempt)",
        table(("rank", "phase", "n", "p50 ms", "p99 ms", "max ms"), rows),
        note="From each rank's last live snapshot; the hang budgets are derived from these.",
    )


def _ms(s: Any) -> float | None:
    return float(s) * 1e3 if isinstance(s, (int, float)) else None


#: (series, title, y label, owner prefix, natural top of the scale)
METRIC_PLOTS = (
    ("cpu_pct", "CPU per rank process", "CPU (% of one core)", "rank ", None),
    ("rss_bytes", "resident memory per rank process", "RSS (bytes)", "rank ", None),
    ("util_pct", "GPU utilisation", "utilisation (%)", "gpu ", 100.0),
    ("mem_used_bytes", "GPU memory used", "memory (bytes)", "gpu ", None),
    ("cpu_pct", "host CPU", "CPU (% of all cores)", "host", 100.0),
)


def metrics(ctx: Context) -> Section | None:
    samples = ctx.tl.metrics()
    if not samples:
        return None
    charts = []
    for key, title, ylab, owner_prefix, y_max in METRIC_PLOTS:
        by_owner: dict[str, list[svg.Point]] = {}
        for s in samples:
            if s.series == key and s.owner.startswith(owner_prefix):
                by_owner.setdefault(s.owner, []).append((ctx.elapsed(s.ts), s.value))
        if not by_owner:
            continue
        series = []
        for i, (owner, pts) in enumerate(sorted(by_owner.items())):
            idx = int(owner.split()[-1]) if owner.split()[-1].isdigit() else i
            series.append(
                svg.Series(
                    owner,
                    svg.PALETTE[idx % len(svg.PALETTE)] if owner != "host" else "#555555",
                    [pts],
                    attrs={"data-owner": owner, "data-metric": key},
                )
            )
        charts.append(
            f"<h3>{escape(title)}</h3>"
            + svg.line_chart(
                series,
                title=title,
                x_label="time since start",
                y_label=ylab,
                x_fmt=svg.fmt_elapsed,
                rules=_rules(ctx),
                x_range=_time_range(ctx),
                layout=svg.Layout(height=220),
                y_max=y_max,
            )
        )
    if not charts:
        return None
    return Section(
        "metrics",
        "Host and GPU metrics",
        "".join(charts),
        note="Sampled by shoestring run from outside the training processes.",
    )


def sources(ctx: Context) -> Section:
    rows = [
        (
            str(s.path.relative_to(ctx.tl.run_dir))
            if s.path.is_relative_to(ctx.tl.run_dir)
            else str(s.path),
            s.lines,
            s.skipped,
        )
        for s in ctx.tl.sources
    ]
    skipped = ctx.tl.skipped_lines
    note = (
        f"{skipped} unreadable line(s) skipped (a writer killed mid-line leaves one torn "
        "last line)."
        if skipped
        else "Every line was read."
    )
    return Section("sources", "Sources", table(("file", "lines", "skipped"), rows), note=note)


DEFAULT_SECTIONS: tuple[SectionFn, ...] = (
    summary,
    cost_ledger,
    event_band,
    step_times,
    comm_share,
    loss_curve,
    alarms_table,
    checkpoints_table,
    metrics,
    phases_table,
    sources,
)

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#222;
  margin:0 auto;max-width:1140px;padding:16px 20px;background:#fafafa}
h1{font-size:22px;margin:4px 0 2px}h2{font-size:17px;margin:0 0 8px}
h3{font-size:14px;margin:12px 0 4px}
.sub{color:#666;margin:0 0 14px}
section{background:#fff;border:1px solid #e0e0e0;border-radius:6px;padding:12px 14px;
  margin:0 0 14px}
.note{color:#666;font-size:12px;margin:6px 0 0}
dl.summary{display:grid;grid-template-columns:repeat(3,auto 1fr);gap:4px 14px;margin:0}
dt{color:#666}dd{margin:0;font-weight:600;overflow-wrap:anywhere}
table{border-collapse:collapse;margin:8px 0;font-size:13px}
th,td{border-bottom:1px solid #eee;padding:3px 10px 3px 0;text-align:left;vertical-align:top}
th{color:#555;font-weight:600}
table.alarms td:last-child{max-width:620px}
svg{display:block;max-width:100%;height:auto}
.key{display:inline-block;width:12px;height:12px;border-radius:2px;margin:0 4px 0 10px;
  vertical-align:-1px}
code{font-size:12px;overflow-wrap:anywhere}
nav a{margin-right:12px;color:#1565c0;text-decoration:none}
"""


def render(
    tl: Timeline,
    sections: Sequence[SectionFn] = DEFAULT_SECTIONS,
    live: dict[int, dict[str, Any]] | None = None,
) -> str:
    """The whole page as one string."""
    ctx = Context(tl, live if live is not None else read_live(tl.run_dir))
    built = [s for s in (fn(ctx) for fn in sections) if s is not None]
    nav = "".join(f'<a href="#{escape(s.id)}">{escape(s.title)}</a>' for s in built)
    body = "".join(
        f'<section id="{escape(s.id)}"><h2>{escape(s.title)}</h2>{s.body}'
        + (f'<p class="note">{escape(s.note)}</p>' if s.note else "")
        + "</section>"
        for s in built
    )
    title = f"shoestring report: {tl.run_id}"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{CSS}</style></head><body>"
        f'<h1>{escape(title)}</h1><p class="sub">{escape(str(tl.run_dir))} · generated '
        f"{escape(utc(_dt.datetime.now(_dt.timezone.utc).timestamp()))}</p>"
        f"<nav>{nav}</nav>{body}</body></html>\n"
    )


def write_report(
    run_dir: str | Path,
    output: str | Path | None = None,
    sections: Sequence[SectionFn] = DEFAULT_SECTIONS,
    timeline: Timeline | None = None,
) -> Path:
    """Render ``run_dir`` (or its already loaded ``timeline``) to ``output`` (default
    ``RUN_DIR/report.html``), atomically: a reader never sees half a page."""
    run_dir = Path(run_dir)
    out = Path(output) if output is not None else run_dir / "report.html"
    page = render(timeline if timeline is not None else load(run_dir), sections)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, page.encode("utf-8"))
    return out
