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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from shoestring import exitcodes
from shoestring.checkpoint.faults import NO_FAULTS, FaultPlan
from shoestring.config import ConfigError, to_flat
from shoestring.hf import bnb_stored
from shoestring.hub import HubAccess, ModelRef, resolve
from shoestring.infer.adapter import LoraDelta
from shoestring.infer.clock import PassClock
from shoestring.infer.codecs import Scheme
from shoestring.infer.config import LATER_KEY_DEFAULTS, OUTPUT_KEYS, InferConfig, parse_size
from shoestring.infer.decode import Generated, GenState, Scored, generate_from, score, start
from shoestring.infer.engine import (
    PassStopped,
    StreamingCausalLM,
    kv_bytes_per_token,
    kv_scratch_per_token,
    read_config_json,
    steady_memory,
    stored_dtype,
)
from shoestring.infer.inputs import Input, read_input
from shoestring.infer.ledger import ChunkLedger, Pinned, RunRecord
from shoestring.infer.plan import Plan, check_setup, make_plan
from shoestring.infer.report import Progress, Stats, current_rss, print_summary
from shoestring.infer.report import summary as summary_of
from shoestring.infer.requests import Answering
from shoestring.infer.sampleparams import Sampling
from shoestring.infer.shards import ShardError, index_model
from shoestring.infer.stream import Prepare
from shoestring.infer.weights import Needs, weight_hook, weight_needs
from shoestring.infer.work import Work, output_lines, tokenize, tokenize_requests
from shoestring.preempt.flag import PreemptionFlag, SignalSource
from shoestring.rundir import hold


class Preempted(Exception):
    """The preemption flag was raised; committed chunks are safe."""


def default_run_dir(output: Path) -> Path:
    return output.with_name(output.name + ".run")


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
    job = InferJob.prepare(cfg, faults, stream, hub)
    job.created = created
    ledger = job.open_ledger()
    stats = Stats()
    if ledger.todo:
        stopped = ChunkLoop.start(job, ledger, stats).run()
        if stopped is not None:
            return job.preempted(stopped, ledger)
    return job.finish(ledger, stats)


