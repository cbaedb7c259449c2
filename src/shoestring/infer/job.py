"""The preemptible batch job: chunks, a ledger of committed chunks, exact resume.

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
chunks to the same bytes; the output file is assembled from the ledger at the
end (temp file, fsync, rename), so it is either absent or complete. A chunk
stopped by a preemption signal is not recomputed from its prefill: the job stops
between two layers of the pass it is in, cuts the KV caches back to the last whole
pass, saves the generation state (also every ``job.save_every_s``), and the rerun
continues from the next pass on the same tensors.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

import torch

from shoestring import exitcodes
from shoestring.checkpoint.faults import NO_FAULTS, FaultPlan
from shoestring.checkpoint.local import (clean_stale, commit_local, committed_steps, fsync_dir,
                                         quarantine, remove_checkpoint, step_dirname,
                                         write_file_durably)
from shoestring.checkpoint.manifest import (MANIFEST, CorruptCheckpoint, read_manifest,
                                            sha256_bytes)
from shoestring.config import ConfigError, to_flat
from shoestring.events import EventLog
from shoestring.infer.config import OUTPUT_KEYS, InferConfig, parse_size
from shoestring.infer import partial
from shoestring.infer.decode import GenState, generate_from, score, start
from shoestring.infer.engine import (PassStopped, StreamingCausalLM, kv_bytes_per_token,
                                     stored_dtype)
from shoestring.infer.inputs import Record, read_records
from shoestring.infer.plan import Plan, make_plan
from shoestring.infer.report import Progress, Stats, print_summary
from shoestring.infer.report import summary as summary_of
from shoestring.infer.shards import ShardError, index_model
from shoestring.preempt.flag import PreemptionFlag, SignalSource

CHUNK_FILE = "out.jsonl"


class Preempted(Exception):
    """The preemption flag was raised; committed chunks are safe."""


def default_run_dir(output: Path) -> Path:
    return output.with_name(output.name + ".run")


@dataclass
class Work:
    """Tokenized job: one or more sequences per record."""

    records: list[Record]
    seqs: list[list[list[int]]]  # per record: its sequences (prompt [+ completion] tokens)
    starts: list[list[int]]  # per record: index of the first completion token (score mode)
    eos_ids: set[int] = field(default_factory=set)
    pad_id: int = 0


def tokenize(records: list[Record], tok: Any, mode: str) -> Work:
    seqs, starts = [], []
    for r in records:
        ctx = tok(r.prompt)["input_ids"]
        if mode == "generate":
            if not ctx:
                raise ConfigError(f"io.input: line {r.line}: the prompt has no tokens")
            seqs.append([ctx])
            starts.append([len(ctx)])
            continue
        if not ctx:
            raise ConfigError(f"io.input: line {r.line}: score mode needs a non-empty prompt "
                              "(the first completion token is predicted from it)")
        outs = [r.completion] if r.completion is not None else list(r.choices or ())
        conts = [tok(c, add_special_tokens=False)["input_ids"] for c in outs]
        seqs.append([ctx + c for c in conts])
        starts.append([len(ctx)] * len(conts))
    eos = tok.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    pad = tok.pad_token_id if tok.pad_token_id is not None else (min(eos_ids) if eos_ids else 0)
    return Work(records, seqs, starts, eos_ids, pad)


def _model_id(model_dir: Path) -> str:
    from shoestring.train.model import fingerprint

    return fingerprint(model_dir)


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    write_file_durably(tmp, json.dumps(obj, indent=2, sort_keys=True).encode())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _chunk_lines(work: Work, idx: range, mode: str, results: list[Any], tok: Any) -> bytes:
    lines = []
    for k, i in enumerate(idx):
        r = work.records[i]
        rec: dict[str, Any] = {"index": r.line - 1}
        if r.id is not None:
            rec["id"] = r.id
        res = results[k]
        if mode == "generate":
            g = res[0]
            rec.update(completion=tok.decode(g.tokens, skip_special_tokens=True),
                       tokens=len(g.tokens), finish=g.finish)
        elif r.completion is not None:
            s = res[0]
            rec.update(logprob=s.logprob, tokens=s.tokens, greedy=s.greedy)
        else:
            lps = [s.logprob for s in res]
            best = max(range(len(lps)), key=lambda j: (lps[j], -j))
            rec.update(choice=best, label=r.choices[best], logprobs=lps,  # type: ignore[index]
                       tokens=[s.tokens for s in res])
        lines.append(json.dumps(rec, ensure_ascii=False))
    return ("\n".join(lines) + "\n").encode()


def _verified_chunks(root: Path, log: EventLog) -> set[int]:
    """Committed chunks whose bytes match their manifest; bad ones are quarantined."""
    good = set()
    for k in committed_steps(root):
        path = root / step_dirname(k)
        try:
            man = read_manifest(path)
            data = (path / CHUNK_FILE).read_bytes()
            if sha256_bytes(data) != man.files[CHUNK_FILE].sha256:
                raise CorruptCheckpoint(f"{path}: {CHUNK_FILE} does not match its manifest")
            good.add(k)
        except (CorruptCheckpoint, OSError, KeyError) as e:
            log.emit("chunk_invalid", chunk=k, error=str(e), quarantined=str(quarantine(path)))
    return good


def _assemble(root: Path, n_chunks: int, output: Path) -> int:
    output.parent.mkdir(parents=True, exist_ok=True)
    data = b"".join((root / step_dirname(k) / CHUNK_FILE).read_bytes() for k in range(n_chunks))
    tmp = output.with_name(f".{output.name}.tmp-{uuid.uuid4().hex[:8]}")
    write_file_durably(tmp, data)
    os.replace(tmp, output)
    fsync_dir(output.parent)
    return len(data)


def compute_dtype(choice: str, stored: torch.dtype, scheme: str, device: torch.device,
                  pinned: str | None = None) -> torch.dtype:
    """The dtype the job computes in.

    A rerun keeps the one its run directory pinned (``pinned``; "stored" for run
    directories from before the choice was pinned), so outputs cannot change between
    chunks. 'auto' is exact (the checkpoint's dtype) unless compression is on and the
    checkpoint is float32: then bfloat16 if a bf16 matmul measures faster here. The
    output is already inexact with compression, and on CPUs with native bf16 dot
    products (AVX512-BF16, AMX) the matmuls of a streamed layer run ~3x faster."""
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
    """Time a decode-sized matmul in fp32 and bf16 on ``device`` (~50 ms on a CPU)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    times = {}
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


def run_infer(cfg: InferConfig, *, faults: FaultPlan = NO_FAULTS,
              stream: TextIO = sys.stderr) -> int:
    """Run (or resume) the job described by ``cfg``; returns an exit code."""
    t_start = time.perf_counter()
    for key, flag in (("model.path", "--model"), ("io.input", "--input"),
                      ("io.output", "--output")):
        if not to_flat(cfg)[key]:
            raise ConfigError(f"{flag} ({key}) is required")
    model_dir = Path(cfg.model.path).expanduser()
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"--model (model.path): {model_dir} is not a Hugging Face model "
                          "directory (no config.json)")
    mode = cfg.generate.mode
    records, input_sha = read_records(Path(cfg.io.input), mode)
    output = Path(cfg.io.output)
    run_dir = Path(cfg.io.run_dir) if cfg.io.run_dir else default_run_dir(output)
    budget = parse_size(cfg.memory.budget)
    reserve = parse_size(cfg.memory.runtime_reserve)
    adapter = None
    if cfg.model.adapter:
        from shoestring.infer.adapter import LoraDelta

        adapter = LoraDelta(Path(cfg.model.adapter))
    if cfg.job.num_threads:
        torch.set_num_threads(cfg.job.num_threads)
    device = torch.device("cuda" if cfg.model.device == "cuda" or (
        cfg.model.device == "auto" and torch.cuda.is_available()) else "cpu")

    from shoestring.train.model import load_tokenizer, quiet_hf

    quiet_hf()
    try:
        tok = load_tokenizer(model_dir)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--model (model.path): cannot load a tokenizer from {model_dir}: "
                          f"{e}") from e
    work = tokenize(records, tok, mode)
    run_json = run_dir / "run.json"
    prior = json.loads(run_json.read_text()) if run_json.is_file() else None
    try:
        refs = index_model(model_dir)
        dtype = compute_dtype(cfg.model.dtype, stored_dtype(refs), cfg.compress.scheme,
                              device, pinned=prior["pinned"].get("dtype", "stored")
                              if prior else None)
        engine = StreamingCausalLM(model_dir, device=device, refs=refs,
                                   kv_bits=cfg.memory.kv_bits, dtype=dtype)
    except ShardError as e:
        raise ConfigError(f"--model (model.path): {e}") from e
    if adapter is not None:
        adapter.check(set(engine.refs))

    # ---- job identity and pinned numerics (run.json)
    flat = to_flat(cfg)
    identity = {"input_sha256": input_sha, "model": _model_id(model_dir),
                "adapter": adapter.fingerprint if adapter else "",
                **{k: flat[k] for k in OUTPUT_KEYS if k not in ("model.path", "io.input")
                   and not (k == "memory.kv_bits" and flat[k] == 16)  # older run dirs
                   and not (k == "model.dtype" and flat[k] == "auto")}}  # stay valid
    if prior is not None and prior["identity"] != identity:
        diff = sorted(k for k in identity if prior["identity"].get(k) != identity[k])
        raise ConfigError(f"{run_json}: this run directory belongs to a different job "
                          f"({', '.join(diff)} changed); use another --output or --run-dir")

    # ---- compression (once, into the run dir) and the memory plan
    prepare = None
    unit_extra = [0] * len(engine.units)
    if cfg.compress.scheme != "none":
        from shoestring.infer.quant import build_compressed, use_compressed

        src_id = f"{identity['model']}:{identity['adapter']}:{cfg.compress.scheme}"
        merge = (lambda k, t: adapter.merge_(k, t.float().clone())) if adapter else None
        dest = build_compressed(engine, run_dir / f"weights-{cfg.compress.scheme}",
                                cfg.compress.scheme, src_id, merge)
        prepare_q, unit_extra = use_compressed(engine, dest)
        if adapter is not None:  # layers are merged in the copy; embed/head still need it
            def prepare(i: int, t: dict[str, torch.Tensor], s: Any) -> dict[str, torch.Tensor]:
                out = prepare_q(i, t, s)
                if not engine.units[i].name.startswith("layers."):
                    for k, v in out.items():
                        adapter.merge_(k, v)  # type: ignore[union-attr]
                return out
        else:
            prepare = prepare_q
    elif adapter is not None:
        def prepare(i: int, t: dict[str, torch.Tensor], s: Any) -> dict[str, torch.Tensor]:
            for k, v in t.items():
                adapter.merge_(k, v)  # type: ignore[union-attr]
            return t

    unit_extra = [x + engine.cast_bytes(i) for i, x in enumerate(unit_extra)]
    per_record = max(len(s) for s in work.seqs)
    lens = [len(s) for seqs in work.seqs for s in seqs]
    new = cfg.generate.max_new_tokens if mode == "generate" else 0
    pinned = prior["pinned"] if prior else {}
    plan: Plan = make_plan(
        budget=budget, reserve=reserve, unit_bytes=engine.unit_bytes, unit_extra=unit_extra,
        kv_per_token=kv_bytes_per_token(engine.config, engine.dtype,
                                        cfg.memory.kv_bits) if new else 0,
        config=engine.config, itemsize=engine.dtype.itemsize, prompt_lens=lens,
        new_tokens=new, want_batch=cfg.memory.batch_size,
        micro_tokens=cfg.memory.micro_batch_tokens, depth=cfg.memory.prefetch_depth,
        want_resident=cfg.memory.resident, pinned_batch=pinned.get("batch_size"),
        pinned_micro=pinned.get("micro_tokens"),
        raw_kept=[engine.raw_kept(i) for i in range(len(engine.units))])
    chunk = pinned.get("chunk_records") or max(1, min(cfg.job.chunk_size or plan.batch_size,
                                                      plan.batch_size) // per_record)
    if prior is None:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_json(run_json, {"run_id": uuid.uuid4().hex[:12], "identity": identity,
                               "pinned": {"batch_size": plan.batch_size,
                                          "dtype": str(engine.dtype).removeprefix("torch."),
                                          "micro_tokens": plan.micro_tokens,
                                          "chunk_records": chunk}})
    run_id = json.loads(run_json.read_text())["run_id"]
    n_chunks = -(-len(records) // chunk)
    root = run_dir / "chunks"
    log = EventLog(run_dir / "events.jsonl", run_id=run_id)
    clean_stale(root)
    done = _verified_chunks(root, log)
    partial_root = run_dir / "partial"
    clean_stale(partial_root)
    for k in committed_steps(partial_root):
        if k in done:  # committed after its state was saved (a kill between the two)
            remove_checkpoint(partial_root / step_dirname(k))
    faults.hit("resume.after_load")
    todo = [k for k in range(n_chunks) if k not in done]
    streamed = sum(u.plan.read_bytes for i, u in enumerate(engine.units)
                   if i not in plan.resident)
    log.emit("infer_start", mode=mode, model=str(model_dir), records=len(records),
             chunks=n_chunks, chunks_done=len(done), chunk_records=chunk, device=str(device),
             compress=cfg.compress.scheme, dtype=str(engine.dtype).removeprefix("torch."),
             plan=plan.to_dict(), units=len(engine.units),
             model_bytes=sum(engine.unit_bytes), streamed_bytes_per_pass=streamed,
             pid=os.getpid())

    stats = Stats()
    status = "completed"
    saved = 0
    if todo:
        engine.start(set(plan.resident), plan.depth, prepare)
        progress = Progress(len(records), sum(min(chunk, len(records) - k * chunk)
                                               for k in done), cfg.job.progress, stream)
        flag = PreemptionFlag()
        pass_t = [time.perf_counter()]
        last_save = [time.perf_counter()]  # of the running chunk's state
        state: GenState | None = None  # the running chunk's generation, saved on a stop
        k = todo[0]

        def on_pass() -> None:
            now = time.perf_counter()
            stats.passes += 1
            stats.pass_s += now - pass_t[0]
            if stats.chunk_pass == 0:
                stats.prefill_s += now - pass_t[0]
            else:
                stats.decode_passes += 1
                stats.decode_s += now - pass_t[0]
            stats.chunk_pass += 1
            act = faults.hit("step.forward")  # slowNN: a straggler, for preemption tests
            if act and act.startswith("slow"):
                time.sleep((now - pass_t[0]) * int(act[4:]) / 100)
            every = cfg.job.save_every_s
            if state is not None and every and not flag.is_set() \
                    and time.perf_counter() - last_save[0] >= every:
                _save_partial(partial_root, k, state, run_id, log, faults)
                last_save[0] = time.perf_counter()
            pass_t[0] = time.perf_counter()
            progress.tick(stats.passes, engine.streamer.reader.bytes_read)  # type: ignore
            faults.hit("step.end")
            if flag.is_set():
                raise Preempted(flag.reason)

        def stop() -> bool:  # asked between the units of a pass
            faults.hit("pass.unit")
            return flag.is_set()

        try:
            with SignalSource(flag, cfg.job.preempt_signal):
                for k in todo:
                    t0 = time.perf_counter()
                    read0 = engine.streamer.reader.bytes_read  # type: ignore[union-attr]
                    idx = range(k * chunk, min((k + 1) * chunk, len(records)))
                    flat = [(i, j) for i in idx for j in range(len(work.seqs[i]))]
                    if mode == "generate":
                        state = _resume(partial_root / step_dirname(k), engine, len(flat), log,
                                        k) or start(engine, [work.seqs[i][j] for i, j in flat],
                                                    pad_id=work.pad_id,
                                                    micro_tokens=plan.micro_tokens)
                        stats.chunk_pass = state.step
                    else:
                        stats.chunk_pass = 0
                    pass_t[0] = last_save[0] = time.perf_counter()
                    results = _run_chunk(engine, work, idx, flat, cfg, plan, on_pass, stats,
                                         state, stop)
                    data = _chunk_lines(work, idx, mode, results, tok)
                    commit_local(root, k, {CHUNK_FILE: data},
                                 {"records": [idx.start, idx.stop], "run_id": run_id}, faults)
                    state = None
                    if (partial_root / step_dirname(k)).exists():
                        remove_checkpoint(partial_root / step_dirname(k))
                    stats.prompts += len(idx)
                    done.add(k)
                    read = engine.streamer.reader.bytes_read - read0  # type: ignore[union-attr]
                    log.emit("chunk", chunk=k, records=[idx.start, idx.stop],
                             seconds=round(time.perf_counter() - t0, 4), bytes_read=read,
                             committed=len(done), of=n_chunks)
                    progress.update(sum(min(chunk, len(records) - j * chunk) for j in done),
                                    engine.streamer.reader.bytes_read)  # type: ignore
                    if flag.is_set():
                        raise Preempted(flag.reason)
        except (Preempted, PassStopped) as e:
            status = "preempted"
            reason = str(e) if isinstance(e, Preempted) else flag.reason
            notice_ms = round((time.time() - (flag.set_at or time.time())) * 1000, 1)
            saved = _save_partial(partial_root, k, state, run_id, log, faults) \
                if state is not None and state.step > 0 else 0
            log.emit("preempt", reason=reason, chunks_done=len(done), of=n_chunks,
                     notice_to_stop_ms=notice_ms, partial_passes=saved,
                     mid_pass=isinstance(e, PassStopped))
        finally:
            progress.close()
            engine.close()
    summary = summary_of(engine, stats, plan, streamed, time.perf_counter() - t_start)
    if status == "preempted":
        log.close()
        kept = f", and chunk {k}'s first {saved} passes" if saved else ""
        print(f"shoestring infer: preempted; {len(done)}/{n_chunks} chunks committed in "
              f"{root}{kept}. Rerun the same command to continue.", file=stream)
        return exitcodes.PREEMPTED
    nbytes = _assemble(root, n_chunks, output)
    log.emit("infer_end", status=status, output=str(output), output_bytes=nbytes, **summary)
    log.close()
    print_summary(summary, output, stream)
    return exitcodes.OK


def _run_chunk(engine: StreamingCausalLM, work: Work, idx: range, flat: list[tuple[int, int]],
               cfg: InferConfig, plan: Plan, on_pass: Any, stats: Stats,
               state: GenState | None, stop: Callable[[], bool]) -> list[list[Any]]:
    if state is not None:
        outs: list[Any] = generate_from(
            engine, state, max_new_tokens=cfg.generate.max_new_tokens,
            eos_ids=work.eos_ids if cfg.generate.stop_at_eos else set(),
            pad_id=work.pad_id, on_pass=on_pass, stop=stop)
        stats.tokens += sum(len(o.tokens) for o in outs)
    else:
        outs = score(engine, [(work.seqs[i][j], work.starts[i][j]) for i, j in flat],
                     pad_id=work.pad_id, micro_tokens=plan.micro_tokens, on_pass=on_pass)
        stats.tokens += sum(o.tokens for o in outs)
    grouped: list[list[Any]] = [[] for _ in idx]
    for (i, _j), o in zip(flat, outs):
        grouped[i - idx.start].append(o)
    return grouped


def _resume(path: Path, engine: StreamingCausalLM, n_seqs: int, log: EventLog,
            chunk: int) -> GenState | None:
    """The saved generation state of this chunk, or None (none saved, or unusable: then
    it is quarantined and the chunk starts over)."""
    if not (path / MANIFEST).is_file():
        return None
    try:
        state = partial.load(path, engine, n_seqs)
    except (CorruptCheckpoint, OSError, KeyError, ValueError) as e:
        log.emit("partial_invalid", chunk=chunk, error=str(e), quarantined=str(quarantine(path)))
        return None
    log.emit("partial_loaded", chunk=chunk, passes=state.step)
    return state


def _save_partial(root: Path, chunk: int, state: GenState, run_id: str, log: EventLog,
                  faults: FaultPlan) -> int:
    """Save the running chunk's state; returns the passes it holds (0: not saved).

    A failure to save (a full disk) is logged, not raised: the job goes on (or exits 75)
    with the committed chunks and any state saved before intact."""
    t0 = time.perf_counter()
    try:
        path, nbytes = partial.save(root, chunk, state, {"chunk": chunk, "run_id": run_id},
                                    faults)
    except (partial.Unsupported, OSError) as e:
        log.emit("partial_skipped", chunk=chunk, passes=state.step, reason=str(e))
        return 0
    log.emit("partial_saved", chunk=chunk, passes=state.step, bytes=nbytes,
             seconds=round(time.perf_counter() - t0, 4), path=str(path))
    return state.step
