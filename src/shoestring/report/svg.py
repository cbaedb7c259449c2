"""Plots as inline SVG strings: line charts, horizontal bars and an event band.

Generated in Python so the report is one file that opens anywhere, offline,
forever (no JavaScript, no CDN). Every chart has a data area
(``<rect class="area">``) that holds only data marks; legends and labels sit
outside it, which is what lets a screenshot test say "the lines were drawn"
by looking for series colours inside that rectangle alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from html import escape

#: One colour per rank (cycled), chosen to stay apart on screen and in print.
PALETTE = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#9467bd",
    "#ff7f0e",
    "#17becf",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
)
GRID = "#e6e6e6"
AXIS = "#555555"
AREA_BG = "#ffffff"

Point = tuple[float, float]


def rank_color(rank: int) -> str:
    return PALETTE[rank % len(PALETTE)]


@dataclass
class Series:
    """A named line; each segment is drawn as its own polyline (gaps between attempts
    are not bridged). ``dots`` draws a marker at every point instead of a line."""

    name: str
    color: str
    segments: list[list[Point]] = field(default_factory=list)
    dots: bool = False
    attrs: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Rule:
    """A vertical line across the data area (a restart, a hang)."""

    x: float
    color: str
    label: str
    dash: bool = True


@dataclass(frozen=True)
class Layout:
    width: int = 1100
    height: int = 260
    left: int = 70
    right: int = 20
    top: int = 30
    bottom: int = 40

    @property
    def w(self) -> int:
        return self.width - self.left - self.right

    @property
    def h(self) -> int:
        return self.height - self.top - self.bottom


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round tick values covering [lo, hi] (1, 2, 5 × 10^k steps)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0]
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    ticks = [round(i * step, 10) for i in range(first, last + 1)]
    if len(ticks) < 2:
        ticks.append(round(ticks[-1] + step, 10))
    return ticks


def fmt_num(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e9:
        return f"{v / 1e9:g}G"
    if a >= 1e6:
        return f"{v / 1e6:g}M"
    if a >= 1e4:
        return f"{v / 1e3:g}k"
    return f"{v:g}"


def fmt_elapsed(s: float) -> str:
    s = max(0.0, s)
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{int(s // 60)}m{int(s % 60):02d}"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}"


def decimate(seg: Sequence[Point], buckets: int) -> list[Point]:
    """At most ~4 points per bucket (first, min, max, last; in x order) when a line has
    more points than ``2 * buckets``: a 100k-step run stays a small file, and a
    single slow step still shows as a spike. Shorter lines are returned whole."""
    if len(seg) <= 2 * buckets:
        return list(seg)
    x0, x1 = min(p[0] for p in seg), max(p[0] for p in seg)
    span = (x1 - x0) or 1.0
    groups: dict[int, list[Point]] = {}
    for p in seg:
        groups.setdefault(min(int((p[0] - x0) / span * buckets), buckets - 1), []).append(p)
    out: list[Point] = []
    for _, g in sorted(groups.items()):
        keep = {id(g[0]): g[0], id(g[-1]): g[-1]}
        lo, hi = min(g, key=lambda p: p[1]), max(g, key=lambda p: p[1])
        keep[id(lo)], keep[id(hi)] = lo, hi
        out.extend(p for p in g if id(p) in keep)
    return out


def _open_svg(lay: Layout, cls: str, label: str) -> list[str]:
    return [
        f'<svg class="{escape(cls)}" xmlns="http://www.w3.org/2000/svg" '
        f'width="{lay.width}" height="{lay.height}" viewBox="0 0 {lay.width} {lay.height}" '
        f'role="img" aria-label="{escape(label)}">',
        f'<rect class="area" x="{lay.left}" y="{lay.top}" width="{lay.w}" height="{lay.h}" '
        f'fill="{AREA_BG}" stroke="{AXIS}" stroke-width="1"/>',
    ]


def line_chart(
    series: Sequence[Series],
    *,
    title: str,
    x_label: str,
    y_label: str,
    x_fmt: Callable[[float], str] = fmt_num,
    y_fmt: Callable[[float], str] = fmt_num,
    rules: Sequence[Rule] = (),
    y_zero: bool = True,
    layout: Layout = Layout(),
    x_range: tuple[float, float] | None = None,
    x_integer: bool = False,
    y_max: float | None = None,
) -> str:
    """A multi-series line chart. Empty input gives a chart that says "no data".
    ``y_max`` is the natural top of the scale (100 for a percentage) unless data exceed it."""
    lay = layout
    pts = [p for s in series for seg in s.segments for p in seg]
    out = _open_svg(lay, "plot line-chart", title)
    if not pts:
        out.append(
            f'<text x="{lay.left + lay.w / 2}" y="{lay.top + lay.h / 2}" '
            f'text-anchor="middle" fill="{AXIS}">no data</text></svg>'
        )
        return "\n".join(out)
    xs = [p[0] for p in pts] + [r.x for r in rules]
    ys = [p[1] for p in pts]
    x0, x1 = x_range or (min(xs), max(xs))
    if x1 <= x0:
        x1 = x0 + 1
    y0, y1 = (min(0.0, min(ys)) if y_zero else min(ys)), max(ys)
    top = y_max if y_max is not None and y1 <= y_max else (y1 * 1.05 if y1 > 0 else y1 + 1)
    yt = nice_ticks(y0, top)
    y0, y1 = yt[0], yt[-1]
    xt = [t for t in nice_ticks(x0, x1, 8) if x0 <= t <= x1 and (not x_integer or t == int(t))]

    def px(x: float) -> float:
        return lay.left + (x - x0) / (x1 - x0) * lay.w

    def py(y: float) -> float:
        return lay.top + lay.h - (y - y0) / (y1 - y0) * lay.h

    out.extend(_grid(yt, xt, lay, px, py, x_fmt, y_fmt))
    out.extend(_rule_marks(rules, lay, px))
    for s in series:
        out.extend(_series_marks(s, lay, px, py))
    out.append(_legend(series, lay))
    out.append(_axis_labels(lay, x_label, y_label))
    out.append("</svg>")
    return "\n".join(out)


def _grid(
    yt: Sequence[float],
    xt: Sequence[float],
    lay: Layout,
    px: Callable[[float], float],
    py: Callable[[float], float],
    x_fmt: Callable[[float], str],
    y_fmt: Callable[[float], str],
) -> list[str]:
    """Grid lines with their tick labels."""
    out = [
        f'<line x1="{lay.left}" x2="{lay.left + lay.w}" y1="{py(t):.1f}" '
        f'y2="{py(t):.1f}" stroke="{GRID}"/>'
        f'<text x="{lay.left - 6}" y="{py(t) + 4:.1f}" text-anchor="end" '
        f'font-size="11" fill="{AXIS}">{escape(y_fmt(t))}</text>'
        for t in yt
    ]
    out += [
        f'<line x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{lay.top}" '
        f'y2="{lay.top + lay.h}" stroke="{GRID}"/>'
        f'<text x="{px(t):.1f}" y="{lay.top + lay.h + 15}" text-anchor="middle" '
        f'font-size="11" fill="{AXIS}">{escape(x_fmt(t))}</text>'
        for t in xt
    ]
    return out


def _axis_labels(lay: Layout, x_label: str, y_label: str) -> str:
    return (
        f'<text x="{lay.left + lay.w / 2}" y="{lay.height - 4}" text-anchor="middle" '
        f'font-size="12" fill="{AXIS}">{escape(x_label)}</text>'
        f'<text transform="translate(14,{lay.top + lay.h / 2}) rotate(-90)" '
        f'text-anchor="middle" font-size="12" fill="{AXIS}">{escape(y_label)}</text>'
    )


def _rule_marks(rules: Sequence[Rule], lay: Layout, px: Callable[[float], float]) -> list[str]:
    out = []
    for r in rules:
        dash = ' stroke-dasharray="5,4"' if r.dash else ""
        out.append(
            f'<line class="rule" x1="{px(r.x):.1f}" x2="{px(r.x):.1f}" y1="{lay.top}" '
            f'y2="{lay.top + lay.h}" stroke="{escape(r.color)}" stroke-width="1.5"{dash}>'
            f"<title>{escape(r.label)}</title></line>"
        )
    return out


def _series_marks(
    s: Series, lay: Layout, px: Callable[[float], float], py: Callable[[float], float]
) -> list[str]:
    """One series' dots or polylines (one per segment), decimated to the plot width."""
    out = []
    attrs = "".join(f' {escape(k)}="{escape(v)}"' for k, v in s.attrs.items())
    for seg in s.segments:
        if not seg:
            continue
        seg = decimate(seg, lay.w)
        if s.dots:
            out.append(
                f'<g class="dots" fill="{escape(s.color)}"{attrs}>'
                + "".join(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3.5"/>' for x, y in seg)
                + f"<title>{escape(s.name)}</title></g>"
            )
            continue
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in seg)
        out.append(
            f'<polyline class="series" fill="none" stroke="{escape(s.color)}" '
            f'stroke-width="2" stroke-linejoin="round" points="{coords}"{attrs}>'
            f"<title>{escape(s.name)}</title></polyline>"
        )
        if len(seg) == 1:  # a one-point line draws nothing: mark the point
            out.append(
                f'<circle class="lone" cx="{px(seg[0][0]):.1f}" '
                f'cy="{py(seg[0][1]):.1f}" r="2.5" fill="{escape(s.color)}"/>'
            )
    return out