@dataclass
class InferJob:
    """A prepared job: inputs tokenized, engine built, identity checked, memory planned."""

    cfg: InferConfig
    faults: FaultPlan
    stream: TextIO
    started: float  # time.perf_counter() when the job began
    model_dir: Path
    output: Path
    run_dir: Path
    work: Work
    tok: Any
    engine: StreamingCausalLM
    prior: RunRecord | None  # run.json of an earlier attempt
    identity: dict[str, Any]
    hook: Prepare | None  # what the reader thread does to each unit's tensors
    plan: Plan
    chunk_records: int
    created: int | None = None  # outputs' "created" (None: the run's first start)
    answering: Answering | None = None  # OpenAI batch jobs: what every line shares

    @classmethod
    def prepare(
        cls, cfg: InferConfig, faults: FaultPlan, stream: TextIO, hub: HubAccess | None = None
    ) -> InferJob:
        """Everything before the first chunk, cheapest checks first: bad input fails
        before anything is loaded (or downloaded), and another job's run directory is
        refused before anything is written into it."""
        started = time.perf_counter()
        hub = hub or HubAccess(Path.home() / ".cache" / "shoestring")
        _required_keys(cfg)
        given = read_input(Path(cfg.io.input), cfg.generate.mode, cfg.generate.max_new_tokens)
        ref = resolve(cfg.model.path, hub, key="--model (model.path)")
        model_dir = _model_dir(ref)
        output = Path(cfg.io.output)
        run_dir = Path(cfg.io.run_dir) if cfg.io.run_dir else default_run_dir(output)
        steady_memory()  # before anything is computed: oneDNN reads its cache size once
        adapter = _adapter(cfg, hub)
        if cfg.job.num_threads:
            torch.set_num_threads(cfg.job.num_threads)
        device = _device(cfg)
        tok = _load_tokenizer(model_dir)
        template = _chat_template(cfg)
        work = _work(cfg, given, tok, template, _context_length(model_dir))
        prior = RunRecord.read(run_dir)
        engine = _build_engine(cfg, model_dir, device, prior)
        if adapter is not None:
            adapter.check(set(engine.refs))
        identity = _identity(cfg, given.sha256, model_dir, adapter)
        if ref.kind != "local":  # unset for local dirs keeps older run dirs valid
            identity["model_source"] = ref.record()
        if template is not None:  # outputs depend on it; unset keeps older run dirs valid
            identity["chat_template_sha256"] = hashlib.sha256(template.encode()).hexdigest()
        if prior is not None:
            prior.check(identity)
        pinned = prior.pinned if prior is not None else Pinned()
        hook, plan = _weights_and_plan(cfg, engine, work, adapter, run_dir, identity, pinned)
        chunk_records = pinned.chunk_records or _chunk_records(cfg, plan, work)
        return cls(
            cfg,
            faults,
            stream,
            started,
            model_dir,
            output,
            run_dir,
            work,
            tok,
            engine,
            prior,
            identity,
            hook,
            plan,
            chunk_records,
        )

    @property
    def dtype_name(self) -> str:
        return str(self.engine.dtype).removeprefix("torch.")

    @property
    def streamed_bytes(self) -> int:
        """Bytes read from disk per pass: every unit that is not resident."""
        return sum(
            u.plan.read_bytes
            for i, u in enumerate(self.engine.units)
            if i not in self.plan.resident
        )

    def open_ledger(self) -> ChunkLedger:
        """Write run.json on a first attempt, open the ledger, announce the job."""
        record = self.prior or RunRecord.create(
            self.run_dir,
            self.identity,
            Pinned(
                self.plan.batch_size, self.plan.micro_tokens, self.chunk_records, self.dtype_name
            ),
            self.created,
        )
        if self.work.kind == "openai":
            self.answering = Answering(
                hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest(),
                self.model_dir.name,
                record.created if self.created is None else self.created,
            )
        ledger = ChunkLedger.open(
            self.run_dir,
            record.run_id,
            len(self.work.records),
            self.chunk_records,
            faults=self.faults,
            order=self.work.schedule(),
        )
        engine = self.engine
        ledger.log.emit(
            "infer_start",
            mode=self.cfg.generate.mode,
            input=self.work.kind,
            model=str(self.model_dir),
            records=len(self.work.records),
            chunks=ledger.n_chunks,
            chunks_done=len(ledger.done),
            chunk_records=self.chunk_records,
            device=str(engine.device),
            compress=self.cfg.compress.scheme,
            dtype=self.dtype_name,
            plan=self.plan.to_dict(),
            units=len(engine.units),
            model_bytes=sum(engine.unit_bytes),
            streamed_bytes_per_pass=self.streamed_bytes,
            pid=os.getpid(),
        )
        return ledger

    def preempted(self, stopped: Stopped, ledger: ChunkLedger) -> int:
        ledger.close()
        kept = (
            f", and chunk {stopped.chunk}'s first {stopped.saved_passes} passes"
            if stopped.saved_passes
            else ""
        )
        print(
            f"shoestring infer: preempted; {len(ledger.done)}/{ledger.n_chunks} chunks "
            f"committed in {ledger.chunks_root}{kept}. Rerun the same command to continue.",
            file=self.stream,
        )
        return exitcodes.PREEMPTED

    def finish(self, ledger: ChunkLedger, stats: Stats) -> int:
        """Every chunk is committed: write the output, log and print the summary."""
        summary = summary_of(
            self.engine, stats, self.plan, self.streamed_bytes, time.perf_counter() - self.started
        )
        nbytes = ledger.assemble(self.output)
        ledger.log.emit(
            "infer_end", status="completed", output=str(self.output), output_bytes=nbytes, **summary
        )
        ledger.close()
        print_summary(summary, self.output, self.stream)
        return exitcodes.OK


