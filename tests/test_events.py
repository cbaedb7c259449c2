"""The one reader of events.jsonl: torn lines, missing files, reading only the tail."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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


def test_atomic_write_replaces_whole_and_leaves_no_temp_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from shoestring.fsio import atomic_write

    p = tmp_path / "run.json"
    atomic_write(p, b'{"a": 1}')
    atomic_write(p, b'{"a": 2}', durable=False)
    assert p.read_bytes() == b'{"a": 2}'
    assert [q.name for q in tmp_path.iterdir()] == ["run.json"]

    def fail(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="No space"):
        atomic_write(p, b'{"a": 3}')
    assert p.read_bytes() == b'{"a": 2}'  # the old content, whole
    assert [q.name for q in tmp_path.iterdir()] == ["run.json"]  # no temp file left


def test_a_full_disk_never_raises_out_of_the_event_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Writes that fail (ENOSPC) are reported once; close() does not raise them again
    and hide the job's own error behind a traceback."""
    import errno
    import io

    log = EventLog(tmp_path / "events.jsonl", run_id="r")

    class Full(io.StringIO):
        def write(self, s: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

    log._fh.close()
    log._fh = Full()  # type: ignore[assignment]
    log.emit("step", step=1)
    log.emit("step", step=2)
    log.close()  # must not raise
    err = capsys.readouterr().err
    assert err.count("No space left on device") == 1
