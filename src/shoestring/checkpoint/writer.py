"""The checkpoint writer: serialize, commit locally, publish, prune — off the training thread.

``submit`` takes a :class:`Snapshot` (already copied to host memory by the
caller, which is the only blocking part) and runs the rest in a background
thread. A new save first waits for the previous one, so saves never overlap.
Emergency saves pass ``sync=True`` and return only once committed.

A background failure (disk full, permission, network) is stored and raised in
the training thread at the next :meth:`check` as :class:`CheckpointSaveError`,
whose message names the path and says which checkpoint is still intact.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shoestring.checkpoint.faults import NO_FAULTS, FaultPlan
from shoestring.checkpoint.local import apply_retention, commit_local, committed_steps
from shoestring.checkpoint.remote import RemoteStore
import torch

from shoestring.checkpoint.snapshot import Snapshot, serialize
from shoestring.events import EventLog


class CheckpointSaveError(RuntimeError):
    """Saving a checkpoint failed; earlier committed checkpoints are untouched."""


class PublishError(RuntimeError):
    """The local commit succeeded but publishing to ``checkpoint.storage`` failed."""


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


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1e3, 3)


def run_commit(snap: Snapshot, root: Path, keep: int, remote: RemoteStore | None,
               faults: FaultPlan = NO_FAULTS) -> CommitResult:
    """Serialize → local commit → remote publish → retention. Runs in the background."""
    t0 = time.perf_counter()
    files = serialize(snap)
    serialize_ms = _ms(t0)
    t1 = time.perf_counter()
    path, manifest = commit_local(root, snap.step, files, snap.meta, faults)
    write_ms = _ms(t1)
    upload_ms = 0.0
    if remote is not None:
        t2 = time.perf_counter()
        try:
            remote.publish(path, manifest, faults)
        except Exception as e:
            raise PublishError(f"publishing step {snap.step} to {remote.url} failed "
                               f"({type(e).__name__}: {e}); the local copy {path} is "
                               "committed") from e
        upload_ms = _ms(t2)
    deleted = apply_retention(root, keep, faults)
    if remote is not None:
        deleted = sorted(set(deleted) | set(remote.apply_retention(keep)))
    return CommitResult(snap.step, str(path), manifest.total_bytes, serialize_ms, write_ms,
                        upload_ms, _ms(t0), deleted)


class _Blocking:
    """The training thread's blocked time, known only after the job has started."""

    def __init__(self, background: bool) -> None:
        self.background = background
        self.ms = 0.0
        self._ready = threading.Event()

    def set(self, ms: float) -> None:
        self.ms = ms
        self._ready.set()

    def wait(self) -> float:
        self._ready.wait()
        return self.ms


