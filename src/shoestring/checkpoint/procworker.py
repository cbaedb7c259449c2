"""Process-based background commits: the writer runs in a separate process.

The training process copies the snapshot into one reused shared-memory buffer
(the blocking part) and sends only its index; the worker process serializes,
hashes, writes, uploads and prunes with its own interpreter, so none of that
competes for the training process's GIL. The buffer is reused only after the
previous job has finished (the writer waits first), so the worker never reads
a buffer that training is overwriting.

The worker asks the kernel to kill it when its parent dies (PR_SET_PDEATHSIG),
so a SIGKILLed run cannot leave an orphan still committing into the run dir.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from shoestring.checkpoint.commit import run_commit
from shoestring.checkpoint.faults import FaultPlan
from shoestring.checkpoint.remote import RemoteStore
from shoestring.checkpoint.snapshot import Snapshot
from shoestring.proc import die_with_parent

_ALIGN = 64


class ShmStager:
    """Copies snapshot tensors into one shared-memory byte buffer, reused across saves."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None

    def stage(
        self, snap: Snapshot
    ) -> tuple[torch.Tensor, list[tuple[str, str, str, list[int], int, int]]]:
        items = [(f, k, t) for f, d in sorted(snap.tensors.items()) for k, t in sorted(d.items())]
        total, layout = 0, []
        for f, k, t in items:
            n = t.numel() * t.element_size()
            layout.append((f, k, t, total, n))
            total += (n + _ALIGN - 1) // _ALIGN * _ALIGN
        if self.buf is None or self.buf.numel() < total:
            self.buf = torch.empty(max(total, 1), dtype=torch.uint8).share_memory_()
        index = []
        for f, k, t, off, n in layout:
            src = t.detach()
            if src.device.type != "cpu":
                src = src.to("cpu")
            self.buf[off : off + n].view(src.dtype).view(src.shape).copy_(src)
            index.append((f, k, str(src.dtype).removeprefix("torch."), list(src.shape), off, n))
        return self.buf, index


def unstage(
    buf: torch.Tensor, index: list[tuple[str, str, str, list[int], int, int]]
) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for f, k, dtype, shape, off, n in index:
        out.setdefault(f, {})[k] = buf[off : off + n].view(getattr(torch, dtype)).view(shape)
    return out


def worker_main(
    jobs: Any, results: Any, root: str, keep: int, remote_url: str, fault_spec: str
) -> None:
    """Entry point of the writer process: one job at a time until ``None``."""
    die_with_parent()
    torch.set_num_threads(1)
    # A fault "kill" in the worker must look like the machine dying: kill the parent too.
    faults = FaultPlan.parse(fault_spec, kill_pids=(os.getppid(),))
    remote = RemoteStore(remote_url) if remote_url else None
    results.put(("ready", None))
    while True:
        job = jobs.get()
        if job is None:
            return
        step, buf, index, documents, meta = job
        try:
            snap = Snapshot(step=step, tensors=unstage(buf, index), documents=documents, meta=meta)
            res = run_commit(snap, Path(root), keep, remote, faults)
            results.put(("ok", asdict(res)))
        except BaseException as e:  # noqa: BLE001 - sent back to the training process
            results.put(("error", _error_payload(e)))
        del buf


def _error_payload(e: BaseException) -> tuple[str, str, int | None, str | None, str]:
    """What the training process needs to raise ``e`` again: an OSError keeps its errno,
    its bare message (``strerror``, without the "[Errno N]" prefix ``str(e)`` adds) and
    its path."""
    err = e.errno if isinstance(e, OSError) else None
    msg = (e.strerror or str(e)) if isinstance(e, OSError) else str(e)
    filename = e.filename if isinstance(e, OSError) and e.filename is not None else None
    return (
        type(e).__name__,
        msg,
        err,
        None if filename is None else str(filename),
        traceback.format_exc(),
    )


class ProcessBackend:
    """Owns the worker process and the shared-memory stager."""

    def __init__(self, root: Path, keep: int, remote_url: str, fault_spec: str) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        self.jobs = ctx.Queue()
        self.results = ctx.Queue()
        self.proc = ctx.Process(
            target=worker_main,
            name="shoestring-ckpt-writer",
            daemon=True,
            args=(self.jobs, self.results, str(root), keep, remote_url, fault_spec),
        )
        self.proc.start()
        self.stager = ShmStager()
        self._ready = False

    def stage(self, snap: Snapshot) -> Snapshot:
        buf, index = self.stager.stage(snap)
        return Snapshot(
            step=snap.step,
            tensors={"__shm__": {"buf": buf}},
            documents=snap.documents,
            meta={"__index__": index, **snap.meta},
        )

    def run(self, staged: Snapshot) -> dict[str, Any]:
        if not self._ready:
            kind, _ = self.results.get()
            self._ready = kind == "ready"
        meta = dict(staged.meta)
        index = meta.pop("__index__")
        self.jobs.put(
            (staged.step, staged.tensors["__shm__"]["buf"], index, staged.documents, meta)
        )
        while True:
            try:
                kind, payload = self.results.get(timeout=1.0)
                break
            except Exception:  # queue.Empty
                if not self.proc.is_alive():
                    raise RuntimeError(
                        f"checkpoint writer process died (exit {self.proc.exitcode})"
                    ) from None
        if kind == "ok":
            return dict(payload)
        name, msg, err, filename, tb = payload
        if err is not None:  # the same OSError (errno, message, path), said once
            raise OSError(err, f"{msg} [in writer process: {name}]", filename)
        raise RuntimeError(f"{name}: {msg} [in writer process]\n{tb}")

    def close(self) -> None:
        if self.proc.is_alive():
            self.jobs.put(None)
            self.proc.join(timeout=10)
            if self.proc.is_alive():  # pragma: no cover
                self.proc.kill()
