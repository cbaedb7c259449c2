"""Reading what the ranks publish while they run: ``ranks/rank<R>/live.json``, and
event logs that keep growing.

Read-only and best-effort: a snapshot is replaced atomically by its writer, but
it may be missing (the rank has not started), stale (the rank is frozen or gone)
or from an earlier attempt; callers see its ``ts`` and decide.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shoestring.rundir import RunDir


def read_live(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Every rank's latest snapshot, by rank."""
    out: dict[int, dict[str, Any]] = {}
    for p in RunDir(Path(run_dir)).live_files():
        try:
            snap = json.loads(p.read_text())
            rank = int(snap.get("rank", p.parent.name[4:]))
        except (OSError, ValueError, TypeError):
            continue
        if isinstance(snap, dict):
            out[rank] = snap
    return dict(sorted(out.items()))


class Tail:
    """Incremental reader of one JSONL file that may be growing.

    Each :meth:`read` returns the records appended since the last call. A line
    without its newline yet is left for the next call (a writer mid-append),
    except at :meth:`read` with ``final=True``, where it counts as torn. A
    file that shrank (replaced) is read again from the start.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.skipped = 0
        self._partial = b""

    def read(self, final: bool = False) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(0, 2)
                size = f.tell()
                if size < self.offset:
                    self.offset, self._partial = 0, b""
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        if final and self._partial.strip():
            lines.append(self._partial)
            self._partial = b""
        out = []
        for line in lines:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                self.skipped += 1
                continue
            if isinstance(rec, dict) and "event" in rec:
                out.append(rec)
            else:
                self.skipped += 1
        return out
