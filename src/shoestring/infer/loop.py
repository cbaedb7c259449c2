"""The chunk loop: run the chunks still to do, committing each, until all are done or
the job is asked to stop; then save the generation state of the chunk in flight.

The preemption flag is polled after every pass and between the units of a pass
(:class:`~shoestring.infer.engine.PassStopped`); a stop saves the chunk in flight's
state (``infer/partial.py``) so a rerun continues from its next pass.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from shoestring.checkpoint.faults import Slow
from shoestring.infer.clock import PassClock
from shoestring.infer.decode import Generated, GenState, Scored, generate_from, score, start
from shoestring.infer.engine import PassStopped
from shoestring.infer.ledger import ChunkLedger
from shoestring.infer.prepare import InferJob
from shoestring.infer.report import PromptBar, Stats
from shoestring.infer.work import output_lines
from shoestring.preempt.flag import PreemptionFlag, SignalSource


class Preempted(Exception):
    """The preemption flag was raised; committed chunks are safe."""


@dataclass(frozen=True)
class Stopped:
    """Where a stop signal left the job."""

    chunk: int  # the chunk in flight
    saved_passes: int  # its passes whose state was saved (0: none)


@dataclass
class ChunkLoop:
    """Runs the chunks still to do, committing each, until all are done or it is asked to
    stop; then it saves the state of the chunk in flight."""

    job: InferJob
    ledger: ChunkLedger
    stats: Stats
    progress: PromptBar
    flag: PreemptionFlag = field(default_factory=PreemptionFlag)
    clock: PassClock = field(default_factory=PassClock)
    chunk: int = 0  # the chunk in flight
    state: GenState | None = None  # its generation (generate mode), saved on a stop

    @classmethod
    def start(cls, job: InferJob, ledger: ChunkLedger, stats: Stats) -> ChunkLoop:
        """Start the engine (reads the resident units) and the progress display."""
        job.engine.start(
            set(job.plan.resident), job.plan.depth, job.hook, prepare_at=job.plan.prepare_at
        )
        progress = PromptBar(
            len(job.work.records), ledger.records_done(), job.cfg.job.progress, job.stream
        )
        return cls(job, ledger, stats, progress, chunk=ledger.todo[0])

    def run(self) -> Stopped | None:
        """Run every chunk still to do; returns where it stopped, or None when all are
        committed. Closes the engine."""
        try:
            with SignalSource(self.flag, self.job.cfg.job.preempt_signal):
                for k in self.ledger.todo:
                    self._run_chunk(k)
                    if self.flag.is_set():
                        raise Preempted(self.flag.reason)
        except (Preempted, PassStopped) as e:
            return self._stopped(e)
        finally:
            self.progress.close()
            self.job.engine.close()
        return None

    def _run_chunk(self, k: int) -> None:
        job, ledger = self.job, self.ledger
        self.chunk = k
        t0, read0 = time.perf_counter(), self._bytes_read()
        idx = ledger.records(k)
        flat = job.work.sequences(idx)
        if job.cfg.generate.mode == "generate":
            self.state = self._generation(k, flat)
            self.stats.chunk_pass = self.state.step
        else:
            self.stats.chunk_pass = 0
            self.stats.count_prefill([job.work.seqs[i][j] for i, j in flat], None)
        self.clock.start_chunk()
        results = self._compute(idx, flat)
        lines = output_lines(job.work, idx, job.cfg.generate.mode, results, job.tok, job.answering)
        ledger.commit(k, lines)
        shared = self.state.prefix if self.state is not None else None
        self.state = None
        self.stats.prompts += len(idx)
        ledger.log.emit(
            "chunk",
            chunk=k,
            records=len(idx),
            shared_prefix=shared.to_dict() if shared is not None else None,
            seconds=round(time.perf_counter() - t0, 4),
            bytes_read=self._bytes_read() - read0,
            committed=len(ledger.done),
            of=ledger.n_chunks,
        )
        self.progress.update(ledger.records_done(), self._bytes_read())

    def _generation(self, k: int, flat: list[tuple[int, int]]) -> GenState:
        """Chunk ``k``'s saved generation state, or a fresh one before its prefill."""
        job = self.job
        loaded = self.ledger.load_state(k, job.engine, len(flat))
        if loaded is not None:
            return loaded
        prompts = [job.work.seqs[i][j] for i, j in flat]
        state = start(
            job.engine,
            prompts,
            pad_id=job.work.pad_id,
            micro_tokens=job.plan.micro_tokens,
            share_prefix=job.cfg.memory.share_prefix == "auto",
        )
        self.stats.count_prefill(prompts, state.prefix)
        return state

    def _compute(
        self, idx: Sequence[int], flat: list[tuple[int, int]]
    ) -> list[list[Generated] | list[Scored]]:
        """The chunk's results, per record, per sequence."""
        job, work = self.job, self.job.work
        outs: list[Any]
        if self.state is not None:
            outs = generate_from(
                job.engine,
                self.state,
                rules=work.rules(flat, job.tok, job.cfg.generate.stop_at_eos),
                pad_id=work.pad_id,
                on_pass=self._on_pass,
                stop=self._stop_requested,
            )
            self.stats.tokens += sum(len(o.tokens) for o in outs)
            held = [o for (i, _), o in zip(flat, outs) if work.continuations[i].grammar]
            self.stats.held += len(held)
            self.stats.held_cut += sum(o.finish == "length" for o in held)
        else:
            outs = score(
                job.engine,
                [(work.seqs[i][j], work.starts[i][j]) for i, j in flat],
                pad_id=work.pad_id,
                micro_tokens=job.plan.micro_tokens,
                on_pass=self._on_pass,
            )
            self.stats.tokens += sum(o.tokens for o in outs)
        grouped: dict[int, list[Any]] = {i: [] for i in idx}
        for (i, _j), o in zip(flat, outs):
            grouped[i].append(o)
        return [grouped[i] for i in idx]

    def _on_pass(self) -> None:
        """After each pass: count it, save the state if due, raise Preempted on a stop."""
        seconds = self.clock.end_pass(self.stats)
        act = self.job.faults.hit("step.forward")  # slowNN: a straggler, for preemption tests
        if isinstance(act, Slow):
            act.stretch(seconds)
        if (
            self.state is not None
            and not self.flag.is_set()
            and self.clock.save_due(self.job.cfg.job.save_every_s)
        ):
            self.ledger.save_state(self.chunk, self.state)
            self.clock.saved()
        self.clock.start_pass()
        self.progress.tick(self.stats.passes, self._bytes_read())
        self.job.faults.hit("step.end")
        if self.flag.is_set():
            raise Preempted(self.flag.reason)

    def _stop_requested(self) -> bool:
        """Asked between the units of a pass."""
        self.job.faults.hit("pass.unit")
        return self.flag.is_set()

    def _stopped(self, e: Preempted | PassStopped) -> Stopped:
        """Save the state of the chunk in flight (if it has done a pass) and log the stop."""
        reason = str(e) if isinstance(e, Preempted) else self.flag.reason
        notice_ms = round((time.time() - (self.flag.set_at or time.time())) * 1000, 1)
        saved = (
            self.ledger.save_state(self.chunk, self.state)
            if self.state is not None and self.state.step > 0
            else 0
        )
        self.ledger.log.emit(
            "preempt",
            reason=reason,
            chunks_done=len(self.ledger.done),
            of=self.ledger.n_chunks,
            notice_to_stop_ms=notice_ms,
            partial_passes=saved,
            mid_pass=isinstance(e, PassStopped),
        )
        return Stopped(self.chunk, saved)

    def _bytes_read(self) -> int:
        streamer = self.job.engine.streamer
        assert streamer is not None, "the engine is started"
        return streamer.reader.bytes_read