def _required_keys(cfg: InferConfig) -> None:
    for key, flag in (
        ("model.path", "--model"),
        ("io.input", "--input"),
        ("io.output", "--output"),
    ):
        if not to_flat(cfg)[key]:
            raise ConfigError(f"{flag} ({key}) is required")


def _model_dir(ref: ModelRef) -> Path:
    """The resolved model's folder; a pre-quantized (bitsandbytes) base is refused: its
    packed 4/8-bit tensors cannot be streamed (``--compress`` quantizes a 16-bit base
    on the fly instead)."""
    doc = json.loads((ref.path / "config.json").read_text())
    if isinstance(doc, dict) and bnb_stored(doc) != "none":
        raise ConfigError(
            f"--model (model.path): {ref.spec} is pre-quantized with bitsandbytes; infer "
            "streams 16/32-bit safetensors only: use the unquantized base (and --compress "
            "nf4 or int8 to stream it quantized)"
        )
    return ref.path


def _adapter(cfg: InferConfig, hub: HubAccess) -> LoraDelta | None:
    if not cfg.model.adapter:
        return None
    ref = resolve(cfg.model.adapter, hub, key="--adapter (model.adapter)", want="adapter")
    return LoraDelta(ref.path)


def _device(cfg: InferConfig) -> torch.device:
    return torch.device(
        "cuda"
        if cfg.model.device == "cuda" or (cfg.model.device == "auto" and torch.cuda.is_available())
        else "cpu"
    )


def _chat_template(cfg: InferConfig) -> str | None:
    """The ``generate.chat_template`` file's Jinja source, checked (None: the tokenizer's)."""
    if not cfg.generate.chat_template:
        return None
    from shoestring.data.chat import load_template
    from shoestring.data.records import DataError

    try:
        return load_template(cfg.generate.chat_template)
    except DataError as e:
        raise ConfigError(f"generate.chat_template: {e}") from None


def _context_length(model_dir: Path) -> int | None:
    """The model's context (``max_position_embeddings``), None when it names none."""
    try:
        n = read_config_json(model_dir).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return n if isinstance(n, int) and n > 0 else None


def _work(
    cfg: InferConfig, given: Input, tok: Any, template: str | None, context: int | None
) -> Work:
    """The input tokenized: an OpenAI batch file's requests, or the job's own lines
    (continued as ``generate.*`` says)."""
    g = cfg.generate
    if given.items is not None:
        return tokenize_requests(given.items, tok, template, context, g.seed, cfg.io.input)
    assert given.records is not None
    sampling = Sampling(g.max_new_tokens, g.temperature, g.top_p, g.top_k)
    return tokenize(given.records, tok, g.mode, template, sampling, context, g.seed)


def _load_tokenizer(model_dir: Path) -> Any:
    from shoestring.hf import load_tokenizer, quiet_hf

    quiet_hf()
    try:
        return load_tokenizer(model_dir)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"--model (model.path): cannot load a tokenizer from {model_dir}: {e}"
        ) from e


def _build_engine(
    cfg: InferConfig, model_dir: Path, device: torch.device, prior: RunRecord | None
) -> StreamingCausalLM:
    try:
        refs = index_model(model_dir)
        dtype = compute_dtype(
            cfg.model.dtype,
            stored_dtype(refs),
            cfg.compress.scheme,
            device,
            pinned=prior.pinned.dtype if prior is not None else None,
        )
        return StreamingCausalLM(
            model_dir, device=device, refs=refs, kv_bits=cfg.memory.kv_bits, dtype=dtype
        )
    except ShardError as e:
        raise ConfigError(f"--model (model.path): {e}") from e


