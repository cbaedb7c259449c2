"""Checkpoints that cannot be torn: snapshot, commit protocol, stores, async writers.

The protocol is generic: any job (training, batch inference) hands a
:class:`SaveRequest` (for files: a :class:`Snapshot`) to a :class:`Writer` —
:class:`FileWriter` or, for DCP shards,
:class:`~shoestring.checkpoint.sharded.ShardedWriter` — and later asks
:func:`find_resume_point` where to continue from.

Importing a submodule (``shoestring.checkpoint.mirror``, ``.local``, ``.remote``) does not
import torch: the names below load their modules when first used, so ``shoestring plan``
and the CLI's fast paths stay light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shoestring.checkpoint.commit import PublishError, SaveRequest
    from shoestring.checkpoint.faults import NO_FAULTS, FaultPlan
    from shoestring.checkpoint.manifest import CorruptCheckpoint, Manifest, verify_dir
    from shoestring.checkpoint.remote import RemoteStore
    from shoestring.checkpoint.resume import ResumePoint, find_resume_point
    from shoestring.checkpoint.snapshot import Snapshot, load_files, make_snapshot
    from shoestring.checkpoint.writer import CheckpointSaveError, FileWriter, Writer

#: Each public name and the submodule that defines it.
_HOME = {
    "PublishError": "commit",
    "SaveRequest": "commit",
    "NO_FAULTS": "faults",
    "FaultPlan": "faults",
    "CorruptCheckpoint": "manifest",
    "Manifest": "manifest",
    "verify_dir": "manifest",
    "RemoteStore": "remote",
    "ResumePoint": "resume",
    "find_resume_point": "resume",
    "Snapshot": "snapshot",
    "load_files": "snapshot",
    "make_snapshot": "snapshot",
    "CheckpointSaveError": "writer",
    "FileWriter": "writer",
    "Writer": "writer",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


__all__ = [
    "NO_FAULTS",
    "CheckpointSaveError",
    "CorruptCheckpoint",
    "FaultPlan",
    "FileWriter",
    "Manifest",
    "PublishError",
    "RemoteStore",
    "ResumePoint",
    "SaveRequest",
    "Snapshot",
    "Writer",
    "find_resume_point",
    "load_files",
    "make_snapshot",
    "verify_dir",
]
