"""Choosing the checkpoint to resume from: ``--resume auto|never|PATH``.

``auto`` walks committed checkpoints newest first across the local cache and
the remote store. A local copy that fails verification is quarantined and a
warning is logged; the remote copy of the same step is tried next, then older
steps. A checkpoint without a valid manifest is never loaded.
"""

from __future__ import annotations

import logging
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


def find_resume_point(
    resume: str, root: Path, remote: RemoteStore | None, *, verify: bool, events: EventLog
) -> ResumePoint | None:
    if resume == "never":
        return None
    if resume != "auto":
        p = Path(resume)
        try:
            m = verify_dir(p, deep=verify)
        except CorruptCheckpoint as e:
            raise CorruptCheckpoint(f"--resume {resume}: not a valid checkpoint: {e}") from e
        return ResumePoint(m.step, p, m, "path")

    local = committed_steps(root)
    remote_steps: list[int] = []
    if remote is not None:
        remote_steps = remote.committed_steps()
    for step in sorted(set(local) | set(remote_steps), reverse=True):
        if step in local:
            path = root / step_dirname(step)
            try:
                return ResumePoint(step, path, verify_dir(path, deep=verify), "local")
            except CorruptCheckpoint as e:
                moved = quarantine(path)
                log.warning(
                    "checkpoint step %d is invalid (%s); moved to %s, falling back",
                    step,
                    e,
                    moved.name,
                )
                events.emit(
                    "checkpoint_invalid",
                    step=step,
                    path=str(path),
                    error=str(e),
                    quarantined=str(moved),
                )
        if step in remote_steps and remote is not None:
            try:
                path = remote.fetch(step, root, deep=verify)
                m = verify_dir(path, deep=False)
                return ResumePoint(step, path, m, "remote")
            except (CorruptCheckpoint, OSError) as e:
                log.warning("remote checkpoint step %d is invalid (%s), falling back", step, e)
                events.emit(
                    "checkpoint_invalid",
                    step=step,
                    path=f"{remote.url}/{step_dirname(step)}",
                    error=str(e),
                )
    return None