def _identity(
    cfg: InferConfig, input_sha: str, model_dir: Path, adapter: LoraDelta | None
) -> dict[str, Any]:
    """What must not change between attempts of one run directory (run.json)."""
    from shoestring.hf import fingerprint

    flat = to_flat(cfg)
    return {
        "input_sha256": input_sha,
        "model": fingerprint(model_dir),
        "adapter": adapter.fingerprint if adapter else "",
        **{
            k: flat[k]
            for k in OUTPUT_KEYS
            if k not in ("model.path", "io.input")
            and not (k in LATER_KEY_DEFAULTS and flat[k] == LATER_KEY_DEFAULTS[k])
        },
    }


def _weights_and_plan(
    cfg: InferConfig,
    engine: StreamingCausalLM,
    work: Work,
    adapter: LoraDelta | None,
    run_dir: Path,
    identity: dict[str, Any],
    pinned: Pinned,
) -> tuple[Prepare | None, Plan]:
    """The reader's weight hook and the memory plan. A budget too small is refused
    before the compressed copy is written (planned on the copy's predicted sizes, and
    checked against what writing it holds); the plan is then made on the real sizes,
    with the runtime measured again."""
    name = cfg.compress.scheme
    scheme: Scheme | None = None if name == "none" else name
    budget = parse_size(cfg.memory.budget)
    predicted = weight_needs(engine, scheme, adapter)
    reserve = runtime_reserve(cfg.memory.runtime_reserve)
    _plan(cfg, engine, work, predicted, pinned, budget, reserve)
    check_setup(budget, reserve, predicted.build)
    hook, needs = weight_hook(
        engine,
        scheme,
        adapter,
        run_dir / f"weights-{name}",
        f"{identity['model']}:{identity['adapter']}:{name}",
    )
    reserve = runtime_reserve(cfg.memory.runtime_reserve)
    return hook, _plan(cfg, engine, work, needs, pinned, budget, reserve)


#: What the process adds once its passes run, beyond the plan's buffers and its RSS
#: when it planned: the kernels' first use (oneDNN primitives, OpenMP), masks and
#: rotary tables, allocator slack. Measured 7-19 MB over six modes of a 122 MB model,
#: with 1 and 2 threads (docs/inference.md).
FIRST_PASS_BYTES = 32 << 20
#: The measured runtime is rounded up to this, so a rerun plans the same from it.
_RUNTIME_GRAIN = 8 << 20


