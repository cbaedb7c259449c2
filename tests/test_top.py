"""``shoestring top`` from hand-made run directories and a fixed clock: what each rank
is doing, how long it has been stuck, which collective it waits in, and its alarms."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from shoestring.cli import main
from shoestring.report.live import Tail
from shoestring.report.top import RESET, Top, _clip

NOW = 1_800_000_000.0


def rec(event: str, ts: float, rank: int = 0, **fields: Any) -> str:
    return (
        json.dumps({"v": 1, "ts": ts, "event": event, "run_id": "r1", "rank": rank, **fields})
        + "\n"
    )


def live(run: Path, rank: int, **snap: Any) -> None:
    d = run / "ranks" / f"rank{rank}"
    d.mkdir(parents=True, exist_ok=True)
    base = {
        "rank": rank,
        "world_size": 2,
        "pid": 1,
        "host": "h",
        "status": "running",
        "step": 0,
        "phase": "idle",
        "phase_start": NOW,
        "open_collectives": [],
        "stats": {},
        "totals": {},
    }
    (d / "live.json").write_text(json.dumps({**base, **snap}))


@pytest.fixture
def run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "ranks" / "rank1").mkdir(parents=True)
    t = NOW - 60
    lines = [
        rec("attempt_start", t, -1, attempt=0),
        rec(
            "run_start",
            t + 1,
            0,
            step=0,
            max_steps=100,
            model="/m/tiny",
            world_size=2,
            strategy="ddp",
        ),
    ]
    lines += [
        rec("step", t + 2 + i, 0, step=i + 1, step_ms=ms)
        for i, ms in enumerate([100.0, 300.0, 200.0])
    ]
    lines += [rec("checkpoint", t + 5, 0, step=3, reason="steps")]
    lines += [
        rec(
            "hang",
            NOW - 0.5,
            -1,
            kind="stuck_rank",
            culprits=[1],
            summary="rank 1 in data for 12.0s",
            collective={"seq": 42, "op": "allreduce[ddp]"},
        )
    ]
    (run / "events.jsonl").write_text("".join(lines))
    (run / "ranks" / "rank1" / "events.jsonl").write_text(
        rec("run_start", t + 1, 1, step=0, world_size=2)
        + rec("step", t + 2, 1, step=1, step_ms=110.0)
    )
    live(
        run,
        0,
        ts=NOW - 0.2,
        step=3,
        phase="train_step",
        phase_start=NOW - 1.5,
        open_collectives=[{"seq": 42, "op": "allreduce[ddp]", "start": NOW - 1.2}],
    )
    live(run, 1, ts=NOW - 8, step=1, phase="data", phase_start=NOW - 12)
    return run


def row(frame: str, rank: int) -> str:
    (line,) = [ln for ln in frame.splitlines() if re.match(rf"\s+{rank}\s", ln)]
    return line


def test_frame_shows_phase_step_times_collective_and_alarm(run: Path) -> None:
    top = Top(run)
    top.poll()
    frame = top.frame(NOW, width=200)
    r0, r1 = row(frame, 0), row(frame, 1)
    assert re.search(
        r"running\s+train_step 1\.5s\s+3\s+200\s+200\s+56\.0s\s+"
        r"allreduce\[ddp\] #42 1\.2s",
        r0,
    ), r0
    # Rank 1's snapshot is 8 s old while the job runs: stale, frozen at its last word.
    assert re.search(r"stale\s+data 4\.0s\s+1\s+110\s+110\s+-\s+hang/stuck_rank$", r1), r1
    assert "attempt 0 | restarts 0" in frame and "step 3/100" in frame
    assert "last checkpoint step 3, 55.0s ago" in frame
    assert "hang/stuck_rank  rank 1  [allreduce[ddp] #42]  rank 1 in data for 12.0s" in frame


def test_median_covers_the_current_attempt_only(run: Path) -> None:
    top = Top(run)
    top.poll()
    with open(run / "events.jsonl", "a") as f:
        f.write(
            rec("restart", NOW + 1, -1, attempt=1, reason="hang")
            + rec("attempt_start", NOW + 2, -1, attempt=1)
            + rec("run_start", NOW + 20, 0, step=3, max_steps=100, world_size=2)
            + rec("step", NOW + 21, 0, step=4, step_ms=1000.0)
        )
    top.poll()
    frame = top.frame(NOW + 22, width=200)
    assert "attempt 1 | restarts 1 (last: hang)" in frame
    assert re.search(r"\s4\s+1000\s+1000\s", row(frame, 0))
    # Rank 1's snapshot predates this attempt: not shown as its current state.
    assert row(frame, 1).split()[1] == "previous"
    assert "hang/stuck_rank" not in row(frame, 1)  # alarms of the earlier attempt leave the row


def test_tail_waits_for_a_whole_line_and_counts_torn_ones(tmp_path: Path) -> None:
    p = tmp_path / "events.jsonl"
    p.write_text(rec("step", 1.0, step=1) + '{"v":1,"ts":2.0,"event":"st')
    t = Tail(p)
    assert [r["step"] for r in t.read()] == [1] and t.skipped == 0  # half a line: wait
    with open(p, "a") as f:
        f.write('ep","rank":0,"step":2}\n')
    assert [r["step"] for r in t.read()] == [2]
    with open(p, "a") as f:  # a writer killed mid-line; the next one starts a fresh line
        f.write('{"v":1,"ts":3.0,"ev\n' + rec("step", 4.0, step=4))
    assert [r["step"] for r in t.read()] == [4] and t.skipped == 1


def test_clip_counts_visible_characters_only() -> None:
    s = "\x1b[31mabcdef\x1b[0m ghi"
    assert _clip(s, 4) == "\x1b[31mabcd" + RESET
    assert _clip("plain text", 5) == "plain"


def test_cli_once_colour_switch_and_bad_dir(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["top", str(run), "--once", "--color", "always"]) == 0
    assert "\x1b[31m" in capsys.readouterr().out  # the alarm in red
    assert main(["top", str(run), "--once", "--color", "never"]) == 0
    assert "\x1b[" not in capsys.readouterr().out
    assert main(["top", str(tmp_path / "nope"), "--once"]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_live_loop_redraws_until_interrupted(run: Path) -> None:
    import io

    from shoestring.report.top import run_top

    out, naps = io.StringIO(), []

    def sleep(s: float) -> None:
        naps.append(s)
        if len(naps) == 3:
            raise KeyboardInterrupt

    assert (
        run_top(
            run,
            once=False,
            interval_s=0.5,
            color=False,
            width=lambda: 100,
            out=out,
            clock=lambda: NOW,
            sleep=sleep,
        )
        == 0
    )
    text = out.getvalue()
    assert naps == [0.5, 0.5, 0.5] and text.count("\x1b[H\x1b[2J") == 3
    assert text.startswith("\x1b[?25l") and text.endswith("\x1b[?25h")  # cursor restored
    assert all(len(line) <= 100 for line in text.replace("\x1b[H\x1b[2J", "\n").splitlines()[1:])


def test_a_loading_attempt_shows_its_process_start_and_phases(tmp_path: Path) -> None:
    run = tmp_path / "loading"
    run.mkdir()
    (run / "events.jsonl").write_text(
        rec("start", NOW - 400, process_start=NOW - 412.0, pid=7)
        + rec("load", NOW - 398, phase="data", seconds=2.0)
        + rec("load", NOW - 10, phase="model", seconds=388.0, read_s=90.0, quantize_s=298.0)
    )
    top = Top(run)
    top.poll()
    frame = top.frame(NOW)
    assert "| loading" in frame.splitlines()[1]
    assert (
        "load  process started 6m52s ago | data 2.0 s | model 388.0 s (read 90.0 s, "
        "quantize 298.0 s)" in frame
    )
    with open(run / "events.jsonl", "a") as f:  # the next attempt starts over
        f.write(rec("start", NOW - 5, process_start=NOW - 6.0, pid=8))
    top.poll()
    assert "load  process started 6.0s ago | ..." in top.frame(NOW)


def test_a_file_is_read_in_its_writers_order_whatever_its_clock_says(tmp_path: Path) -> None:
    # The supervisor wrote attempt_end, then gave_up; the wall clock stepped back between
    # them. The job gave up: its last word is the status, not the earlier record.
    run = tmp_path / "stepped"
    (run / "ranks" / "rank1").mkdir(parents=True)
    (run / "events.jsonl").write_text(
        rec("attempt_start", NOW - 60, rank=-1, attempt=0)
        + rec("run_start", NOW - 50, max_steps=8, world_size=2)
        + rec("attempt_end", NOW - 10.0, rank=-1, attempt=0, exit_code=-9)
        + rec("gave_up", NOW - 10.2, rank=-1, attempts=1, exit_code=-9)
    )
    (run / "ranks" / "rank1" / "events.jsonl").write_text(
        rec("run_start", NOW - 50, rank=1) + rec("step", NOW - 30, rank=1, step=5)
    )
    top = Top(run)
    top.poll()
    assert top.frame(NOW).splitlines()[1].endswith("| gave up")
