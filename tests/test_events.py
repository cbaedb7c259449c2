"""The one reader of events.jsonl: torn lines, missing files, reading only the tail."""

from __future__ import annotations

import json
from pathlib import Path

from shoestring.events import EventLog, read_events
from shoestring.train.resume import last_logged_step


def test_a_torn_last_line_and_garbage_are_skipped(tmp_path: Path) -> None:
    p = tmp_path / "events.jsonl"
    log = EventLog(p, run_id="r")
    for step in range(1, 4):
        log.emit("step", step=step)
    log.close()
    with open(p, "ab") as f:
        f.write(b'not json\n\xff\xfe\n{"event": "step", "st')  # a crash mid-write
    assert [r["step"] for r in read_events(p)] == [1, 2, 3]
    assert list(read_events(tmp_path / "missing.jsonl")) == []


def test_tail_reads_only_the_end_and_drops_the_partial_first_line(tmp_path: Path) -> None:
    p = tmp_path / "events.jsonl"
    lines = [json.dumps({"event": "step", "step": i, "pad": "x" * 50}) for i in range(1000)]
    p.write_text("\n".join(lines) + "\n")
    tail = list(read_events(p, tail_bytes=10 * (len(lines[-1]) + 1) + 5))
    assert [r["step"] for r in tail] == list(range(990, 1000))
    assert last_logged_step(p) == 999
    assert last_logged_step(tmp_path / "none.jsonl") is None
