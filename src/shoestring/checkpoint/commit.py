"""The commit pipeline: serialize → commit locally → publish → retention.

What a save hands to a writer (:class:`SaveRequest`) and what runs after the
blocking copy, whichever writer runs it: the file writer's thread and process
back-ends call :func:`run_commit`; the sharded (DCP) writer seals the shards
every rank wrote and then calls :func:`publish_and_prune`, so the publish error
text and the retention order (local first, then remote) exist once.

Imports only local/remote/snapshot/faults/manifest: the writer process
(:mod:`shoestring.checkpoint.procworker`) imports this module, never the writers.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoestring.checkpoint.faults import NO_FAULTS, FaultPlan
from shoestring.checkpoint.local import apply_retention, commit_local
from shoestring.checkpoint.manifest import Manifest
from shoestring.checkpoint.remote import RemoteStore
from shoestring.checkpoint.snapshot import Snapshot, serialize


class PublishError(RuntimeError):
    """The local commit succeeded but publishing to ``checkpoint.storage`` failed."""


@dataclass(frozen=True)
class SaveRequest:
    """Everything one save needs, in either format.

    Files (one process): ``snapshot`` — still referencing the live tensors; the
    writer copies them out before training may go on. Sharded (DCP, one request
    per rank): ``state``, the DCP state dict, plus ``rank_files``, this rank's own
    small files (its RNG streams; rank 0 also the trainer state). ``meta`` goes
    into the manifest; ``capture_ms`` is the time the caller spent building the
    request, counted as blocking.
    """

    step: int
    snapshot: Snapshot | None = None
    state: dict[str, Any] | None = None
    rank_files: Mapping[str, bytes] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)
    capture_ms: float = 0.0

    @classmethod
    def files(cls, snap: Snapshot, *, capture_ms: float = 0.0) -> SaveRequest:
        return cls(step=snap.step, snapshot=snap, meta=snap.meta, capture_ms=capture_ms)

    @classmethod
    def sharded(
        cls,
        step: int,
        state: dict[str, Any],
        rank_files: Mapping[str, bytes],
        meta: Mapping[str, Any],
        *,
        capture_ms: float = 0.0,
    ) -> SaveRequest:
        return cls(
            step=step,
            state=state,
            rank_files=dict(rank_files),
            meta=dict(meta),
            capture_ms=capture_ms,
        )


@dataclass
class CommitResult:
    step: int
    path: str
    bytes: int
    serialize_ms: float
    write_ms: float
    upload_ms: float
    background_ms: float
    deleted: list[int]


def ms_since(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1e3, 3)


def publish_and_prune(
    path: Path,
    manifest: Manifest,
    *,
    root: Path,
    keep: int,
    remote: RemoteStore | None,
    faults: FaultPlan = NO_FAULTS,
) -> tuple[float, list[int]]:
    """Publish a locally committed checkpoint, then apply retention (local, then remote).

    Returns the upload time in ms and the deleted steps. A publish failure is a
    :class:`PublishError` that says the local copy is committed.
    """
    upload_ms = 0.0
    if remote is not None:
        t0 = time.perf_counter()
        try:
            remote.publish(path, manifest, faults)
        except Exception as e:
            raise PublishError(
                f"publishing step {manifest.step} to {remote.url} failed "
                f"({type(e).__name__}: {e}); the local copy {path} is "
                "committed"
            ) from e
        upload_ms = ms_since(t0)
    deleted = apply_retention(root, keep, faults)
    if remote is not None:
        deleted = sorted(set(deleted) | set(remote.apply_retention(keep)))
    return upload_ms, deleted


def run_commit(
    snap: Snapshot, root: Path, keep: int, remote: RemoteStore | None, faults: FaultPlan = NO_FAULTS
) -> CommitResult:
    """Serialize → local commit → remote publish → retention. Runs in the background."""
    t0 = time.perf_counter()
    files = serialize(snap)
    serialize_ms = ms_since(t0)
    t1 = time.perf_counter()
    path, manifest = commit_local(root, snap.step, files, snap.meta, faults)
    write_ms = ms_since(t1)
    upload_ms, deleted = publish_and_prune(
        path, manifest, root=root, keep=keep, remote=remote, faults=faults
    )
    return CommitResult(
        snap.step,
        str(path),
        manifest.total_bytes,
        serialize_ms,
        write_ms,
        upload_ms,
        ms_since(t0),
        deleted,
    )
