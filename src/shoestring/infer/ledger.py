"""The run directory's ledger: the resumability guarantee of ``shoestring infer``.

``run.json`` says which job the directory belongs to (:class:`RunRecord`: identity,
pinned numerics); ``chunks/step-K/`` holds chunk K's committed output lines;
``partial/step-K/`` the generation state of chunk K saved when the job was stopped
mid-chunk. :class:`ChunkLedger` knows which chunks are committed and verified (the
rest are still to do), commits new ones, saves and loads the state of the chunk in
flight, and assembles the output once every chunk is there. Chunk K always holds
input records ``[K*C, (K+1)*C)``, so a rerun after any kill recomputes exactly the
missing chunks.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoestring.checkpoint.faults import NO_FAULTS, FaultPlan
from shoestring.checkpoint.local import (
    clean_stale,
    commit_local,
    committed_steps,
    quarantine,
    remove_checkpoint,
    step_dirname,
)
from shoestring.checkpoint.manifest import MANIFEST, CorruptCheckpoint, read_manifest, sha256_bytes
from shoestring.config import ConfigError
from shoestring.events import EventLog
from shoestring.fsio import atomic_write
from shoestring.infer import partial
from shoestring.infer.decode import GenState
from shoestring.infer.engine import StreamingCausalLM

RUN_FILE = "run.json"
CHUNK_FILE = "out.jsonl"


@dataclass(frozen=True)
class Pinned:
    """Numerics a rerun must keep, or its output bytes could change (None: not pinned)."""

    batch_size: int | None = None
    micro_tokens: int | None = None
    chunk_records: int | None = None
    dtype: str = "stored"  # run dirs from before it was pinned computed in the stored dtype

    def to_json(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "dtype": self.dtype,
            "micro_tokens": self.micro_tokens,
            "chunk_records": self.chunk_records,
        }


@dataclass(frozen=True)
class RunRecord:
    """``run.json``: which job a run directory belongs to, and its pinned numerics."""

    path: Path
    run_id: str
    identity: dict[str, Any]
    pinned: Pinned
    created: int = 0  # unix seconds of the first attempt (the outputs' "created")

    @classmethod
    def read(cls, run_dir: Path) -> RunRecord | None:
        """The record of an earlier attempt, or None for a new run directory."""
        path = run_dir / RUN_FILE
        if not path.is_file():
            return None
        obj = json.loads(path.read_text())
        p = obj["pinned"]
        return cls(
            path,
            obj["run_id"],
            obj["identity"],
            Pinned(
                p.get("batch_size"),
                p.get("micro_tokens"),
                p.get("chunk_records"),
                p.get("dtype", "stored"),
            ),
            int(obj.get("created", path.stat().st_mtime)),
        )

    @classmethod
    def create(
        cls, run_dir: Path, identity: dict[str, Any], pinned: Pinned, created: int | None = None
    ) -> RunRecord:
        """Write a new ``run.json`` durably (temp file, fsync, rename); ``created``
        defaults to now."""
        run_dir.mkdir(parents=True, exist_ok=True)
        when = int(time.time()) if created is None else created
        record = cls(run_dir / RUN_FILE, uuid.uuid4().hex[:12], identity, pinned, when)
        write_json_durably(
            record.path,
            {
                "run_id": record.run_id,
                "identity": identity,
                "pinned": pinned.to_json(),
                "created": when,
            },
        )
        return record

    def check(self, identity: dict[str, Any]) -> None:
        """Refuse to resume another job here: ConfigError naming the keys that differ."""
        if self.identity == identity:
            return
        keys = identity.keys() | self.identity.keys()
        diff = sorted(k for k in keys if self.identity.get(k) != identity.get(k))
        raise ConfigError(
            f"{self.path}: this run directory belongs to a different job "
            f"({', '.join(diff)} changed); use another --output or --run-dir"
        )


def write_json_durably(path: Path, obj: Any) -> None:
    atomic_write(path, json.dumps(obj, indent=2, sort_keys=True).encode())


@dataclass
class ChunkLedger:
    """Committed chunks of one run directory, and the saved state of the one in flight."""

    run_dir: Path
    run_id: str
    n_records: int
    chunk_records: int
    log: EventLog
    faults: FaultPlan
    done: set[int]
    order: list[int] | None = None  # the records in schedule order (None: input order)

    @classmethod
    def open(
        cls,
        run_dir: Path,
        run_id: str,
        n_records: int,
        chunk_records: int,
        *,
        faults: FaultPlan = NO_FAULTS,
        order: list[int] | None = None,
    ) -> ChunkLedger:
        """Open the event log, drop stale temp dirs, verify every committed chunk
        (a bad one is quarantined and redone) and drop saved states of chunks that
        committed after their state was saved (a kill between the two). ``order``:
        the records in the order chunks take them (a function of the input only, so
        every attempt forms the same chunks); the output is still in input order."""
        log = EventLog(run_dir / "events.jsonl", run_id=run_id)
        ledger = cls(run_dir, run_id, n_records, chunk_records, log, faults, set(), order)
        clean_stale(ledger.chunks_root)
        ledger.done = ledger._verified_chunks()
        clean_stale(ledger.partial_root)
        for k in committed_steps(ledger.partial_root):
            if k in ledger.done:
                remove_checkpoint(ledger.partial_root / step_dirname(k))
        faults.hit("resume.after_load")
        return ledger

    @property
    def chunks_root(self) -> Path:
        return self.run_dir / "chunks"

    @property
    def partial_root(self) -> Path:
        return self.run_dir / "partial"

    @property
    def n_chunks(self) -> int:
        return -(-self.n_records // self.chunk_records)

    @property
    def todo(self) -> list[int]:
        """Chunks not committed yet, in order."""
        return [k for k in range(self.n_chunks) if k not in self.done]

    def records(self, chunk: int) -> Sequence[int]:
        """The input records chunk ``chunk`` holds, in the order its lines are written."""
        at = range(
            chunk * self.chunk_records, min((chunk + 1) * self.chunk_records, self.n_records)
        )
        return at if self.order is None else self.order[at.start : at.stop]

    def records_done(self) -> int:
        return sum(len(self.records(k)) for k in self.done)

    def _verified_chunks(self) -> set[int]:
        """Committed chunks whose bytes match their manifest; bad ones are quarantined."""
        good = set()
        for k in committed_steps(self.chunks_root):
            path = self.chunks_root / step_dirname(k)
            try:
                man = read_manifest(path)
                data = (path / CHUNK_FILE).read_bytes()
                if sha256_bytes(data) != man.files[CHUNK_FILE].sha256:
                    raise CorruptCheckpoint(f"{path}: {CHUNK_FILE} does not match its manifest")
                good.add(k)
            except (CorruptCheckpoint, OSError, KeyError) as e:
                self.log.emit(
                    "chunk_invalid", chunk=k, error=str(e), quarantined=str(quarantine(path))
                )
        return good

    def commit(self, chunk: int, lines: bytes) -> None:
        """Commit chunk ``chunk``'s output lines; its saved state is then obsolete."""
        rec = self.records(chunk)
        where = [rec.start, rec.stop] if isinstance(rec, range) else list(rec)
        commit_local(
            self.chunks_root,
            chunk,
            {CHUNK_FILE: lines},
            {"records": where, "run_id": self.run_id},
            self.faults,
        )
        saved = self.partial_root / step_dirname(chunk)
        if saved.exists():
            remove_checkpoint(saved)
        self.done.add(chunk)

    def load_state(self, chunk: int, engine: StreamingCausalLM, n_seqs: int) -> GenState | None:
        """The saved generation state of ``chunk``, or None (none saved, or unusable: then
        it is quarantined and the chunk starts over)."""
        path = self.partial_root / step_dirname(chunk)
        if not (path / MANIFEST).is_file():
            return None
        try:
            state = partial.load(path, engine, n_seqs)
        except (CorruptCheckpoint, OSError, KeyError, ValueError) as e:
            self.log.emit(
                "partial_invalid", chunk=chunk, error=str(e), quarantined=str(quarantine(path))
            )
            return None
        self.log.emit("partial_loaded", chunk=chunk, passes=state.step)
        return state

    def save_state(self, chunk: int, state: GenState) -> int:
        """Save the running chunk's state; returns the passes it holds (0: not saved).

        A failure to save (a full disk) is logged, not raised: the job goes on (or exits
        75) with the committed chunks and any state saved before intact."""
        t0 = time.perf_counter()
        try:
            path, nbytes = partial.save(
                self.partial_root,
                chunk,
                state,
                {"chunk": chunk, "run_id": self.run_id},
                self.faults,
            )
        except (partial.Unsupported, OSError) as e:
            self.log.emit("partial_skipped", chunk=chunk, passes=state.step, reason=str(e))
            return 0
        self.log.emit(
            "partial_saved",
            chunk=chunk,
            passes=state.step,
            bytes=nbytes,
            seconds=round(time.perf_counter() - t0, 4),
            path=str(path),
        )
        return state.step

    def assemble(self, output: Path) -> int:
        """Write ``output`` from every chunk at once (temp file, fsync, rename); returns
        its bytes. Call only when :attr:`todo` is empty."""
        output.parent.mkdir(parents=True, exist_ok=True)
        parts = [
            (self.chunks_root / step_dirname(k) / CHUNK_FILE).read_bytes()
            for k in range(self.n_chunks)
        ]
        if self.order is None:
            data = b"".join(parts)
        else:  # one line per record, chunk by chunk in schedule order: back to input order
            lines = [line for part in parts for line in part.splitlines(keepends=True)]
            by_record: list[bytes] = [b""] * self.n_records
            for i, line in zip(self.order, lines, strict=True):
                by_record[i] = line
            data = b"".join(by_record)
        atomic_write(output, data)
        return len(data)

    def close(self) -> None:
        self.log.close()
