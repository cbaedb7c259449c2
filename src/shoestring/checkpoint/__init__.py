"""Checkpoints that cannot be torn: snapshot, commit protocol, stores, async writers.

The protocol is generic: any job (training, batch inference) hands a
:class:`SaveRequest` (for files: a :class:`Snapshot`) to a :class:`Writer` —
:class:`FileWriter` or, for DCP shards,
:class:`~shoestring.checkpoint.sharded.ShardedWriter` — and later asks
:func:`find_resume_point` where to continue from.
"""

from shoestring.checkpoint.commit import PublishError, SaveRequest
from shoestring.checkpoint.faults import NO_FAULTS, FaultPlan
from shoestring.checkpoint.manifest import CorruptCheckpoint, Manifest, verify_dir
from shoestring.checkpoint.remote import RemoteStore
from shoestring.checkpoint.resume import ResumePoint, find_resume_point
from shoestring.checkpoint.snapshot import Snapshot, load_files, make_snapshot
from shoestring.checkpoint.writer import CheckpointSaveError, FileWriter, Writer

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