def runtime_reserve(setting: str) -> int:
    """The budget's runtime part: the process's RSS now (interpreter, torch, the
    tokenizer and tokenized input, the model skeleton, an adapter) plus
    :data:`FIRST_PASS_BYTES`, rounded up; ``setting`` (``memory.runtime_reserve``), if
    a size, only raises it."""
    measured = -(-(current_rss() + FIRST_PASS_BYTES) // _RUNTIME_GRAIN) * _RUNTIME_GRAIN
    return measured if setting == "auto" else max(measured, parse_size(setting))


def _plan(
    cfg: InferConfig,
    engine: StreamingCausalLM,
    work: Work,
    needs: Needs,
    pinned: Pinned,
    budget: int,
    reserve: int,
) -> Plan:
    new = work.most_new_tokens if cfg.generate.mode == "generate" else 0
    bits = cfg.memory.kv_bits
    return make_plan(
        budget=budget,
        reserve=reserve,
        unit_bytes=needs.read,
        unit_extra=needs.extra,
        unit_prepare=needs.prepare,
        kv_per_token=kv_bytes_per_token(engine.config, engine.dtype, bits) if new else 0,
        kv_scratch_per_token=kv_scratch_per_token(engine.config, engine.dtype, bits),
        sampling=any(c.temperature > 0 or c.logprobs >= 0 for c in work.choices),
        config=engine.config,
        itemsize=engine.dtype.itemsize,
        prompt_lens=[len(s) for seqs in work.seqs for s in seqs] or [1],  # (all errors)
        new_tokens=new,
        want_batch=cfg.memory.batch_size,
        micro_tokens=cfg.memory.micro_batch_tokens,
        depth=cfg.memory.prefetch_depth,
        want_resident=cfg.memory.resident,
        pinned_batch=pinned.batch_size,
        pinned_micro=pinned.micro_tokens,
        raw_kept=[engine.raw_kept(i) for i in range(len(engine.units))],
    )


def _chunk_records(cfg: InferConfig, plan: Plan, work: Work) -> int:
    """Records per chunk: a job batch's worth of sequences (or job.chunk_size, if less)."""
    per_record = max(1, max(len(s) for s in work.seqs))
    return max(1, min(cfg.job.chunk_size or plan.batch_size, plan.batch_size) // per_record)


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
    progress: Progress
    flag: PreemptionFlag = field(default_factory=PreemptionFlag)
    clock: PassClock = field(default_factory=PassClock)
    chunk: int = 0  # the chunk in flight
    state: GenState | None = None  # its generation (generate mode), saved on a stop

    @classmethod
    def start(cls, job: InferJob, ledger: ChunkLedger, stats: Stats) -> ChunkLoop:
        """Start the engine (reads the resident units) and the progress display."""
        job.engine.start(set(job.plan.resident), job.plan.depth, job.hook)
        progress = Progress(
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
        self.clock.start_chunk()
        results = self._compute(idx, flat)
        lines = output_lines(job.work, idx, job.cfg.generate.mode, results, job.tok, job.answering)
        ledger.commit(k, lines)
        self.state = None
        self.stats.prompts += len(idx)
        ledger.log.emit(
            "chunk",
            chunk=k,
            records=len(idx),
            seconds=round(time.perf_counter() - t0, 4),
            bytes_read=self._bytes_read() - read0,
            committed=len(ledger.done),
            of=ledger.n_chunks,
        )
        self.progress.update(ledger.records_done(), self._bytes_read())

    def _generation(self, k: int, flat: list[tuple[int, int]]) -> GenState:
        """Chunk ``k``'s saved generation state, or a fresh one before its prefill."""
        job = self.job
        return self.ledger.load_state(k, job.engine, len(flat)) or start(
            job.engine,
            [job.work.seqs[i][j] for i, j in flat],
            pad_id=job.work.pad_id,
            micro_tokens=job.plan.micro_tokens,
        )

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
        if act and act.startswith("slow"):
            time.sleep(seconds * int(act[4:]) / 100)
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


def compute_dtype(
    choice: str, stored: torch.dtype, scheme: str, device: torch.device, pinned: str | None = None
) -> torch.dtype:
    """The dtype the job computes in.

    A rerun keeps the one its run directory pinned (``pinned``; "stored" for run
    directories from before the choice was pinned), so outputs cannot change between
    chunks. 'auto' is exact (the checkpoint's dtype) unless compression is on and the
    checkpoint is float32: then bfloat16 if a bf16 matmul measures faster here. The
    output is already inexact with compression, and on CPUs with native bf16 dot
    products (AVX512-BF16, AMX) the matmuls of a streamed layer run several times
    faster (measured: docs/inference.md)."""
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if pinned == "stored":
        return stored
    if pinned:
        return names[pinned]
    if choice != "auto":
        return names[choice]
    if scheme == "none" or stored != torch.float32:
        return stored
    return torch.bfloat16 if bf16_is_faster(device) else stored


def bf16_is_faster(device: torch.device, reps: int = 5) -> bool:
    """Time a decode-sized matmul in fp32 and bf16 on ``device`` (well under a second on a CPU)."""
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    times: dict[torch.dtype, float] = {}
    g = torch.Generator().manual_seed(0)  # leaves the global RNG alone
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(64, 2048, generator=g).to(dt)
        w = torch.randn(2048, 2048, generator=g).to(dt)
        torch.nn.functional.linear(x, w)
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.nn.functional.linear(x, w)
        times[dt] = time.perf_counter() - t0
    return times[torch.bfloat16] * 1.3 < times[torch.float32]
