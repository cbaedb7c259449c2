"""Distributed checkpoints: torch.distributed.checkpoint (DCP) shards under our commit protocol.

Every rank writes into the same temp dir on a shared filesystem: its own small
files (its RNG streams; rank 0 also the trainer state) first, then its DCP
shard through ``dcp.async_save`` (or ``dcp.save`` for synchronous saves).
DCP's coordinator writes ``.metadata`` only after gathering every rank's write
result, so when rank 0's save has finished, every shard is durable. Only then
does rank 0 *seal* the directory — ``manifest.json`` (size + sha256 of every
file) last, then the atomic rename — exactly as a single-process checkpoint.
A step without the coordinator's manifest never counts, whichever rank died.

DCP reshards on load, so a checkpoint written by N ranks loads on M ranks, or
on one process without a process group.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Mapping

from shoestring.checkpoint.faults import NO_FAULTS, FaultPlan
from shoestring.checkpoint.local import (apply_retention, committed_steps, seal, step_dirname,
                                         write_file_durably)
from shoestring.checkpoint.remote import RemoteStore
from shoestring.checkpoint.writer import CheckpointSaveError, PublishError
from shoestring.events import EventLog

log = logging.getLogger("shoestring.checkpoint")

DCP_METADATA = ".metadata"


def sharded_tmp(root: Path, step: int) -> Path:
    """The temp dir every rank agrees on without talking (a rerun cleans it first)."""
    return root / f".tmp-{step_dirname(step)}-dcp"


def is_sharded(files: Mapping[str, Any]) -> bool:
    return DCP_METADATA in files


class ShardedWriter:
    """One per rank. At most one save in flight; rank 0 seals, publishes and prunes."""

    def __init__(self, root: Path, *, rank: int, group: Any, keep: int, mode: str,
                 events: EventLog, remote: RemoteStore | None = None,
                 faults: FaultPlan = NO_FAULTS) -> None:
        self.root, self.rank, self.group, self.keep = root, rank, group, keep
        self.mode, self.events, self.remote, self.faults = mode, events, remote, faults
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._failed_step: int | None = None

    def submit(self, step: int, state: dict[str, Any], own_files: Mapping[str, bytes],
               meta: dict[str, Any], *, reason: str, sync: bool, capture_ms: float = 0.0) -> float:
        """Save ``state`` (DCP state dict) plus this rank's ``own_files``; returns blocked ms."""
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        self.wait()
        tmp = sharded_tmp(self.root, step)
        tmp.mkdir(parents=True, exist_ok=True)
        for name, data in own_files.items():
            write_file_durably(tmp / name, data)
        writer = dcp.FileSystemWriter(str(tmp), sync_files=True)
        if sync or self.mode == "off":
            try:
                dcp.save(state, storage_writer=writer, process_group=self.group)
            except BaseException as e:
                self._error, self._failed_step = e, step
                self.check()
            blocked = (time.perf_counter() - t0) * 1e3 + capture_ms
            self._finish(step, tmp, meta, reason, blocked, background=False)
            self.check()
            return blocked
        fut = dcp.async_save(state, storage_writer=writer, process_group=self.group)
        blocked = (time.perf_counter() - t0) * 1e3 + capture_ms
        self._thread = threading.Thread(target=self._background, name=f"dcp-writer-{step}",
                                        args=(fut, step, tmp, meta, reason, blocked), daemon=True)
        self._thread.start()
        return blocked

    def _background(self, fut: "Future[Any]", step: int, tmp: Path, meta: dict[str, Any],
                    reason: str, blocked: float) -> None:
        try:
            fut.result()
        except BaseException as e:  # noqa: BLE001 - reported to the training thread
            self._fail(step, reason, e)
            return
        self._finish(step, tmp, meta, reason, blocked, background=True)

    def _fail(self, step: int, reason: str, e: BaseException) -> None:
        self._error, self._failed_step = e, step
        if self.rank == 0:
            self.events.emit("checkpoint_failed", step=step, reason=reason,
                             error=f"{type(e).__name__}: {e}")

    def _finish(self, step: int, tmp: Path, meta: dict[str, Any], reason: str, blocked: float,
                *, background: bool) -> None:
        """Rank 0 only: seal → publish → retention → event. Other ranks are done."""
        if self.rank != 0 or self._error is not None:
            return
        t0 = time.perf_counter()
        try:
            path, manifest = seal(tmp, self.root, step, meta, self.faults)
            upload_ms = 0.0
            if self.remote is not None:
                t1 = time.perf_counter()
                try:
                    self.remote.publish(path, manifest, self.faults)
                except Exception as e:
                    raise PublishError(f"publishing step {step} to {self.remote.url} failed "
                                       f"({type(e).__name__}: {e}); the local copy {path} is "
                                       "committed") from e
                upload_ms = (time.perf_counter() - t1) * 1e3
            deleted = apply_retention(self.root, self.keep, self.faults)
            if self.remote is not None:
                deleted = sorted(set(deleted) | set(self.remote.apply_retention(self.keep)))
        except BaseException as e:  # noqa: BLE001
            self._fail(step, reason, e)
            return
        seal_ms = (time.perf_counter() - t0) * 1e3
        self.events.emit("checkpoint", step=step, path=str(path), bytes=manifest.total_bytes,
                         reason=reason, mode=self.mode if background else "off",
                         format="dcp", shards=sum(1 for f in manifest.files
                                                  if f.endswith(".distcp")),
                         blocking_ms=round(blocked + (0.0 if background else seal_ms), 3),
                         seal_ms=round(seal_ms, 3), upload_ms=round(upload_ms, 3),
                         storage=self.remote.url if self.remote else "", deleted=deleted)

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
        raise CheckpointSaveError(f"saving checkpoint step {step} under {self.root} failed "
                                  f"on rank {self.rank}: {type(err).__name__}: {err}; "
                                  f"{keep}") from err

    def close(self) -> None:
        self.wait()
