"""Checkpoint writers: one contract (:class:`Writer`), two back-ends.

``submit`` takes a :class:`SaveRequest`. The only blocking part of a save is
copying the state out of the live tensors (and waiting for the previous save:
saves never overlap); the rest — serialize, commit locally, publish, prune —
runs in a background thread. Emergency saves pass ``sync=True`` and return
only once committed.

A background failure (disk full, permission, network) is stored and raised in
the training thread at the next :meth:`Writer.check` as
:class:`CheckpointSaveError`, whose message names the path and says which
checkpoint is still intact.

Back-ends: :class:`FileWriter` (one process: safetensors + JSON files through
the commit protocol; ``thread`` | ``process`` | ``off``) here, and
:class:`~shoestring.checkpoint.sharded.ShardedWriter` (DCP shards from every
rank, sealed by rank 0). Both finish through :mod:`shoestring.checkpoint.commit`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from shoestring.checkpoint.commit import (
    CommitResult,
    PublishError,
    SaveRequest,
    ms_since,
    run_commit,
)
from shoestring.checkpoint.faults import NO_FAULTS, FaultPlan
from shoestring.checkpoint.local import committed_steps
from shoestring.checkpoint.procworker import ProcessBackend
from shoestring.checkpoint.remote import RemoteStore
from shoestring.checkpoint.snapshot import Snapshot
from shoestring.events import EventLog

__all__ = [
    "CheckpointSaveError",
    "Committed",
    "FileWriter",
    "HostBuffers",
    "PublishError",
    "SaveRequest",
    "Writer",
    "run_commit",
]


class CheckpointSaveError(RuntimeError):
    """Saving a checkpoint failed; earlier committed checkpoints are untouched."""


@dataclass
class Committed:
    """What the background part of a save returns.

    ``fields``: the ``checkpoint`` event's fields in their order, with ``reason``
    and ``blocking_ms`` present as ``None`` for :class:`Writer` to fill; ``None``
    when this writer logs no event (ranks other than 0). ``tail_ms``: the time of
    the background part, which a synchronous save also blocks on.
    """

    fields: dict[str, Any] | None
    tail_ms: float


Finish = Callable[[], Committed]


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


class Writer(ABC):
    """At most one save in flight; failures surface at :meth:`check` (BaseCheckpointManager
    pattern: the template is here, a back-end only says how a save starts)."""

    thread_name = "ckpt-writer"
    reports = True  # whether this writer logs events (a sharded writer: rank 0 only)
    where = ""  # said after "failed" in CheckpointSaveError (a sharded writer: " on rank N")

    def __init__(
        self,
        root: Path,
        *,
        keep: int,
        mode: str,
        events: EventLog,
        remote: RemoteStore | None = None,
        faults: FaultPlan = NO_FAULTS,
    ) -> None:
        self.root, self.keep, self.mode = root, keep, mode
        self.events, self.remote, self.faults = events, remote, faults
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._failed_step: int | None = None

    @abstractmethod
    def _start(self, req: SaveRequest, background: bool) -> Finish:
        """The blocking part of a save (copy out of the live state); returns the rest,
        which runs in the background thread, or right away for a synchronous save."""

    def _release(self) -> None:  # noqa: B027 - an optional hook: most back-ends hold nothing
        """Free what the back-end holds (called by :meth:`close`)."""

    def submit(self, req: SaveRequest, *, reason: str, sync: bool = False) -> float:
        """Save ``req`` (which may reference live tensors); return the ms training was blocked.

        Blocking = waiting for the previous save + copying out of the live state +
        starting the background job (+ ``req.capture_ms``, the caller's time building
        the request); for a synchronous save, also the whole commit.
        """
        t0 = time.perf_counter()
        self.wait()  # also makes reused staging buffers free again
        background = not (sync or self.mode == "off")
        finish = self._start(req, background)
        blocking = _Blocking(background)
        if not background:
            blocking.set(ms_since(t0) + req.capture_ms)
            ms = self._job(req.step, finish, blocking, reason)
            self.check()
            return ms
        self._thread = threading.Thread(
            target=self._job,
            args=(req.step, finish, blocking, reason),
            name=f"{self.thread_name}-{req.step}",
            daemon=True,
        )
        self._thread.start()
        blocking.set(ms_since(t0) + req.capture_ms)
        return blocking.ms

    def _job(self, step: int, finish: Finish, blocking: _Blocking, reason: str) -> float:
        try:
            done = finish()
        except BaseException as e:  # noqa: BLE001 - reported to the training thread
            self._fail(step, reason, e)
            return blocking.ms
        ms = blocking.wait() + (0.0 if blocking.background else done.tail_ms)
        if done.fields is not None:
            fields = dict(done.fields, reason=reason, blocking_ms=round(ms, 3))
            self.events.emit("checkpoint", **fields)
        return ms

    def _fail(self, step: int, reason: str, e: BaseException) -> None:
        self._error, self._failed_step = e, step
        if self.reports:
            self.events.emit(
                "checkpoint_failed", step=step, reason=reason, error=f"{type(e).__name__}: {e}"
            )

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
        raise CheckpointSaveError(
            f"saving checkpoint step {step} under {self.root} "
            f"failed{self.where}: {type(err).__name__}: {err}; "
            f"{keep}"
        ) from err

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._release()


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
        device = next((t.device for d in tensors.values() for t in d.values() if t.is_cuda), None)
        if device is None:
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        stream = self._streams[device]
        stream.wait_stream(torch.cuda.current_stream(device))
        return stream

    def stage(
        self, tensors: dict[str, dict[str, torch.Tensor]]
    ) -> dict[str, dict[str, torch.Tensor]]:
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


class FileWriter(Writer):
    """One process: safetensors + JSON files through the commit protocol.

    ``mode``: ``thread`` (background thread), ``process`` (background process fed
    through shared memory, see :mod:`shoestring.checkpoint.procworker`) or ``off``.
    """

    def __init__(
        self,
        root: Path,
        *,
        keep: int,
        mode: str,
        events: EventLog,
        remote: RemoteStore | None = None,
        faults: FaultPlan = NO_FAULTS,
    ) -> None:
        if mode not in ("thread", "process", "off"):
            raise ValueError(f"checkpoint.async_mode: unknown mode {mode!r}")
        super().__init__(root, keep=keep, mode=mode, events=events, remote=remote, faults=faults)
        self._host = HostBuffers()
        self._proc: ProcessBackend | None = None
        if mode == "process":
            self._proc = ProcessBackend(root, keep, remote.url if remote else "", faults.spec)

    def _start(self, req: SaveRequest, background: bool) -> Finish:
        if req.snapshot is None:
            raise TypeError(
                "FileWriter: the SaveRequest has no snapshot (a sharded save goes to ShardedWriter)"
            )
        staged = self._stage(req.snapshot)
        return lambda: self._commit(staged)

    def _stage(self, snap: Snapshot) -> Snapshot:
        """The blocking copy: reused host buffers (thread/off) or the shared buffer (process)."""
        if self._proc is not None:
            return self._proc.stage(snap)
        return Snapshot(
            step=snap.step,
            tensors=self._host.stage(snap.tensors),
            documents=snap.documents,
            meta=snap.meta,
        )

    def _commit(self, staged: Snapshot) -> Committed:
        if self._proc is not None:
            res = CommitResult(**self._proc.run(staged))
        else:
            res = run_commit(staged, self.root, self.keep, self.remote, self.faults)
        fields: dict[str, Any] = asdict(res)
        fields.update(
            reason=None,
            blocking_ms=None,
            mode=self.mode,
            storage=self.remote.url if self.remote else "",
        )
        return Committed(fields, res.background_ms)

    def _release(self) -> None:
        if self._proc is not None:
            self._proc.close()
            self._proc = None