def _legend(series: Sequence[Series], lay: Layout) -> str:
    """Above the data area, right-aligned: never inside it."""
    parts, x = [], lay.left + lay.w
    for s in reversed(series):
        label = escape(s.name)
        w = 24 + 7 * len(s.name)
        x -= w
        parts.append(
            f'<rect x="{x}" y="{lay.top - 20}" width="14" height="10" '
            f'fill="{escape(s.color)}"/><text x="{x + 18}" y="{lay.top - 11}" '
            f'font-size="11" fill="{AXIS}">{label}</text>'
        )
    return '<g class="legend">' + "".join(parts) + "</g>"


@dataclass(frozen=True)
class Bar:
    """One horizontal bar of stacked parts ``(value, colour, name)``."""

    label: str
    parts: tuple[tuple[float, str, str], ...]
    note: str = ""


def bar_chart(
    bars: Sequence[Bar],
    *,
    title: str,
    x_label: str,
    x_max: float | None = None,
    x_fmt: Callable[[float], str] = fmt_num,
    width: int = 1100,
) -> str:
    row = 26
    lay = Layout(width=width, height=30 + 40 + row * max(len(bars), 1), left=90, right=160)
    out = _open_svg(lay, "plot bar-chart", title)
    total = max([sum(v for v, _, _ in b.parts) for b in bars] + [x_max or 0.0, 1e-12])
    top = x_max or total
    for t in nice_ticks(0, top, 5):
        if t > top * 1.0001:
            continue
        x = lay.left + t / top * lay.w
        out.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{lay.top}" y2="{lay.top + lay.h}" '
            f'stroke="{GRID}"/><text x="{x:.1f}" y="{lay.top + lay.h + 15}" '
            f'text-anchor="middle" font-size="11" fill="{AXIS}">{escape(x_fmt(t))}</text>'
        )
    for i, b in enumerate(bars):
        y = lay.top + 6 + i * row
        x = float(lay.left)
        out.append(
            f'<text x="{lay.left - 8}" y="{y + 13}" text-anchor="end" font-size="12" '
            f'fill="{AXIS}">{escape(b.label)}</text>'
        )
        for v, color, name in b.parts:
            w = max(0.0, v / top * lay.w)
            out.append(
                f'<rect class="bar" x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 8}" '
                f'fill="{escape(color)}"><title>{escape(f"{b.label} {name}: {x_fmt(v)}")}'
                f"</title></rect>"
            )
            x += w
        if b.note:
            out.append(
                f'<text x="{lay.left + lay.w + 8}" y="{y + 13}" font-size="12" '
                f'fill="{AXIS}">{escape(b.note)}</text>'
            )
    out.append(
        _legend(
            [
                Series(name, color)
                for name, color in dict((n, c) for b in bars for _, c, n in b.parts).items()
            ],
            lay,
        )
    )
    out.append(
        f'<text x="{lay.left + lay.w / 2}" y="{lay.height - 4}" text-anchor="middle" '
        f'font-size="12" fill="{AXIS}">{escape(x_label)}</text></svg>'
    )
    return "\n".join(out)


