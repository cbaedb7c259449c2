"""The run directory: the contract between every pillar and every view.

One type names each path, so the layout is written down once::

    OUTPUT/run.json                 stable run_id
    OUTPUT/config.yaml              the resolved config
    OUTPUT/events.jsonl             rank 0's (and the supervisor's) event log
    OUTPUT/ranks/rank<R>/           other ranks' events.jsonl, every rank's live.json
                                    and stacks; NCCL flight-recorder pipes
    OUTPUT/attempts/                event logs of attempts on other machines (from the bucket)
    OUTPUT/verdicts/                hang verdicts with stacks and flight-recorder dumps
    OUTPUT/checkpoints/step-N/      committed checkpoints (the local cache)
    OUTPUT/final/, OUTPUT/merged/   exports
    OUTPUT/.lock                    held (fcntl) by the one process that runs the job
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoestring.config import ConfigError
from shoestring.dircommit import LockHeld, held_lock

EVENTS = "events.jsonl"
LIVE = "live.json"
LOCK = ".lock"


class RunDirBusy(ConfigError):
    """Another live process holds the run directory (exit 2, naming it)."""


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def events(self) -> Path:
        return self.root / EVENTS

    @property
    def run_json(self) -> Path:
        return self.root / "run.json"

    @property
    def config_yaml(self) -> Path:
        return self.root / "config.yaml"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def attempts(self) -> Path:
        """Event logs of attempts on other machines, copied from checkpoint.storage
        (``checkpoint/attemptlog.py``): read with the run's own by every view."""
        return self.root / "attempts"

    @property
    def ranks(self) -> Path:
        return self.root / "ranks"

    @property
    def verdicts(self) -> Path:
        return self.root / "verdicts"

    def rank_dir(self, rank: int) -> Path:
        return self.ranks / f"rank{rank}"

    def rank_events(self, rank: int) -> Path:
        """Where ``rank`` logs: rank 0 owns ``events.jsonl``, the others log beside it."""
        return self.events if rank == 0 else self.rank_dir(rank) / EVENTS

    def live(self, rank: int) -> Path:
        return self.rank_dir(rank) / LIVE

    def live_files(self) -> Iterator[Path]:
        return self.ranks.glob(f"rank*/{LIVE}")

    def event_files(self) -> list[Path]:
        """Every event log of the run: rank 0's first, then the other ranks'."""
        return [self.events, *sorted(self.ranks.glob(f"rank*/{EVENTS}"))]

    def run_id(self) -> str | None:
        """The stable run id from ``run.json`` (None before the first start)."""
        try:
            return str(json.loads(self.run_json.read_text())["run_id"])
        except (OSError, ValueError, KeyError):
            return None

    def record(self, **fields: Any) -> None:
        """Add (replace) top-level ``fields`` in ``run.json``, atomically (e.g. ``model``:
        where the base model came from and which commit or digest it resolved to)."""
        from shoestring.fsio import atomic_write

        try:
            doc = json.loads(self.run_json.read_text())
        except (OSError, ValueError):
            doc = {}
        atomic_write(self.run_json, json.dumps({**doc, **fields}).encode())


@contextlib.contextmanager
def hold(root: Path, what: str) -> Iterator[None]:
    """Hold ``root/.lock`` for the life of the block: an exclusive ``flock`` that the
    kernel drops when the process dies (a SIGKILLed run leaves no stale lock; over NFS
    Linux maps it to a POSIX lock). A second holder is refused at once with
    :class:`RunDirBusy` naming the first one's pid and host. A directory this call
    created and the job left empty (refused bad input, say) is removed again."""
    created = not root.exists()
    with contextlib.ExitStack() as lock:
        try:
            root.mkdir(parents=True, exist_ok=True)
            lock.enter_context(held_lock(root / LOCK, wait=False))
        except LockHeld as e:
            raise RunDirBusy(f"{root} is in use: {e.holder}; {what}") from None
        except OSError as e:  # a file in the way, no permission, a read-only or full disk
            why = "exists and is not a directory" if root.exists() and not root.is_dir() else None
            raise ConfigError(
                f"{root}: cannot be used as the run directory: {why or e.strerror or e}"
            ) from None
        try:
            yield
        finally:
            if created:  # removed while still held
                _remove_if_unused(root)


def require_writable(root: Path) -> None:
    """Refuse (:class:`ConfigError`, naming the path) a run directory the job could not
    write into — a read-only mount, a folder without write permission, an event log it
    cannot append to — when the job starts, not at its first save. Probes the directory,
    each folder in it that a run writes into (``checkpoints/``, ``ranks/`` and the rank
    folders, exports; not hidden ones) and every event log, with a temp file each."""
    subdirs = [p for p in sorted(root.iterdir()) if _is_run_folder(p)]
    if (root / "ranks").is_dir():
        subdirs += [p for p in sorted((root / "ranks").iterdir()) if _is_run_folder(p)]
    for folder in [root, *subdirs]:
        try:
            fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=folder)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise ConfigError(
                f"{folder}: cannot be written ({e.strerror or e}); the run directory must be "
                "writable"
            ) from None
    for log in RunDir(root).event_files():
        try:
            if log.exists():
                os.close(os.open(log, os.O_WRONLY | os.O_APPEND))
        except OSError as e:
            raise ConfigError(
                f"{log}: cannot be appended to ({e.strerror or e}); the run directory must be "
                "writable"
            ) from None


def _is_run_folder(p: Path) -> bool:
    return p.is_dir() and not p.is_symlink() and not p.name.startswith(".")


def _remove_if_unused(root: Path) -> None:
    with contextlib.suppress(OSError):
        if os.listdir(root) == [LOCK]:
            os.unlink(root / LOCK)
            root.rmdir()
