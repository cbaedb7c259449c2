"""The event log: ``RUN_DIR/events.jsonl``, one JSON object per line.

Every pillar writes here and every view (``top``, ``report``, the cost ledger)
reads from here, so the schema is versioned and documented in
``docs/events.md``. Records are appended with one ``write`` of a whole line and
flushed, so a reader never sees half a record from a live writer, and a record
cut by a kill is only ever the last line (readers skip it).

The log never shrinks, so it is rotated at start (:func:`rotate`, by the one process
holding the run directory) once it passes a size: ``events.jsonl`` becomes
``events.N.jsonl`` and a new file begins. Nothing is dropped: readers of the whole
history read :func:`segments` in order; a start reads only the recent tail
(:func:`read_tail`). Values with credentials (URLs) are redacted before they are written.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from shoestring.fsio import fsync_dir
from shoestring.secrets import redact

SCHEMA_VERSION = 1


class EventLog:
    """Append-only JSONL writer shared by the training thread and the checkpoint writer."""

    def __init__(
        self, path: str | Path, *, run_id: str, rank: int = 0, clock: Any = time.time
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id
        self.rank = rank
        self._clock = clock
        self._lock = threading.Lock()
        self._write_failed = False
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self._fh = open(self.path, "a", encoding="utf-8")
        self._repair_tail()

    def _repair_tail(self) -> None:
        # A kill can cut the last line; start our records on a fresh line.
        size = self.path.stat().st_size
        if size:
            with open(self.path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    self._fh.write("\n")
                    self._fh.flush()

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        rec: dict[str, Any] = {
            "v": SCHEMA_VERSION,
            "ts": round(self._clock(), 6),
            "event": event,
            "run_id": self.run_id,
            "rank": self.rank,
        }
        rec.update(fields)
        line = json.dumps(rec, separators=(",", ":"), default=str) + "\n"
        if "://" in line:  # a URL: no credential is written down (nor handed to trackers)
            rec = redact(rec)
            line = json.dumps(rec, separators=(",", ":"), default=str) + "\n"
        with self._lock:
            if not self._fh.closed:
                try:
                    self._fh.write(line)
                    self._fh.flush()
                except OSError as e:
                    # A full or broken log disk must not kill training; say so once.
                    if not self._write_failed:
                        self._write_failed = True
                        print(
                            f"[shoestring] WARNING cannot write {self.path}: {e}",
                            file=sys.stderr,
                            flush=True,
                        )
        for listener in self._listeners:
            listener(rec)
        return rec

    def add_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Also hand every record written from now on to ``listener`` (on the emitting
        thread, after the write: it must be quick and must not raise, e.g. a queue put)."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        self._listeners.remove(listener)

    def sync(self) -> None:
        with self._lock:
            if not self._fh.closed:
                self._fh.flush()
                os.fsync(self._fh.fileno())

    def close(self) -> None:
        """Close the file. Lines a full disk refused were already reported by
        :meth:`emit`; closing does not raise them again (that would replace the job's
        own, clearer error with a traceback)."""
        with self._lock:
            if not self._fh.closed:
                try:
                    self._fh.close()  # flushes what a failed write left buffered
                except OSError as e:
                    if not self._write_failed:
                        print(
                            f"[shoestring] WARNING cannot write {self.path}: {e}",
                            file=sys.stderr,
                            flush=True,
                        )
                    self._write_failed = True

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_events(path: str | Path, *, tail_bytes: int | None = None) -> Iterator[dict[str, Any]]:
    """Yield the records of an event log, skipping a torn last line (and any line that
    is not JSON). A missing file has no records. ``tail_bytes``: read only the last N
    bytes (the first, partial line is dropped), so the cost does not grow with the log."""
    try:
        with open(path, "rb") as f:
            if tail_bytes is not None:
                f.seek(0, os.SEEK_END)
                start = max(f.tell() - tail_bytes, 0)
                f.seek(start)
                if start:
                    f.readline()  # the partial line the seek landed in
            raw = f.read()
    except FileNotFoundError:
        return
    for line in raw.decode("utf-8", "replace").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            yield rec


_SEGMENT = re.compile(r"^(?P<stem>.+)\.(?P<n>\d+)(?P<suffix>\.jsonl)$")


def segments(path: str | Path) -> list[Path]:
    """The rotated segments of the log at ``path``, oldest first, then ``path`` itself:
    ``events.1.jsonl``, ``events.2.jsonl``, ..., ``events.jsonl`` (missing ones left out).
    A reader of the whole history reads them in this order."""
    path = Path(path)
    found: list[tuple[int, Path]] = []
    stem, suffix = path.stem, path.suffix
    try:
        names = os.listdir(path.parent)
    except OSError:
        names = []
    for name in names:
        m = _SEGMENT.match(name)
        if m and m.group("stem") == stem and m.group("suffix") == suffix:
            found.append((int(m.group("n")), path.parent / name))
    out = [p for _, p in sorted(found)]
    return out + ([path] if path.exists() else [])


def rotate(path: str | Path, max_bytes: int) -> Path | None:
    """Start a new segment when the log at ``path`` has grown past ``max_bytes``: rename
    it to the next ``<stem>.<N>.jsonl`` (one atomic rename: nothing is lost or copied).
    Call it only where no one else writes the log (at start, under the run directory's
    lock, before the log is opened). Returns the segment, or None."""
    path = Path(path)
    try:
        if path.stat().st_size <= max_bytes:
            return None
    except FileNotFoundError:
        return None
    last = [_SEGMENT.match(p.name) for p in segments(path)[:-1]]
    n = max((int(m.group("n")) for m in last if m), default=0) + 1
    dest = path.with_name(f"{path.stem}.{n}{path.suffix}")
    os.rename(path, dest)
    fsync_dir(path.parent)
    return dest


def read_tail(path: str | Path, tail_bytes: int) -> Iterator[dict[str, Any]]:
    """The records in the last ``tail_bytes`` of the log's history (its rotated segments
    and the live file), oldest first: what recent history a start needs (the last
    logged step, the failures of recent attempts), at a cost independent of the log's
    length and of when it was last rotated."""
    chosen: list[tuple[Path, int | None]] = []
    budget = tail_bytes
    for seg in reversed(segments(path)):
        try:
            size = seg.stat().st_size
        except OSError:
            continue
        chosen.append((seg, None if size <= budget else budget))
        budget -= size
        if budget <= 0:
            break
    for seg, tail in reversed(chosen):
        yield from read_events(seg, tail_bytes=tail)