@dataclass(frozen=True)
class Mark:
    """Something on the event band: a span (``x1`` set) or an instant."""

    x: float
    color: str
    label: str
    x1: float | None = None
    kind: str = ""


def band_chart(
    lanes: Sequence[tuple[str, Sequence[Mark]]],
    *,
    title: str,
    x0: float,
    x1: float,
    x_fmt: Callable[[float], str] = fmt_num,
    x_label: str = "",
    width: int = 1100,
) -> str:
    """Lanes of spans and instants over one time axis (attempts, checkpoints, alarms)."""
    row = 28
    lay = Layout(width=width, height=30 + 40 + row * len(lanes), left=110, right=20)
    if x1 <= x0:
        x1 = x0 + 1
    x1 += (x1 - x0) * 0.015  # room for a mark at the very end
    out = _open_svg(lay, "plot band-chart", title)

    def px(x: float) -> float:
        return lay.left + (min(max(x, x0), x1) - x0) / (x1 - x0) * lay.w

    for t in nice_ticks(x0, x1, 8):
        if x0 <= t <= x1:
            out.append(
                f'<line x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{lay.top}" '
                f'y2="{lay.top + lay.h}" stroke="{GRID}"/><text x="{px(t):.1f}" '
                f'y="{lay.top + lay.h + 15}" text-anchor="middle" font-size="11" '
                f'fill="{AXIS}">{escape(x_fmt(t))}</text>'
            )
    for i, (name, marks) in enumerate(lanes):
        y = lay.top + i * row
        out.append(
            f'<text x="{lay.left - 8}" y="{y + row / 2 + 4}" text-anchor="end" '
            f'font-size="12" fill="{AXIS}">{escape(name)}</text>'
        )
        if i:
            out.append(
                f'<line x1="{lay.left}" x2="{lay.left + lay.w}" y1="{y}" y2="{y}" stroke="{GRID}"/>'
            )
        out.extend(_band_mark(m, px, y, row) for m in marks)
    if x_label:
        out.append(
            f'<text x="{lay.left + lay.w / 2}" y="{lay.height - 4}" text-anchor="middle" '
            f'font-size="12" fill="{AXIS}">{escape(x_label)}</text>'
        )
    out.append("</svg>")
    return "\n".join(out)


def _band_mark(m: Mark, px: Callable[[float], float], y: float, row: int) -> str:
    """A span (rect) or an instant (diamond) in a band lane starting at ``y``."""
    kind = f' data-kind="{escape(m.kind)}"' if m.kind else ""
    tip = f"<title>{escape(m.label)}</title>"
    if m.x1 is not None:
        return (
            f'<rect class="mark span"{kind} x="{px(m.x):.1f}" y="{y + 5}" '
            f'width="{max(px(m.x1) - px(m.x), 2):.1f}" height="{row - 10}" '
            f'fill="{escape(m.color)}" rx="3">{tip}</rect>'
        )
    cx, cy = px(m.x), y + row / 2
    return (
        f'<path class="mark point"{kind} d="M{cx:.1f},{cy - 8:.1f} '
        f"L{cx + 6:.1f},{cy:.1f} L{cx:.1f},{cy + 8:.1f} "
        f'L{cx - 6:.1f},{cy:.1f} Z" '
        f'fill="{escape(m.color)}">{tip}</path>'
    )
