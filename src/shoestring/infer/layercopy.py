"""A copy of the decoder layers written once into the run directory, then streamed
instead of the checkpoint's: the compressed copy (:mod:`.quant`) and the decoded one
(:mod:`.decoded`) are both kept this way.

The copy is a folder of one safetensors file per layer (``layers.N.safetensors``) and
a ``meta.json`` naming its source (model, adapter, scheme): it is committed with the
directory protocol of :mod:`shoestring.dircommit` (files fsynced, the manifest last,
then renamed), so a kill leaves either no copy or a complete one, and a rerun whose
source is the same reuses it. Before a byte is written the folder's filesystem must
have room for all of it: a disk that fills halfway is refused, not found.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shoestring.config import ConfigError
from shoestring.dircommit import commit_dir, staging_dir
from shoestring.heap import trim_heap

#: The copy's manifest: ``{"source": ..., ...}``, written last.
META = "meta.json"
#: Room kept free on the copy's filesystem beyond the copy itself.
SPARE_BYTES = 1 << 30


def kept_copy(dest: Path, source_id: str) -> bool:
    """Whether ``dest`` holds a committed copy of ``source_id``."""
    meta = dest / META
    return meta.is_file() and json.loads(meta.read_text()).get("source") == source_id


def write_once(
    dest: Path, source_id: str, meta: dict[str, Any], nbytes: int, write: Callable[[Path], None]
) -> bool:
    """The copy of ``source_id`` at ``dest``: kept if there, else written by ``write``
    (its files into the folder it is given, each fsynced) and committed. Returns
    whether it was written now. ``nbytes``: what it will take on disk, checked first."""
    if kept_copy(dest, source_id):
        return False
    check_room(dest.parent, nbytes, dest.name)
    try:
        with staging_dir(dest.parent, dest.name) as tmp:
            write(tmp)
            doc = json.dumps({"source": source_id, **meta}).encode()
            commit_dir(tmp, dest, META, doc)
    finally:
        trim_heap()  # its freed blocks would otherwise stay resident through the run
    return True


def check_room(parent: Path, nbytes: int, what: str) -> None:
    """Refuse a copy the filesystem of ``parent`` has no room for (with a spare GiB)."""
    parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(parent).free
    if nbytes + SPARE_BYTES > free:
        raise ConfigError(
            f"--run-dir (io.run_dir): {parent} has {free / 1e9:.1f} GB free; the {what} "
            f"copy of the layers takes {nbytes / 1e9:.1f} GB (and 1 GiB is kept spare): "
            "free some space or give a run directory on a larger disk"
        )


def settle(path: Path) -> None:
    """A written layer file made durable, then its clean pages dropped from the page
    cache (they would otherwise crowd out the pages the stream reads)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def layer_file(dest: Path, unit_name: str) -> Path:
    return dest / f"{unit_name}.safetensors"


def numel(shape: tuple[int, ...] | torch.Size) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
