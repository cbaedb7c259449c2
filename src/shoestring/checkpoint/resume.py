"""Choosing the checkpoint to resume from: ``--resume auto|never|PATH``.

``auto`` walks committed checkpoints newest first across the local cache and
the remote store. A local copy that fails verification is quarantined and a
warning is logged; the remote copy of the same step is tried next, then older
steps. A checkpoint without a valid manifest is never loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from shoestring.checkpoint.local import committed_steps, quarantine, step_dirname
from shoestring.checkpoint.manifest import CorruptCheckpoint, Manifest, verify_dir
from shoestring.checkpoint.remote import RemoteStore
from shoestring.events import EventLog

log = logging.getLogger("shoestring.checkpoint")


@dataclass
class ResumePoint:
    step: int
    path: Path
    manifest: Manifest
    source: str  # "local", "remote" or "path"


Complete = Callable[[Manifest], None]


def find_resume_point(
    resume: str,
    root: Path,
    remote: RemoteStore | None,
    *,
    verify: bool,
    events: EventLog,
    complete: Complete = lambda m: None,
    exclude: Collection[int] = (),
) -> ResumePoint | None:
    """The newest valid checkpoint (local or in ``remote``), or the one ``resume`` names.
    Valid: it verifies against its manifest and ``complete`` (the job's own check that
    every file it needs is listed) does not raise :class:`CorruptCheckpoint`; an invalid
    one is quarantined (locally), logged as ``checkpoint_invalid``, and the next older
    one is tried. Steps in ``exclude`` (ones that failed to load) are skipped."""
    if resume == "never":
        return None
    if resume != "auto":
        p = Path(resume)
        try:
            m = verify_dir(p, deep=verify)
            complete(m)
        except CorruptCheckpoint as e:
            raise CorruptCheckpoint(f"--resume {resume}: not a valid checkpoint: {e}") from e
        return ResumePoint(m.step, p, m, "path")
    local = committed_steps(root)
    remote_steps = remote.committed_steps() if remote is not None else []
    for step in sorted((set(local) | set(remote_steps)) - set(exclude), reverse=True):
        point = _local(step, root, verify, complete, events) if step in local else None
        if point is None and remote is not None and step in remote_steps:
            point = _remote(step, root, remote, verify, complete, events)
        if point is not None:
            return point
    return None


def _local(
    step: int, root: Path, verify: bool, complete: Complete, events: EventLog
) -> ResumePoint | None:
    path = root / step_dirname(step)
    try:
        m = verify_dir(path, deep=verify)
        complete(m)
        return ResumePoint(step, path, m, "local")
    except CorruptCheckpoint as e:
        moved = quarantine(path)
        log.warning(
            "checkpoint step %d is invalid (%s); moved to %s, falling back", step, e, moved.name
        )
        events.emit(
            "checkpoint_invalid", step=step, path=str(path), error=str(e), quarantined=str(moved)
        )
    return None


def _remote(
    step: int, root: Path, remote: RemoteStore, verify: bool, complete: Complete, events: EventLog
) -> ResumePoint | None:
    fetched: Path | None = None
    try:
        fetched = remote.fetch(step, root, deep=verify)
        m = verify_dir(fetched, deep=False)
        complete(m)
        return ResumePoint(step, fetched, m, "remote")
    except (CorruptCheckpoint, OSError) as e:
        if fetched is not None:  # verified bytes, but not a checkpoint the job can load
            quarantine(fetched)
        log.warning("remote checkpoint step %d is invalid (%s), falling back", step, e)
        path = f"{remote.url}/{step_dirname(step)}"
        events.emit("checkpoint_invalid", step=step, path=path, error=str(e))
    return None
