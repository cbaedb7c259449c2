"""Local commit protocol: temp dir → fsync → manifest last → atomic rename.

Layout under a checkpoint root (``OUTPUT/checkpoints`` by default)::

    step-00000120/            committed (has manifest.json)
    .tmp-step-00000130-…/     being written; never loaded, removed on next start
    .corrupt-step-00000110-…/ failed verification; kept for inspection

Old checkpoints are deleted only after a newer one is committed, manifest
first, so a kill during retention leaves either a valid or an ignored dir.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from shoestring.checkpoint.faults import NO_FAULTS, FaultPlan
from shoestring.checkpoint.manifest import (
    MANIFEST,
    CorruptCheckpoint,
    FileEntry,
    Manifest,
    read_manifest,
    sha256_file,
)
from shoestring.dircommit import commit_dir, uncommit
from shoestring.fsio import fsync_dir

_STEP_RE = re.compile(r"^step-(\d{8,})$")
_QUARANTINED_RE = re.compile(r"^\.corrupt-.*-(\d{9,})-[0-9a-f]+$")


def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


def parse_step(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


class Payload(Protocol):
    """A file's content written as it is produced (:class:`~shoestring.stwriter.TensorFile`:
    a safetensors file straight from the snapshot's tensors), never held whole."""

    @property
    def nbytes(self) -> int: ...

    def chunks(self) -> Iterable[bytes | memoryview]: ...


@dataclass(frozen=True)
class Blob:
    """Content already in memory (a JSON document)."""

    data: bytes | memoryview

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def chunks(self) -> Iterable[bytes | memoryview]:
        return (self.data,)


FileData = bytes | memoryview | Payload


def write_file_durably(path: Path, data: FileData, faults: FaultPlan = NO_FAULTS) -> FileEntry:
    """Write ``data`` to ``path`` and fsync it; its size and sha256, hashed as written.

    The ``ckpt.partial_file`` fault leaves half of it, synced, then fires (a torn file)."""
    content = Blob(data) if isinstance(data, bytes | memoryview) else data
    partial = faults.wants("ckpt.partial_file")
    limit = content.nbytes // 2 if partial else content.nbytes
    digest, size = hashlib.sha256(), 0
    with open(path, "wb") as f:
        for chunk in content.chunks():
            view = memoryview(chunk).cast("B")[: limit - size]
            f.write(view)
            digest.update(view)
            size += len(view)
        if partial:
            f.flush()
            os.fsync(f.fileno())
        faults.hit("ckpt.partial_file")
        f.flush()
        os.fsync(f.fileno())
    if size != content.nbytes:
        raise ValueError(f"{path}: wrote {size} bytes of {content.nbytes}")
    return FileEntry(size, digest.hexdigest())


def commit_local(
    root: Path,
    step: int,
    files: Mapping[str, FileData],
    meta: dict[str, Any],
    faults: FaultPlan = NO_FAULTS,
) -> tuple[Path, Manifest]:
    """Write ``files`` as checkpoint ``step`` under ``root`` with the commit protocol."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{step_dirname(step)}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        entries: dict[str, FileEntry] = {}
        for name, data in files.items():
            entries[name] = write_file_durably(tmp / name, data, faults)
            faults.hit("ckpt.after_file")
        return seal(tmp, root, step, meta, faults, entries)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def seal(
    tmp: Path,
    root: Path,
    step: int,
    meta: dict[str, Any],
    faults: FaultPlan = NO_FAULTS,
    entries: dict[str, FileEntry] | None = None,
    name: str | None = None,
) -> tuple[Path, Manifest]:
    """Commit a temp dir whose data files are durable: manifest last, fsync, rename.
    It becomes ``root/name`` (default: the step's directory name).

    ``entries`` (size + sha256 per file) is computed from the files on disk when
    not given — the case of files written by other processes (the shards of a
    distributed checkpoint on a shared filesystem).
    """
    if entries is None:
        entries = {}
        for p in sorted(tmp.rglob("*")):
            if p.is_file() and p.name != MANIFEST:
                entries[p.relative_to(tmp).as_posix()] = FileEntry(p.stat().st_size, sha256_file(p))
    manifest = Manifest(step=step, files=entries, meta=dict(meta))
    final = root / (name or step_dirname(step))
    # The same step may be saved again (a rerun that re-reached it): replace it.
    commit_dir(
        tmp,
        final,
        MANIFEST,
        manifest.to_json().encode(),
        hook=lambda point: faults.hit(f"ckpt.{point}"),
        write=write_file_durably,  # the manifest is not a fault point's file
    )
    return final, manifest


def committed_steps(root: Path) -> list[int]:
    """Steps whose directory has a manifest, newest first (cheap check, no hashing)."""
    if not root.is_dir():
        return []
    steps = []
    for child in root.iterdir():
        step = parse_step(child.name)
        # a symlinked step dir is not ours: never listed, so never kept or deleted through
        if step is not None and not child.is_symlink() and (child / MANIFEST).is_file():
            steps.append(step)
    return sorted(steps, reverse=True)


def remove_checkpoint(path: Path, faults: FaultPlan = NO_FAULTS) -> None:
    """Uncommit (manifest first), then delete. A symlink is removed itself: nothing is
    ever uncommitted or deleted through it."""
    uncommit(path, MANIFEST, hook=lambda _: faults.hit("ckpt.retention"))


def apply_retention(root: Path, keep: int, faults: FaultPlan = NO_FAULTS) -> list[int]:
    """Delete all but the newest ``keep`` committed checkpoints; return deleted steps."""
    steps = committed_steps(root)
    doomed = steps[keep:]
    for step in doomed:
        remove_checkpoint(root / step_dirname(step), faults)
    return doomed


def clean_stale(root: Path) -> list[str]:
    """Remove leftovers of killed writes (``.tmp-*``, ``.replaced-*``, uncommitted step dirs)."""
    removed: list[str] = []
    if not root.is_dir():
        return removed
    for child in root.iterdir():
        stale_tmp = child.name.startswith((".tmp-", ".replaced-", ".fetch-"))
        uncommitted = parse_step(child.name) is not None and not (child / MANIFEST).exists()
        if child.is_dir() and not child.is_symlink() and (stale_tmp or uncommitted):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child.name)
    return removed


def quarantine(path: Path) -> Path:
    """Move a checkpoint that failed verification out of the way, keeping it for inspection."""
    dest = path.parent / f".corrupt-{path.name}-{int(time.time())}-{uuid.uuid4().hex[:6]}"
    try:
        os.rename(path, dest)
        fsync_dir(path.parent)
    except OSError:
        return path
    return dest


def prune_quarantined(root: Path, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` quarantined checkpoints (``.corrupt-*``, newest
    by the time in their name, then by mtime); return the names deleted."""
    if not root.is_dir():
        return []
    found = [
        c
        for c in root.iterdir()
        if c.name.startswith(".corrupt-") and c.is_dir() and not c.is_symlink()
    ]

    def age(p: Path) -> tuple[int, float]:
        m = _QUARANTINED_RE.match(p.name)
        return (int(m.group(1)) if m else 0, p.stat().st_mtime)

    doomed = sorted(found, key=age, reverse=True)[max(keep, 0) :]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return sorted(p.name for p in doomed)


def manifest_or_none(path: Path) -> Manifest | None:
    try:
        return read_manifest(path)
    except CorruptCheckpoint:
        return None
