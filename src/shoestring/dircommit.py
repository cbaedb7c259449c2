"""One directory-commit protocol for everything a job keeps as a folder: checkpoints,
exports, the quantized-base cache, the tokenized data cache.

A folder is **committed** when its manifest exists; the manifest is always written
last and removed first:

* :func:`staging_dir` gives a temp folder beside the target (``.tmp-<label>-<pid>-<hex>``,
  removed when the block leaves without committing it);
* :func:`commit_dir` writes the manifest last, durably, fsyncs the folder and renames it
  into place with :func:`replace_dir` (an old folder at the target is moved aside
  first, so a reader sees the old or the new one, never a mix);
* :func:`uncommit` removes the manifest first, then the rest;
* :func:`publish_dir` uploads a committed folder to an fsspec filesystem in the same
  order (an old remote manifest removed first, data files, manifest last);
* :func:`held_lock` is the one ``flock`` helper: held for a block, dropped by the kernel
  when its holder dies, and it says who holds it.

The data files' own durability (fsync before the manifest) is the writer's part: each
writer knows how it wrote them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import psutil

from shoestring.fsio import atomic_write, fsync_dir


def _nothing(point: str) -> None:
    """The default commit hook (fault injection passes its own)."""


def replace_dir(tmp: Path, final: Path) -> None:
    """Atomically put ``tmp`` at ``final``; an existing ``final`` is moved aside first,
    so at every moment ``final`` is either the old or the new complete directory."""
    if final.exists():
        aside = final.parent / f".replaced-{final.name}-{uuid.uuid4().hex[:8]}"
        os.rename(final, aside)
        os.rename(tmp, final)
        fsync_dir(final.parent)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, final)
        fsync_dir(final.parent)


@contextlib.contextmanager
def staging_dir(parent: Path, label: str) -> Iterator[Path]:
    """A fresh temp folder in ``parent`` for ``label``'s files; whatever of it is still
    there when the block ends (an error, a folder never committed) is removed."""
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f".tmp-{label}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def is_stale_staging(name: str, label: str) -> bool:
    """Whether ``name`` is a staging folder of ``label`` (of any process)."""
    return name.startswith(f".tmp-{label}-")


def commit_dir(
    tmp: Path,
    final: Path,
    manifest: str,
    manifest_bytes: bytes,
    hook: Callable[[str], object] = _nothing,
    write: Callable[[Path, bytes], object] = atomic_write,
) -> None:
    """Commit ``tmp`` (its data files already durable) as ``final``: the manifest
    written last (by ``write``, which must sync it) and the folder synced, then renamed
    into place. ``hook`` is called at ``before_manifest``, ``before_rename`` and
    ``after_rename``."""
    hook("before_manifest")
    write(tmp / manifest, manifest_bytes)
    fsync_dir(tmp)
    hook("before_rename")
    replace_dir(tmp, final)
    hook("after_rename")


def uncommit(path: Path, manifest: str, hook: Callable[[str], object] = _nothing) -> None:
    """Remove a committed folder: its manifest first (it stops counting at once), then
    the rest. ``hook("uncommitted")`` runs in between. A symlink is removed itself:
    nothing is ever uncommitted or deleted through it."""
    if path.is_symlink():
        os.unlink(path)
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path / manifest)
        fsync_dir(path)
    hook("uncommitted")
    shutil.rmtree(path, ignore_errors=True)


def publish_dir(
    fs: Any,
    local: Path,
    dest: str,
    names: Iterable[str],
    manifest: str,
    hook: Callable[[str], object] = _nothing,
) -> None:
    """Upload the committed folder ``local`` to ``dest`` on the fsspec filesystem
    ``fs``: a manifest an interrupted upload left there removed first (it may describe
    other bytes), then each of ``names`` (``hook("after_file")`` after each), then
    (``hook("before_manifest")``) the manifest."""
    fs.invalidate_cache()
    if fs.exists(f"{dest}/{manifest}"):
        fs.rm(f"{dest}/{manifest}")
    with contextlib.suppress(OSError, NotImplementedError):
        fs.makedirs(dest, exist_ok=True)
    for name in names:
        fs.put_file(str(local / name), f"{dest}/{name}")
        hook("after_file")
    hook("before_manifest")
    fs.put_file(str(local / manifest), f"{dest}/{manifest}")
    fs.invalidate_cache()


class LockHeld(Exception):
    """Another process holds the lock; ``holder`` says who, when it said so."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path}: {holder}")
        self.path, self.holder = path, holder


@contextlib.contextmanager
def held_lock(path: Path, *, wait: bool = True) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the block. The
    kernel drops it when the holder dies: a SIGKILLed process leaves no stale lock (over
    NFS Linux maps it to a POSIX lock). The holder writes its pid, host and start into
    the file; with ``wait=False`` a held lock raises :class:`LockHeld` at once, naming
    them. ``OSError`` from opening the file (no such folder, read-only) propagates."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise LockHeld(path, _holder(fd)) from None
        note = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.time(),
            "parents": _parents(),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(note).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


#: How many of the holder's ancestors are looked at (rank → torchrun → shoestring run).
_PARENTS_LOOKED_AT = 3
#: An ancestor that launched the holder as part of its job (a supervisor, torchrun).
_LAUNCHERS = ("shoestring", "torchrun", "torch.distributed.run")


def _parents() -> list[list[float]]:
    """``[pid, start time]`` of the nearest ancestors that launched this process as part
    of its job (``shoestring run``, torchrun); never a shell or terminal, whose exit
    leaves a ``nohup`` job running on purpose."""
    noted: list[list[float]] = []
    try:
        for p in psutil.Process().parents()[:_PARENTS_LOOKED_AT]:
            argv = " ".join(p.cmdline()[:4])
            if any(name in argv for name in _LAUNCHERS):
                noted.append([p.pid, p.create_time()])
    except psutil.Error:
        pass
    return noted


def _gone(pid: int, started: float) -> bool:
    try:
        return psutil.Process(pid).create_time() != started  # a reused pid is not it
    except psutil.Error:
        return True


def _holder(fd: int) -> str:
    """Who holds the lock, from its note; on this host, whether it is an orphan: a
    process whose job (an ancestor recorded when it took the lock) is gone is exiting."""
    try:
        note = json.loads(os.pread(fd, 4096, 0) or b"{}")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(note["since"])))
        who = f"pid {note['pid']} on host {note['host']} holds it since {since}"
        if note["host"] != socket.gethostname():
            return who
        gone = [int(pid) for pid, started in note.get("parents", []) if _gone(int(pid), started)]
    except (OSError, ValueError, KeyError, TypeError):
        return "another process holds it"
    if gone:
        return (
            f"{who}; it is an orphan of a killed job (its launcher pid {gone[0]} is gone) "
            "and is exiting after its emergency save: retry in a few seconds"
        )
    return who
