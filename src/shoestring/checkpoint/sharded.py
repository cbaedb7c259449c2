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
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from shoestring.checkpoint.commit import SaveRequest, ms_since, publish_and_prune
from shoestring.checkpoint.faults import NO_FAULTS, FaultPlan
from shoestring.checkpoint.local import seal, step_dirname, write_file_durably
from shoestring.checkpoint.remote import RemoteStore
from shoestring.checkpoint.writer import Committed, Finish, Writer
from shoestring.events import EventLog

log = logging.getLogger("shoestring.checkpoint")

DCP_METADATA = ".metadata"


def sharded_tmp(root: Path, step: int) -> Path:
    """The temp dir every rank agrees on without talking (a rerun cleans it first)."""
    return root / f".tmp-{step_dirname(step)}-dcp"


def is_sharded(files: Mapping[str, Any]) -> bool:
    return DCP_METADATA in files


class ShardedWriter(Writer):
    """One per rank. At most one save in flight; rank 0 seals, publishes and prunes.

    ``mode``: ``thread`` (``dcp.async_save``, sealed in the background) or ``off``.
    """

    thread_name = "dcp-writer"

    def __init__(
        self,
        root: Path,
        *,
        rank: int,
        group: Any,
        keep: int,
        mode: str,
        events: EventLog,
        remote: RemoteStore | None = None,
        faults: FaultPlan = NO_FAULTS,
    ) -> None:
        super().__init__(root, keep=keep, mode=mode, events=events, remote=remote, faults=faults)
        self.rank, self.group = rank, group
        self.reports = rank == 0
        self.where = f" on rank {rank}"

    def _start(self, req: SaveRequest, background: bool) -> Finish:
        """This rank's own files, then its DCP shard: started (async) or deferred (sync)."""
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import async_save
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        if req.state is None:
            raise TypeError(
                "ShardedWriter: the SaveRequest has no DCP state (a files save goes to FileWriter)"
            )
        state = req.state
        tmp = sharded_tmp(self.root, req.step)
        tmp.mkdir(parents=True, exist_ok=True)
        for name, data in req.rank_files.items():
            write_file_durably(tmp / name, data)
        writer = FileSystemWriter(str(tmp), sync_files=True)
        if background:
            fut: Future[Any] = async_save(
                state,
                storage_writer=writer,  # type: ignore[assignment]
                process_group=self.group,
            )
            return lambda: self._finish(req, tmp, fut.result, background=True)

        def save() -> Any:
            return dcp_save(state, storage_writer=writer, process_group=self.group)

        return lambda: self._finish(req, tmp, save, background=False)

    def _finish(
        self, req: SaveRequest, tmp: Path, save: Callable[[], Any], *, background: bool
    ) -> Committed:
        """Wait for this rank's shard; rank 0 then seals → publishes → prunes."""
        t0 = time.perf_counter()
        save()  # rank 0: returns once every rank's shard is durable (.metadata written)
        if self.rank != 0:
            return Committed(None, ms_since(t0))
        t1 = time.perf_counter()
        path, manifest = seal(tmp, self.root, req.step, dict(req.meta), self.faults)
        upload_ms, deleted = publish_and_prune(
            path, manifest, root=self.root, keep=self.keep, remote=self.remote, faults=self.faults
        )
        seal_ms = ms_since(t1)
        fields = dict(
            step=req.step,
            path=str(path),
            bytes=manifest.total_bytes,
            reason=None,
            mode=self.mode if background else "off",
            format="dcp",
            shards=sum(1 for f in manifest.files if f.endswith(".distcp")),
            blocking_ms=None,
            seal_ms=seal_ms,
            upload_ms=upload_ms,
            storage=self.remote.url if self.remote else "",
            deleted=deleted,
        )
        return Committed(fields, ms_since(t0))
