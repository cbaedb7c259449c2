"""lm-eval's batches of requests run as inference jobs, one folder per batch.

A batch's folder is named by the hash of everything its output depends on (the
mode, the token limit, the input lines, the model and numerics keys), so the same
command finds the same folder again: a rerun hands it to :func:`run_infer`, whose
own chunk ledger resumes an interrupted job (and finds a finished one finished);
this module keeps no state of its own.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from shoestring.checkpoint.faults import NO_FAULTS, FaultPlan
from shoestring.config import to_flat
from shoestring.events import EventLog
from shoestring.fsio import atomic_write
from shoestring.hub import HubAccess
from shoestring.infer.config import OUTPUT_KEYS, GenerateConfig, InferConfig, IOConfig, Mode


class JobStopped(Exception):
    """An inference job ended without its output (preempted: rerun the command)."""

    def __init__(self, code: int, folder: Path) -> None:
        super().__init__(f"inference job {folder} stopped with exit code {code}")
        self.code = code
        self.folder = folder


class Refused(NotImplementedError):
    """A request the backend does not answer (rolling likelihood, sampling, a prompt
    longer than the context): one line naming the task, exit 2."""


@dataclass(frozen=True)
class Batch:
    """One job's work: its input lines, in lm-eval's request order."""

    mode: Mode
    lines: list[dict[str, Any]]
    max_new_tokens: int = 1

    def data(self) -> bytes:
        return "".join(json.dumps(x, sort_keys=True) + "\n" for x in self.lines).encode()


@dataclass(frozen=True)
class JobEnv:
    """What the command line's edge hands every job: fault injection (tests), how a
    model id or bucket URL is fetched, where progress goes."""

    faults: FaultPlan = field(default_factory=lambda: NO_FAULTS)
    hub: HubAccess | None = None
    stream: TextIO = sys.stderr


@dataclass
class InferJobs:
    """Runs batches as inference jobs configured as ``base`` (model, memory,
    compression, job keys) in folders under ``root``; logs each to ``log``."""

    base: InferConfig
    root: Path
    log: EventLog
    env: JobEnv = field(default_factory=JobEnv)

    def folder(self, batch: Batch) -> Path:
        keys = {k: v for k, v in to_flat(self.base).items() if k in OUTPUT_KEYS}
        h = hashlib.sha256(json.dumps([batch.mode, batch.max_new_tokens, keys]).encode())
        h.update(batch.data())
        return self.root / f"{batch.mode}-{h.hexdigest()[:16]}"

    def run(self, batch: Batch) -> list[dict[str, Any]]:
        """The output lines of ``batch``, in input order (raises :class:`JobStopped`)."""
        from shoestring.infer.job import run_infer

        folder = self.folder(batch)
        folder.mkdir(parents=True, exist_ok=True)
        given = folder / "input.jsonl"
        if not given.exists():
            atomic_write(given, batch.data())
        cfg = self.job_config(folder, batch)
        resumed = (folder / "run" / "run.json").exists()
        self.log.emit(
            "evaluate_job",
            mode=batch.mode,
            requests=len(batch.lines),
            dir=str(folder),
            resumed=resumed,
        )
        env = self.env
        code = run_infer(cfg, faults=env.faults, stream=env.stream, hub=env.hub)
        _release_memory()
        if code != 0:
            raise JobStopped(code, folder)
        text = Path(cfg.io.output).read_text(encoding="utf-8")
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def job_config(self, folder: Path, batch: Batch) -> InferConfig:
        gen = replace(
            GenerateConfig(), mode=batch.mode, max_new_tokens=max(1, batch.max_new_tokens)
        )
        io = IOConfig(
            input=str(folder / "input.jsonl"),
            output=str(folder / "output.jsonl"),
            run_dir=str(folder / "run"),
        )
        return replace(self.base, io=io, generate=gen)


def _release_memory() -> None:
    """Hand what a finished job held (its resident layers, buffers) back to the OS: the
    next job measures the process's RSS as its runtime share of the same budget."""
    import gc

    from shoestring.heap import trim_heap

    gc.collect()
    trim_heap()
