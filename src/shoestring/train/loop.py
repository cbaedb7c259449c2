"""`shoestring finetune`: the LoRA training loop with exact resume.

Order of work: validate config and data (cheap) → load model → resume or start
→ train, checkpointing by steps/seconds → on a preemption flag, finish the
step, save synchronously and exit 75 → at the end, save, export ``final/``.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from shoestring import exitcodes
from shoestring.checkpoint import (NO_FAULTS, CheckpointWriter, FaultPlan, RemoteStore,
                                   find_resume_point, load_files)
from shoestring.checkpoint.local import clean_stale, committed_steps
from shoestring.config import (RESUME_SAFE_PREFIXES, ConfigError, FinetuneConfig, config_hash,
                               resume_relevant, to_flat, to_yaml)
from shoestring.events import EventLog
from shoestring.preempt import PreemptionFlag, SignalSource
from shoestring.train import data as D
from shoestring.train import state as S
from shoestring.train.builtin import BUILTIN_TASK, builtin_records
from shoestring.train.evaluate import eval_loss, exact_match
from shoestring.train.export import export_adapter, export_merged
from shoestring.train.model import (apply_lora, fingerprint, load_base_model, load_tokenizer,
                                    model_summary, resolve_model_dir, trainable_parameters)
from shoestring.train.progress import ProgressDisplay

log = logging.getLogger("shoestring.finetune")


@dataclass
class RunOptions:
    """Run control that is not part of the (resume-checked) config."""

    resume: str = "auto"
    faults: FaultPlan = field(default_factory=lambda: NO_FAULTS)
    cache_dir: Path = Path.home() / ".cache" / "shoestring"
    tty: bool | None = None
    flag: PreemptionFlag | None = None


def lr_lambda(warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def _records(spec: str, split: str) -> list[D.Record]:
    if spec == BUILTIN_TASK:
        return D.from_dicts(builtin_records(split), f"{BUILTIN_TASK}[{split}]")
    return D.read_jsonl(spec)


def _run_id(out: Path) -> str:
    p = out / "run.json"
    if p.exists():
        return str(json.loads(p.read_text())["run_id"])
    rid = uuid.uuid4().hex[:12]
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps({"run_id": rid, "created": time.time()}))
    tmp.replace(p)
    return rid


def _last_logged_step(events_path: Path) -> int | None:
    if not events_path.exists():
        return None
    with open(events_path, "rb") as f:
        f.seek(0, 2)
        f.seek(max(f.tell() - (1 << 20), 0))
        tail = f.read().decode("utf-8", "replace").splitlines()
    for line in reversed(tail):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("event") == "step":
            return int(rec["step"])
    return None


def _check_compatible(saved: dict[str, Any], cfg: FinetuneConfig, where: str) -> None:
    old, new = resume_relevant(saved), resume_relevant(to_flat(cfg))
    changed = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
               if old.get(k) != new.get(k)]
    if changed:
        raise ConfigError(f"cannot resume from {where}: the config changed in ways that break "
                          f"an exact continuation: {'; '.join(changed)}. Keys that may change on resume: "
                          f"{', '.join(p + '*' if p.endswith('.') else p for p in RESUME_SAFE_PREFIXES)}. "
                          "Use a new output_dir or --resume never to start over.")


class Finetune:
    """One invocation of ``shoestring finetune``. Use :meth:`run`."""

    def __init__(self, cfg: FinetuneConfig, opts: RunOptions) -> None:
        self.cfg, self.opts = cfg, opts
        self.out = Path(cfg.output_dir)
        self.ckroot = self.out / "checkpoints"
        self.flag = opts.flag or PreemptionFlag()

    # ------------------------------------------------------------------ setup
    def _prepare_inputs(self) -> None:
        """Everything cheap that can fail on bad input, before loading weights."""
        cfg = self.cfg
        self.train_records = _records(cfg.data.train, "train")
        eval_spec = cfg.data.eval
        if eval_spec == "auto":
            eval_spec = BUILTIN_TASK if cfg.data.train == BUILTIN_TASK else ""
        self.eval_records = _records(eval_spec, "eval") if eval_spec else []
        self.remote: RemoteStore | None = None
        storage = cfg.checkpoint.storage
        if storage and Path(storage).expanduser().resolve() != self.ckroot.resolve():
            self.remote = RemoteStore(storage)
            try:
                self.remote.check()
            except (OSError, ValueError) as e:
                raise ConfigError(f"checkpoint.storage: cannot use {storage!r}: {e}") from e

    def _build(self) -> None:
        cfg = self.cfg
        # The config cannot change during a run; do this work once, not on every save.
        self.cfg_flat, self.cfg_hash = to_flat(cfg), config_hash(cfg)
        if cfg.train.num_threads:
            torch.set_num_threads(cfg.train.num_threads)
        self.model_dir = resolve_model_dir(cfg.model, self.opts.cache_dir)
        self.base_fp = fingerprint(self.model_dir)
        self.tok = load_tokenizer(self.model_dir)
        stop = self.flag.is_set
        examples = D.tokenize(self.train_records, self.tok, cfg.data.max_length, stop)
        if cfg.data.packing:
            examples = D.pack(examples, cfg.data.max_length)
        self.train_examples = examples
        self.eval_examples = D.tokenize(self.eval_records, self.tok, cfg.data.max_length, stop)
        self.order = D.SampleOrder(len(self.train_examples), cfg.train.seed)
        base = load_base_model(self.model_dir, cfg.model)
        self.model = apply_lora(base, cfg.lora, cfg.train.seed, cfg.model.gradient_checkpointing)
        self.model.train()
        self.params = trainable_parameters(self.model)
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=cfg.train.lr,
                                           weight_decay=cfg.train.weight_decay, fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.train.warmup_steps, cfg.train.max_steps,
                                      cfg.train.min_lr_ratio))
        self.scaler = None
        if cfg.model.dtype == "float16" and torch.cuda.is_available():  # pragma: no cover
            self.scaler = torch.amp.GradScaler("cuda")

    # ------------------------------------------------------------------ pieces
    def _meta(self) -> dict[str, Any]:
        return {"config_hash": self.cfg_hash, "base_fingerprint": self.base_fp,
                "world_size": 1, "torch": torch.__version__, "kind": "finetune"}

    def _save(self, progress: S.Progress, reason: str, sync: bool) -> None:
        t0 = time.perf_counter()
        snap = S.capture(progress, self.params, self.optimizer, self.scheduler, self.scaler,
                         rank=0, config=self.cfg_flat, meta=self._meta())
        self.writer.submit(snap, capture_ms=(time.perf_counter() - t0) * 1e3, reason=reason,
                           sync=sync)
        self.last_save_time = time.monotonic()

    def _resume(self) -> S.Progress:
        point = find_resume_point(self.opts.resume, self.ckroot, self.remote,
                                  verify=self.cfg.checkpoint.verify, events=self.events)
        if point is None:
            S.seed_everything(self.cfg.train.seed)
            return S.Progress()
        meta = point.manifest.meta
        if meta.get("base_fingerprint") != self.base_fp:
            raise ConfigError(f"cannot resume from {point.path}: model.path {self.model_dir} is "
                              "not the base model this checkpoint was trained on "
                              "(fingerprint differs)")
        if self.remote is not None and point.source == "local" \
                and point.step not in self.remote.committed_steps():
            # The previous run died before this checkpoint reached durable storage.
            self.remote.publish(point.path, point.manifest)
        tensors, docs = load_files(point.path, list(point.manifest.files))
        _check_compatible(docs[S.STATE]["config"], self.cfg, str(point.path))
        progress = S.restore(tensors, docs, self.params, self.optimizer, self.scheduler,
                             self.scaler, rank=0)
        last = _last_logged_step(self.out / "events.jsonl")
        lost = max((last or 0) - progress.step, 0)
        self.events.emit("resume", from_step=progress.step, source=point.source,
                         path=str(point.path), steps_lost=lost, last_logged_step=last)
        log.info("resumed from step %d (%s); %d steps redone", progress.step, point.source, lost)
        self.opts.faults.hit("resume.after_load")
        return progress

    def _evaluate(self, step: int, tag: str) -> dict[str, Any] | None:
        if not self.eval_records:
            return None
        c = self.cfg.eval
        t0 = time.perf_counter()
        examples = self.eval_examples[: c.max_samples or None]
        res = eval_loss(self.model, examples, c.batch_size, self.tok.pad_token_id, self.flag.is_set)
        if res is None:
            return None
        pairs = [r for r in self.eval_records[: c.max_samples or None] if r.is_pair]
        if c.exact_match and pairs:
            em = exact_match(self.model, self.tok, pairs, c.max_new_tokens, c.batch_size,
                             self.flag.is_set)
            if em is None:
                return None
            res.update(em)
        res["eval_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        self.events.emit("eval", step=step, tag=tag, **res)
        return res

    def _train_step(self, progress: S.Progress) -> dict[str, float]:
        cfg = self.cfg.train
        t0 = time.perf_counter()
        n = cfg.batch_size * cfg.grad_accum
        idx = self.order.indices(progress.consumed, n)
        micro = [D.collate([self.train_examples[i] for i in idx[k:k + cfg.batch_size]],
                           self.tok.pad_token_id) for k in range(0, n, cfg.batch_size)]
        n_items = sum(int((b["labels"][:, 1:] != D.IGNORE_INDEX).sum()) for b in micro)
        tokens = sum(int(b["attention_mask"].sum()) for b in micro)
        total = 0.0
        for batch in micro:
            out = self.model(**batch, num_items_in_batch=n_items)
            loss = out.loss
            if self.scaler is not None:  # pragma: no cover - CUDA fp16 only
                self.scaler.scale(loss).backward()
            else:
                loss.backward()
            total += float(loss.detach())
        if self.scaler is not None:  # pragma: no cover
            self.scaler.unscale_(self.optimizer)
        grad_norm = 0.0
        if cfg.max_grad_norm > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params.values(),
                                                             cfg.max_grad_norm))
        lr = self.scheduler.get_last_lr()[0]
        if self.scaler is not None:  # pragma: no cover
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        progress.step += 1
        progress.consumed += n
        progress.tokens += tokens
        dt = time.perf_counter() - t0
        return {"loss": total, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
                "tokens_per_s": tokens / dt, "step_ms": dt * 1e3}

    def _save_due(self, step: int) -> str | None:
        c = self.cfg.checkpoint
        if c.every_steps and step % c.every_steps == 0:
            return "steps"
        if c.every_seconds and time.monotonic() - self.last_save_time >= c.every_seconds:
            return "seconds"
        return None

    # ------------------------------------------------------------------ main
    def run(self) -> int:
        self._prepare_inputs()
        self.out.mkdir(parents=True, exist_ok=True)
        self.events = EventLog(self.out / "events.jsonl", run_id=_run_id(self.out))
        self.writer = CheckpointWriter(self.ckroot, keep=self.cfg.checkpoint.keep,
                                       mode=self.cfg.checkpoint.async_mode, events=self.events,
                                       remote=self.remote, faults=self.opts.faults)
        try:
            with SignalSource(self.flag, self.cfg.preempt.signal):
                return self._run()
        except InterruptedError:
            self.events.emit("preempt", step=None, reason=self.flag.reason, saved=False)
            return exitcodes.PREEMPTED
        finally:
            self.writer.close()
            self.events.close()

    def _run(self) -> int:
        cfg = self.cfg
        clean_stale(self.ckroot)
        (self.out / "config.yaml").write_text(to_yaml(cfg))
        self._build()
        progress = self._resume()
        fresh = progress.step == 0
        self.last_save_time = time.monotonic()
        self.events.emit("run_start", step=progress.step, max_steps=cfg.train.max_steps,
                         model=str(self.model_dir), base_fingerprint=self.base_fp,
                         config_hash=config_hash(cfg), train_samples=len(self.train_examples),
                         **model_summary(self.model))
        display = ProgressDisplay(cfg.train.max_steps, progress.step,
                                  log_every=cfg.train.log_every_steps, tty=self.opts.tty)
        if fresh:
            before = self._evaluate(0, "before")
            if before:
                display.write("before: " + _fmt_eval(before))
        try:
            while progress.step < cfg.train.max_steps and not self.flag.is_set():
                m = self._train_step(progress)
                self.opts.faults.hit("step.end")
                self.writer.check()
                self.events.emit("step", step=progress.step, epoch=self.order.epoch_of(
                    progress.consumed - 1), **{k: round(v, 6) for k, v in m.items()})
                display.update(progress.step, m["loss"], m["lr"], m["tokens_per_s"])
                if cfg.eval.every_steps and progress.step % cfg.eval.every_steps == 0 \
                        and progress.step < cfg.train.max_steps:
                    res = self._evaluate(progress.step, "periodic")
                    if res:
                        display.write(f"step {progress.step}: " + _fmt_eval(res))
                reason = self._save_due(progress.step)
                if reason and not self.flag.is_set():
                    self._save(progress, reason, sync=False)
        finally:
            display.close()
        if self.flag.is_set():
            return self._preempted(progress)
        self.writer.wait()
        if not self._has_checkpoint(progress.step):
            self._save(progress, "final", sync=True)
        after = self._evaluate(progress.step, "after")
        final = export_adapter(self.model, self.tok, self.out)
        summary = {"step": progress.step, "final": str(final)}
        if after:
            summary["eval"] = after
            display.write("after: " + _fmt_eval(after))
        if cfg.export.merged:
            summary["merged"] = str(export_merged(self.model, self.tok, self.out))
        self.events.emit("run_end", status="completed", **summary)
        display.write(f"done: step {progress.step}, adapter in {final}")
        return exitcodes.OK

    def _has_checkpoint(self, step: int) -> bool:
        """A committed checkpoint of ``step`` exists (call after ``writer.wait()``)."""
        return step in committed_steps(self.ckroot)

    def _preempted(self, progress: S.Progress) -> int:
        t0 = time.perf_counter()
        saved = False
        self.writer.wait()
        if progress.step > 0:
            if not self._has_checkpoint(progress.step):
                self._save(progress, "emergency", sync=True)
            saved = True
        self.events.emit("preempt", step=progress.step, reason=self.flag.reason, saved=saved,
                         notice_to_commit_ms=round((time.time() - (self.flag.set_at or
                                                                    time.time())) * 1e3, 1),
                         save_ms=round((time.perf_counter() - t0) * 1e3, 1))
        self.events.sync()
        log.warning("preempted (%s) at step %d; checkpoint committed, exiting %d to be resumed",
                    self.flag.reason, progress.step, exitcodes.PREEMPTED)
        return exitcodes.PREEMPTED


def _fmt_eval(res: dict[str, Any]) -> str:
    parts = [f"eval loss {res['loss']:.4f}", f"ppl {res['perplexity']:.2f}"]
    if "exact_match" in res:
        parts.append(f"exact-match {100 * res['exact_match']:.1f}% of {res['samples']}")
    return ", ".join(parts)


def finetune(cfg: FinetuneConfig, opts: RunOptions | None = None) -> int:
    """Run (or resume) a fine-tuning job; returns an exit code from :mod:`shoestring.exitcodes`."""
    return Finetune(cfg, opts or RunOptions()).run()
