"""Writing a file so that a reader sees the old or the new content, never half of it.

One implementation for every small file a run keeps beside its checkpoints (run.json,
config identity, the assembled inference output, reports, live state): write a
uniquely named temp file in the same directory, then ``os.replace`` it into place.
``durable`` (the default) also fsyncs the file before the rename and the directory
after it, so the new content survives a power cut, not only a crash. Only state that
is rewritten every second and means nothing after a restart (a rank's ``live.json``)
passes ``durable=False``.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically (and durably unless ``durable=False``)."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.filename is None:  # a write or fsync: say which file (a full disk, say)
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def fsync_tree(root: Path) -> None:
    """Make every file under ``root`` and every directory entry durable (files first,
    then directories bottom-up): what a directory about to be renamed into place needs,
    so the rename never publishes names whose bytes a power cut could still lose."""
    dirs: list[Path] = []
    for here, subdirs, files in os.walk(root):
        dirs.append(Path(here))
        for name in files:
            p = Path(here) / name
            if p.is_symlink():
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        subdirs[:] = [d for d in subdirs if not (Path(here) / d).is_symlink()]
    for d in reversed(dirs):
        fsync_dir(d)


def unwritable(path: Path) -> OSError | None:
    """Why a folder (created if missing) cannot be written into, or None: a probe file
    made and removed, so a read-only mount or a full disk shows here, not mid-run."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return e
    return None
