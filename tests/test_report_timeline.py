"""The report's reader and sections on hand-made event logs: attempts cut from the
supervisor's records, a torn last line, a preemption logged twice, alarms of kinds the
report has never heard of, metrics samples, escaping, and the pluggable section list."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from shoestring.cli import main
from shoestring.report.html import Context, Section, render, summary
from shoestring.report.timeline import load

T = 1_800_000_000.0


def rec(event: str, ts: float, rank: int = 0, **fields: Any) -> str:
    return (
        json.dumps(
            {"v": 1, "ts": T + ts, "event": event, "run_id": "abc123", "rank": rank, **fields}
        )
        + "\n"
    )


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """Attempt 0 is preempted at step 4 (exit 75), attempt 1 resumes and finishes step 8."""
    run = tmp_path / "run"
    (run / "ranks" / "rank1").mkdir(parents=True)
    r0 = [
        rec("attempt_start", 0, -1, attempt=0),
        rec("run_start", 10, 0, step=0, max_steps=8, model="tiny", world_size=2, strategy="ddp"),
    ]
    r1 = [rec("run_start", 10, 1, step=0, world_size=2)]
    for i in range(1, 5):
        r0.append(rec("step", 10 + i, 0, step=i, loss=5.0 - i / 2, step_ms=100.0 + i))
        r1.append(rec("step", 10 + i, 1, step=i, loss=5.0 - i / 2, step_ms=150.0 + i))
    r0 += [
        rec("checkpoint", 14.5, 0, step=4, reason="emergency", blocking_ms=12.5),
        rec("preempt", 14.6, 0, step=4, reason="SIGTERM", saved=True),
        rec(
            "metrics",
            14.7,
            -1,
            ranks={
                "0": {"cpu_pct": 90.0, "rss_bytes": 2e8},
                "1": {"cpu_pct": 80.0, "rss_bytes": 3e8},
            },
            gpus=[{"gpu": 0, "util_pct": 55.0, "mem_used_bytes": 1e9}],
        ),
        rec("attempt_end", 15, -1, attempt=0, exit_code=75, wall_s=15.0),
        rec("restart", 15.1, -1, attempt=1, exit_code=75, reason="preempted"),
        rec("attempt_start", 16, -1, attempt=1),
        rec("resume", 25, 0, from_step=4, steps_lost=0, source="local"),
        rec("run_start", 25, 0, step=4, max_steps=8, model="tiny", world_size=2, strategy="ddp"),
        rec("future_event_kind", 25.5, 0, whatever=1),
        # the watchdog's per-window statistics (its "rank" is the rank they are about)
        rec(
            "window",
            24,
            0,
            t0=T + 16,
            t1=T + 24,
            steps=6,
            tokens=600,
            train_s=0.6,
            comm_s=0.06,
            tokens_per_s=1000.0,
            comm_share=0.1,
        ),
        rec(
            "window",
            24,
            1,
            t0=T + 16,
            t1=T + 24,
            steps=6,
            tokens=600,
            train_s=0.9,
            comm_s=0.27,
            tokens_per_s=667.0,
            comm_share=0.3,
        ),
        rec(
            "window",
            29,
            1,
            t0=T + 24,
            t1=T + 29,
            steps=6,
            tokens=600,
            train_s=0.9,
            comm_s=0.36,
            tokens_per_s=667.0,
            comm_share=0.4,
        ),
        # the supervisor writes it, but an alarm's "rank" is the rank it is about
        rec(
            "alarm",
            26,
            1,
            kind="comm_degraded",
            message="comm per step +40% <script>alert(1)</script>",
        ),
    ]
    r1.append(rec("run_start", 25, 1, step=4, world_size=2))
    for i in range(5, 9):
        r0.append(rec("step", 21 + i, 0, step=i, loss=3.0 - i / 10, step_ms=100.0))
        r1.append(rec("step", 21 + i, 1, step=i, loss=3.0 - i / 10, step_ms=160.0))
        r0.append(
            rec(
                "metrics",
                21.5 + i,
                -1,
                ranks={
                    "0": {"cpu_pct": 95.0, "rss_bytes": 2e8},
                    "1": {"cpu_pct": 85.0, "rss_bytes": 3e8},
                },
                gpus=[{"gpu": 0, "util_pct": 60.0, "mem_used_bytes": 1e9}],
            )
        )
    r0 += [
        rec("eval", 30, 0, step=8, tag="after", loss=2.5, perplexity=12.2),
        rec("run_end", 30.5, 0, status="completed", step=8),
        rec("attempt_end", 31, -1, attempt=1, exit_code=0, wall_s=15.0),
    ]
    (run / "events.jsonl").write_text("".join(r0))
    # rank 1 was SIGKILLed mid-write once: a torn last line
    (run / "ranks" / "rank1" / "events.jsonl").write_text("".join(r1) + '{"v":1,"ts":18000')
    return run


def test_attempts_torn_line_preemption_and_alarms(run: Path) -> None:
    tl = load(run)
    assert tl.skipped_lines == 1 and tl.sources[1].skipped == 1
    assert [(a.index, a.exit_code, a.restart_reason) for a in tl.attempts] == [
        (0, 75, "preempted"),
        (1, 0, None),
    ]
    steps = tl.steps()
    assert [(s.attempt, s.step) for s in steps[1]] == [
        (0, 1),
        (0, 2),
        (0, 3),
        (0, 4),
        (1, 5),
        (1, 6),
        (1, 7),
        (1, 8),
    ]
    assert len(tl.preemptions()) == 1  # preempt record and exit 75 of the same attempt
    (alarm,) = tl.alarms()
    assert (alarm.kind, alarm.ranks, alarm.attempt) == ("comm_degraded", (1,), 1)
    assert tl.run_id == "abc123" and tl.world_size == 2 and tl.final_loss() == pytest.approx(2.2)
    assert {(m.series, m.owner) for m in tl.metrics()} >= {
        ("cpu_pct", "rank 0"),
        ("util_pct", "gpu 0"),
    }


def test_html_draws_each_attempt_escapes_and_plots_metrics(run: Path) -> None:
    page = render(load(run))
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    lines = re.findall(r'<polyline[^>]*points="([^"]*)"[^>]*data-rank="(\d)" data-x="time"', page)
    # one line per rank and attempt, 4 steps each
    assert sorted((r, len(p.split())) for p, r in lines) == [("0", 4), ("0", 4), ("1", 4), ("1", 4)]
    cpu = re.findall(r'points="([^"]*)"[^>]*data-owner="rank (\d)" data-metric="cpu_pct"', page)
    assert sorted((r, len(p.split())) for p, r in cpu) == [("0", 5), ("1", 5)]
    assert 'data-owner="gpu 0" data-metric="util_pct"' in page
    share = re.findall(r'points="([^"]*)"[^>]*data-rank="(\d)" data-window="comm_share"', page)
    assert sorted((r, len(p.split())) for p, r in share) == [("0", 1), ("1", 2)]
    assert re.search(r"<dt>preemptions</dt><dd>1</dd>", page)
    assert re.search(r"<dt>restarts</dt><dd>1</dd>", page)
    assert re.search(r"<dt>status</dt><dd>completed</dd>", page)
    assert "1 unreadable line(s) skipped" in page
    assert 'data-kind="preempt"' in page and 'data-kind="comm_degraded"' in page
    assert page.count('class="dots"') == 1  # the eval point on the loss plot


def test_sections_are_a_list_of_functions(run: Path) -> None:
    def ledger(ctx: Context) -> Section:
        return Section("ledger", "Cost ledger", f"<p>{len(ctx.tl.attempts)} attempts</p>")

    def absent(ctx: Context) -> None:
        return None

    page = render(load(run), sections=[summary, absent, ledger], live={})
    assert re.findall(r'<section id="([^"]+)">', page) == ["summary", "ledger"]
    assert '<a href="#ledger">Cost ledger</a>' in page and "<p>2 attempts</p>" in page


def test_without_supervisor_each_run_start_is_an_attempt(tmp_path: Path) -> None:
    run = tmp_path / "single"
    run.mkdir()
    (run / "events.jsonl").write_text(
        rec("run_start", 0, step=0, max_steps=4)
        + rec("step", 1, step=1, step_ms=5.0)
        + rec("step", 2, step=2, step_ms=5.0)
        + rec("run_start", 10, step=2, max_steps=4)
        + rec("step", 11, step=3, step_ms=5.0)
        + rec("run_end", 12, step=3)
    )
    tl = load(run)
    assert [(a.index, a.exit_code) for a in tl.attempts] == [(0, None), (1, 0)]
    assert [s.attempt for s in tl.steps()[0]] == [0, 0, 1]
    assert main(["report", str(run)]) == 0
    assert (run / "report.html").read_text().count('data-x="time"') == 2  # two segments


def test_report_cli_rejects_a_directory_without_events(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(tmp_path)]) == 2
    assert "no events.jsonl" in capsys.readouterr().err


def test_every_line_point_lies_inside_its_data_area(run: Path) -> None:
    page = render(load(run))
    svgs = re.findall(r"<svg .*?</svg>", page, re.S)
    assert len(svgs) >= 8
    checked = 0
    for s in svgs:
        x, y, w, h = (
            float(v)
            for v in re.search(
                r'<rect class="area" x="([\d.]+)" y="([\d.]+)" width="([\d.]+)" height="([\d.]+)"',
                s,
            ).groups()
        )
        for pts in re.findall(r'<polyline[^>]*points="([^"]*)"', s):
            for p in pts.split():
                px, py = map(float, p.split(","))
                assert x - 0.1 <= px <= x + w + 0.1 and y - 0.1 <= py <= y + h + 0.1, (p, s[:80])
                checked += 1
    assert checked > 50


def test_long_lines_are_decimated_but_keep_their_spikes() -> None:
    from shoestring.report.svg import decimate

    seg = [(float(i), 100.0 + (900.0 if i == 77_777 else i % 7)) for i in range(100_000)]
    out = decimate(seg, 1000)
    assert len(out) <= 4 * 1000 and max(p[1] for p in out) == 1000.0
    assert out[0] == seg[0] and out[-1] == seg[-1] and out == sorted(out)
    assert decimate(seg[:1500], 1000) == seg[:1500]  # short lines are drawn point by point


def test_an_attempt_begins_when_its_process_started(tmp_path: Path) -> None:
    """``start`` carries the process start: loading counts in the attempt, the wall time
    and the ledger's restart overhead; a process killed while loading is an attempt."""
    from shoestring.report.ledger import compute

    run = tmp_path / "loads"
    run.mkdir()
    (run / "events.jsonl").write_text(
        rec("start", 5, process_start=T + 0.0)  # logged 5 s after its process started
        + rec("load", 6, phase="data", seconds=1.0)
        + rec("load", 60, phase="model", seconds=54.0, read_s=20.0, quantize_s=34.0)
        + rec("run_start", 60, step=0, max_steps=4)
        + rec("step", 61, step=1, step_ms=5.0)
        + rec("step", 62, step=2, step_ms=5.0)
        + rec("start", 104, process_start=T + 100.0)  # killed while loading
        + rec("start", 204, process_start=T + 200.0)
        + rec("load", 210, phase="model", seconds=6.0, read_s=4.0, source="qbase-local")
        + rec("resume", 212, from_step=2, steps_lost=0)
        + rec("run_start", 212, step=2, max_steps=4)
        + rec("step", 220, step=3, step_ms=5.0)
        + rec("run_end", 221, step=3)
    )
    tl = load(run)
    assert [(a.index, a.start - T) for a in tl.attempts] == [(0, 0.0), (1, 100.0), (2, 200.0)]
    assert tl.t0 == T and tl.wall_s == 221.0
    # process start -> first step, and the whole attempt killed while loading
    assert compute(tl).restart_hours == pytest.approx((20.0 + 4.0) / 3600)
    assert main(["report", str(run)]) == 0
    html = (run / "report.html").read_text()
    assert (
        "#0: 61.0 s to the first step: data 1.0 s; model 54.0 s (read 20.0 s, quantize 34.0 s)"
        in html
    )
    assert "#2: 20.0 s to the first step: model 6.0 s (read 4.0 s, from qbase-local)" in html
