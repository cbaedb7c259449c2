"""The preemptible batch job: prepare, open the ledger, run the chunks, finish.

Layout of the run directory (``OUTPUT.run`` unless ``io.run_dir`` is set)::

    run.json            job identity (input sha256, model, output-affecting keys)
                        and the pinned numerics (batch, micro-batch size)
    events.jsonl        infer_start, chunk, preempt, infer_end (docs/inference.md)
    chunks/step-0000000K/  chunk K's output lines, committed with the checkpoint
                        protocol (temp dir, fsync, manifest last, rename)
    partial/step-0000000K/ the generation state of chunk K when the job was asked to
                        stop mid-chunk (infer/partial.py); removed once K commits
    weights-int8/       the compressed copy of the layers, if compress.scheme is set
    weights-decoded-bfloat16/  the layers decoded once, if compress.decode_once is set

Chunk K always holds input records [K*C, (K+1)*C) and is computed with the
same batch grouping, so a rerun after any kill recomputes exactly the missing
chunks to the same bytes (the ledger, infer/ledger.py); the output file is
assembled from the ledger at the end (temp file, fsync, rename), so it is either
absent or complete. A chunk stopped by a preemption signal is not recomputed from
its prefill: the job stops between two layers of the pass it is in, cuts the KV
caches back to the last whole pass, saves the generation state (also every
``job.save_every_s``), and the rerun continues from the next pass on the same tensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import TextIO

from shoestring import exitcodes
from shoestring.checkpoint.faults import NO_FAULTS, FaultPlan
from shoestring.hub import HubAccess
from shoestring.infer.config import InferConfig
from shoestring.infer.ledger import ChunkLedger, Pinned, RunRecord
from shoestring.infer.loop import ChunkLoop, Stopped
from shoestring.infer.prepare import InferJob, default_run_dir, prepare
from shoestring.infer.report import Stats, print_summary
from shoestring.infer.report import summary as summary_of
from shoestring.infer.requests import Answering
from shoestring.rundir import hold


def run_infer(
    cfg: InferConfig,
    *,
    faults: FaultPlan = NO_FAULTS,
    stream: TextIO = sys.stderr,
    created: int | None = None,
    hub: HubAccess | None = None,
) -> int:
    """Run (or resume) the job described by ``cfg``; returns an exit code. One job at a
    time per run directory (its ``.lock``; a second is refused with exit 2).
    ``created``: the time OpenAI batch outputs carry (``SOURCE_DATE_EPOCH``), else the
    first attempt's start. ``hub``: how a model id or bucket URL in ``--model`` or
    ``--adapter`` is fetched (default: the Hub's defaults, no buckets)."""
    hub = hub or HubAccess(Path.home() / ".cache" / "shoestring")
    if not cfg.io.output:
        return _run_infer(cfg, faults, stream, created, hub)  # prepare names the missing key
    run_dir = Path(cfg.io.run_dir) if cfg.io.run_dir else default_run_dir(Path(cfg.io.output))
    with hold(run_dir, "wait for it to end, or write to another --output"):
        return _run_infer(cfg, faults, stream, created, hub)


def _run_infer(
    cfg: InferConfig, faults: FaultPlan, stream: TextIO, created: int | None, hub: HubAccess
) -> int:
    job = prepare(cfg, faults, stream, hub)
    job.created = created
    ledger = open_ledger(job)
    stats = Stats()
    if ledger.todo:
        stopped = ChunkLoop.start(job, ledger, stats).run()
        if stopped is not None:
            return preempted(job, stopped, ledger)
    return finish(job, ledger, stats)


def open_ledger(job: InferJob) -> ChunkLedger:
    """Write run.json on a first attempt, open the ledger, announce the job."""
    record = job.prior or RunRecord.create(
        job.run_dir,
        job.identity,
        Pinned(job.plan.batch_size, job.plan.micro_tokens, job.chunk_records, job.dtype_name),
        job.created,
    )
    if job.work.kind == "openai":
        job.answering = Answering(
            hashlib.sha256(json.dumps(job.identity, sort_keys=True).encode()).hexdigest(),
            job.model_dir.name,
            record.created if job.created is None else job.created,
        )
    ledger = ChunkLedger.open(
        job.run_dir,
        record.run_id,
        len(job.work.records),
        job.chunk_records,
        faults=job.faults,
        order=job.work.schedule(),
    )
    engine = job.engine
    ledger.log.emit(
        "infer_start",
        mode=job.cfg.generate.mode,
        input=job.work.kind,
        model=str(job.model_dir),
        records=len(job.work.records),
        chunks=ledger.n_chunks,
        chunks_done=len(ledger.done),
        chunk_records=job.chunk_records,
        device=str(engine.device),
        compress=job.cfg.compress.scheme,
        decode_once=job.cfg.compress.decode_once,
        dtype=job.dtype_name,
        plan=job.plan.to_dict(),
        units=len(engine.units),
        model_bytes=sum(engine.unit_bytes),
        streamed_bytes_per_pass=job.streamed_bytes,
        setup_s=round(time.perf_counter() - job.started, 3),  # a copy's writing included
        pid=os.getpid(),
        **({"tool_syntax": job.work.tool_syntax.source} if job.work.tool_syntax else {}),
    )
    return ledger


def preempted(job: InferJob, stopped: Stopped, ledger: ChunkLedger) -> int:
    ledger.close()
    kept = (
        f", and chunk {stopped.chunk}'s first {stopped.saved_passes} passes"
        if stopped.saved_passes
        else ""
    )
    print(
        f"shoestring infer: preempted; {len(ledger.done)}/{ledger.n_chunks} chunks "
        f"committed in {ledger.chunks_root}{kept}. Rerun the same command to continue.",
        file=job.stream,
    )
    return exitcodes.PREEMPTED


def finish(job: InferJob, ledger: ChunkLedger, stats: Stats) -> int:
    """Every chunk is committed: write the output, log and print the summary."""
    summary = summary_of(
        job.engine, stats, job.plan, job.streamed_bytes, time.perf_counter() - job.started
    )
    nbytes = ledger.assemble(job.output)
    ledger.log.emit(
        "infer_end", status="completed", output=str(job.output), output_bytes=nbytes, **summary
    )
    ledger.close()
    print_summary(summary, job.output, job.stream)
    return exitcodes.OK