class HostBuffers:
    """Reused host-memory copies of snapshot tensors (fresh allocations page-fault).

    GPU tensors go into pinned buffers, copied on a side stream that first waits
    for the training stream (so the optimizer's last kernels are in the copy);
    the caller blocks only until that copy is done, never for serialization.
    """

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, str], torch.Tensor] = {}
        self._streams: dict[torch.device, Any] = {}

    def _buffer(self, key: tuple[str, str], t: torch.Tensor) -> torch.Tensor:
        buf = self._bufs.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self._bufs[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        return buf

    def _copy_stream(self, tensors: dict[str, dict[str, torch.Tensor]]) -> Any:
        device = next((t.device for d in tensors.values() for t in d.values() if t.is_cuda),
                      None)
        if device is None:
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        stream = self._streams[device]
        stream.wait_stream(torch.cuda.current_stream(device))
        return stream

    def stage(self, tensors: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
        stream = self._copy_stream(tensors)
        out: dict[str, dict[str, torch.Tensor]] = {}
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for f, d in tensors.items():
                out[f] = {}
                for k, t in d.items():
                    buf = self._buffer((f, k), t)
                    buf.copy_(t.detach(), non_blocking=t.is_cuda)
                    out[f][k] = buf
        if stream is not None:
            stream.synchronize()  # the host copies are complete: training may go on
        return out


class CheckpointWriter:
    """Serializes, commits, publishes and prunes checkpoints; at most one save in flight.

    ``mode``: ``thread`` (background thread), ``process`` (background process fed
    through shared memory, see :mod:`shoestring.checkpoint.procworker`) or ``off``.
    """

    def __init__(self, root: Path, *, keep: int, mode: str, events: EventLog,
                 remote: RemoteStore | None = None, faults: FaultPlan = NO_FAULTS) -> None:
        if mode not in ("thread", "process", "off"):
            raise ValueError(f"checkpoint.async_mode: unknown mode {mode!r}")
        self.root = root
        self.keep = keep
        self.mode = mode
        self.events = events
        self.remote = remote
        self.faults = faults
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._failed_step: int | None = None
        self._proc: Any = None
        self._host = HostBuffers()
        if mode == "process":
            from shoestring.checkpoint.procworker import ProcessBackend

            self._proc = ProcessBackend(root, keep, remote.url if remote else "", faults.spec)

    def _commit(self, staged: Snapshot) -> CommitResult:
        if self._proc is not None:
            return CommitResult(**self._proc.run(staged))
        return run_commit(staged, self.root, self.keep, self.remote, self.faults)

    def _job(self, staged: Snapshot, blocking: "_Blocking", reason: str) -> None:
        try:
            res = self._commit(staged)
        except BaseException as e:  # noqa: BLE001 - reported to the training thread
            self._error, self._failed_step = e, staged.step
            self.events.emit("checkpoint_failed", step=staged.step, reason=reason,
                             error=f"{type(e).__name__}: {e}")
            return
        fields: dict[str, Any] = asdict(res)
        # Synchronous saves block training for the whole commit.
        ms = blocking.wait() + (0.0 if blocking.background else res.background_ms)
        fields.update(reason=reason, blocking_ms=round(ms, 3), mode=self.mode,
                      storage=self.remote.url if self.remote else "")
        self.events.emit("checkpoint", **fields)

    def _stage(self, snap: Snapshot) -> Snapshot:
        """The blocking copy: reused host buffers (thread/off) or the shared buffer (process)."""
        if self._proc is not None:
            return self._proc.stage(snap)
        return Snapshot(step=snap.step, tensors=self._host.stage(snap.tensors),
                        documents=snap.documents, meta=snap.meta)

    def submit(self, snap: Snapshot, *, capture_ms: float = 0.0, reason: str,
               sync: bool = False) -> float:
        """Save ``snap`` (which may reference live tensors); return the ms training was blocked.

        Blocking = waiting for the previous save + copying tensors out of the live
        state + starting the background job (+ ``capture_ms`` the caller spent
        building ``snap``); for a synchronous save, also the whole commit.
        """
        t0 = time.perf_counter()
        self.wait()  # also makes the reused staging buffers free again
        staged = self._stage(snap)
        background = not (sync or self.mode == "off")
        blocking = _Blocking(background)
        if not background:
            blocking.set(_ms(t0) + capture_ms)
            self._job(staged, blocking, reason)
            self.check()
            return blocking.ms
        self._thread = threading.Thread(target=self._job, args=(staged, blocking, reason),
                                        name=f"ckpt-writer-{snap.step}", daemon=True)
        self._thread.start()
        blocking.set(_ms(t0) + capture_ms)
        return blocking.ms

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()

    def check(self) -> None:
        if self._error is None or self.busy():
            return
        err, step = self._error, self._failed_step
        self._error = None
        intact = committed_steps(self.root)
        keep = f"step {intact[0]} is intact" if intact else "no earlier checkpoint exists"
        raise CheckpointSaveError(f"saving checkpoint step {step} under {self.root} failed: "
                                  f"{type(err).__name__}: {err}; {keep}") from err

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._proc is not None:
                self._proc.close()
                self._proc = None
