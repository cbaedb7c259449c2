"""`shoestring finetune`: the LoRA training loop with exact resume.

Order of work: validate config and data (cheap) → load model → resume or start
→ train, checkpointing by steps/seconds → on a preemption flag, finish the
step, save synchronously and exit 75 → at the end, save, export ``final/``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import struct
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from shoestring import exitcodes
from shoestring.checkpoint import (NO_FAULTS, CheckpointWriter, FaultPlan, RemoteStore,
                                   find_resume_point, load_files)
from shoestring.checkpoint.interval import AutoInterval, IntervalPolicy, history_from_events
from shoestring.checkpoint.local import clean_stale
from shoestring.checkpoint.manifest import verify_dir
from shoestring.checkpoint.sharded import ShardedWriter, is_sharded
from shoestring.config import (RESUME_SAFE_PREFIXES, ConfigError, FinetuneConfig, config_hash,
                               resume_relevant, to_flat, to_yaml)
from shoestring.distributed import DistEnv, ProcessGroups, barrier, broadcast_object
from shoestring.events import EventLog, read_events
from shoestring.preempt import PreemptionFlag, SignalSource, cloud_watcher
from shoestring.train import data as D
from shoestring.train import state as S
from shoestring.train.builtin import BUILTIN_TASK, builtin_records
from shoestring.train.evaluate import eval_loss, exact_match
from shoestring.train.export import export_adapter, export_merged, export_merged_from
from shoestring.train import parallel as P
from shoestring.train.model import (apply_lora, build_optimizer, check_lora_gradients,
                                    fingerprint, load_base_model, load_tokenizer,
                                    model_summary, require_bitsandbytes, resolve_model_dir,
                                    trainable_parameters)
from shoestring.train.progress import ProgressDisplay
from shoestring.watch.recorder import NullRecorder, Recorder, StartupBeacon

log = logging.getLogger("shoestring.finetune")


@dataclass
class RunOptions:
    """Run control that is not part of the (resume-checked) config."""

    resume: str = "auto"
    faults: FaultPlan = field(default_factory=lambda: NO_FAULTS)
    cache_dir: Path = Path.home() / ".cache" / "shoestring"
    tty: bool | None = None
    flag: PreemptionFlag | None = None
    dist: DistEnv = field(default_factory=DistEnv)


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
    # A key the checkpoint does not know was added by a later version: it had its default.
    default = resume_relevant(to_flat(FinetuneConfig()))
    old = {**{k: v for k, v in default.items() if k not in old}, **old}
    changed = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
               if old.get(k) != new.get(k)]
    if changed:
        raise ConfigError(f"cannot resume from {where}: the config changed in ways that break "
                          f"an exact continuation: {'; '.join(changed)}. Keys that may change on resume: "
                          f"{', '.join(p + '*' if p.endswith('.') else p for p in RESUME_SAFE_PREFIXES)}. "
                          "Use a new output_dir or --resume never to start over.")


class Finetune:
    """One invocation of ``shoestring finetune`` (one rank of it when distributed)."""

    def __init__(self, cfg: FinetuneConfig, opts: RunOptions) -> None:
        self.cfg, self.opts = cfg, opts
        self.dist = opts.dist
        self.rank = self.dist.rank
        self.out = Path(cfg.output_dir)
        self.ckroot = self.out / "checkpoints"
        self.flag = opts.flag or PreemptionFlag()
        self._stop_agreed = False  # distributed: the flag as all ranks saw it (see _agree)
        self.strategy: str | None = cfg.distributed.strategy if self.dist.is_distributed else None
        self.groups: ProcessGroups | None = None

    # ------------------------------------------------------------------ setup
    def _prepare_inputs(self) -> None:
        """Everything cheap that can fail on bad input, before loading weights."""
        cfg = self.cfg
        if self.strategy == "fsdp" and cfg.lora.quantize != "none":
            raise ConfigError("lora.quantize: bitsandbytes-quantized weights cannot be sharded "
                              "by distributed.strategy fsdp; use ddp (each rank holds the "
                              "small quantized base) or lora.quantize none")
        if cfg.lora.quantize != "none":
            require_bitsandbytes("lora.quantize")
        if cfg.train.optimizer != "adamw":
            require_bitsandbytes("train.optimizer")
        self.batch = P.BatchPlan.make(cfg.train.batch_size, cfg.train.micro_batch_size,
                                      self.dist.world_size, self.rank)
        self.train_records = _records(cfg.data.train, "train")
        eval_spec = cfg.data.eval
        if eval_spec == "auto":
            eval_spec = BUILTIN_TASK if cfg.data.train == BUILTIN_TASK else ""
        self.eval_records = _records(eval_spec, "eval") if eval_spec else []
        self.remote: RemoteStore | None = None
        storage = cfg.checkpoint.storage
        if storage and Path(storage).expanduser().resolve() != self.ckroot.resolve():
            self.remote = RemoteStore(storage)
            if self.rank == 0:
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
        if self.rank != 0:
            barrier()  # rank 0 materializes the built-in model first
        self.model_dir = resolve_model_dir(cfg.model, self.opts.cache_dir)
        if self.rank == 0:
            barrier()
        self._plan_check()  # every rank reaches the same verdict
        self.base_fp = fingerprint(self.model_dir)
        self.tok = load_tokenizer(self.model_dir)
        stop = self.flag.is_set
        examples = D.tokenize(self.train_records, self.tok, cfg.data.max_length, stop)
        if cfg.data.packing:
            examples = D.pack(examples, cfg.data.max_length)
        self.train_examples = examples
        self.eval_examples = D.tokenize(self.eval_records, self.tok, cfg.data.max_length, stop)
        self.order = D.SampleOrder(len(self.train_examples), cfg.train.seed)
        base = load_base_model(self.model_dir, cfg.model, cfg.lora.quantize)
        self.model = apply_lora(base, cfg.lora, cfg.train.seed, cfg.model.gradient_checkpointing)
        self.model.train()
        self.param_names = list(trainable_parameters(self.model))
        self.wrapped: torch.nn.Module = self.model
        if self.strategy is not None:
            assert self.groups is not None
            self.wrapped = P.wrap(self.model, self.strategy, self.groups.device())
            if self.strategy == "ddp" and isinstance(self.rec, Recorder):  # traced all-reduces
                self.wrapped.register_comm_hook(None, self.rec.ddp_comm_hook)  # type: ignore[operator]
        # Under FSDP2 the parameters are DTensor shards now: collect them after wrapping.
        self.params = trainable_parameters(self.model)
        self.optimizer = build_optimizer(list(self.params.values()), cfg.train.optimizer,
                                         cfg.train.lr, cfg.train.weight_decay)
        self.grads_checked = False
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.train.warmup_steps, cfg.train.max_steps,
                                      cfg.train.min_lr_ratio))
        self.scaler = None
        if cfg.model.dtype == "float16" and torch.cuda.is_available():  # pragma: no cover
            self.scaler = torch.amp.GradScaler("cuda")

    def _plan_check(self) -> None:
        """Refuse (plan.enforce) a config the planner says will not fit the GPU,
        before anything heavy is loaded."""
        from shoestring.plan.check import preflight

        plan = preflight(self.cfg, self.model_dir, self.dist.world_size)
        if plan is not None:
            self.events.emit("plan", gpu=plan.gpu.name, fits=plan.fits,
                             peak_bytes=plan.peak_bytes, gpu_memory_bytes=plan.gpu.memory_bytes,
                             breakdown=plan.breakdown)

    # ------------------------------------------------------------------ pieces
    def _meta(self) -> dict[str, Any]:
        return {"config_hash": self.cfg_hash, "base_fingerprint": self.base_fp,
                "world_size": self.dist.world_size, "strategy": self.strategy or "single",
                "torch": torch.__version__, "kind": "finetune"}

    def _save(self, progress: S.Progress, reason: str, sync: bool) -> None:
        t0 = time.perf_counter()
        if isinstance(self.writer, ShardedWriter):
            state = S.dcp_state(self.wrapped, self.optimizer)
            own = S.rank_files(progress, self.scheduler, self.scaler, rank=self.rank,
                               world_size=self.dist.world_size, param_names=self.param_names,
                               config=self.cfg_flat)
            self.writer.submit(progress.step, state, own,
                               {**self._meta(), "step": progress.step,
                                "consumed": progress.consumed},
                               reason=reason, sync=sync,
                               capture_ms=(time.perf_counter() - t0) * 1e3)
        else:
            snap = S.capture(progress, self.params, self.optimizer, self.scheduler, self.scaler,
                             rank=0, config=self.cfg_flat, meta=self._meta())
            self.writer.submit(snap, capture_ms=(time.perf_counter() - t0) * 1e3, reason=reason,
                               sync=sync)
        self.last_save_time = time.monotonic()
        self.saved_step = progress.step
        if self.auto is not None and not sync:
            self.auto.observe_save(time.perf_counter() - t0)
            self._plan_next_save(progress.step)

    def _plan_next_save(self, step: int) -> None:
        """interval 'auto': the step of the next save, decided on rank 0 for every rank."""
        assert self.auto is not None
        if self.rank == 0:
            now = time.monotonic()
            self.auto.observe_hours((now - self._auto_clock) / 3600)
            self._auto_clock = now
            n = self.auto.interval_steps(self.cfg.checkpoint.every_steps or 100)
            self.next_save_step = step + n
            if n != self._auto_last:
                self._auto_last = n
                self.events.emit("interval", step=step, every_steps=n, **self.auto.explain())
        if self.dist.is_distributed:
            self.next_save_step = int(broadcast_object(self.next_save_step))

    def _find_resume_point(self) -> tuple[int, str, str] | None:
        """Rank 0 chooses (it may quarantine or fetch); every rank gets the same answer."""
        choice = None
        if self.rank == 0:
            point = find_resume_point(self.opts.resume, self.ckroot, self.remote,
                                      verify=self.cfg.checkpoint.verify, events=self.events)
            if point is not None:
                if self.remote is not None and point.source == "local" \
                        and point.step not in self.remote.committed_steps():
                    # The previous run died before this checkpoint reached durable storage.
                    self.remote.publish(point.path, point.manifest)
                choice = (point.step, str(point.path), point.source)
        if self.dist.is_distributed:
            choice = broadcast_object(choice)
        return choice

    def _resume(self) -> S.Progress:
        choice = self._find_resume_point()
        if choice is None:
            S.seed_everything(self.cfg.train.seed)
            return S.Progress()
        _step, path_s, source = choice
        path = Path(path_s)
        manifest = verify_dir(path, deep=False)  # rank 0 verified the hashes
        meta = manifest.meta
        if meta.get("base_fingerprint") != self.base_fp:
            raise ConfigError(f"cannot resume from {path}: model.path {self.model_dir} is "
                              "not the base model this checkpoint was trained on "
                              "(fingerprint differs)")
        saved_world = int(meta.get("world_size", 1))
        group = self.groups.checkpoint_group if self.groups else None
        if is_sharded(manifest.files):
            import json as _json
            state_doc = _json.loads((path / S.STATE).read_text())
            _check_compatible(state_doc["config"], self.cfg, str(path))
            progress, own_rng = S.restore_sharded(path, self.wrapped, self.optimizer,
                                                  self.scheduler, self.scaler, rank=self.rank,
                                                  group=group)
        else:
            names = [n for n in manifest.files
                     if not n.startswith("rng_rank") or n == S.rng_file(self.rank)]
            tensors, docs = load_files(path, names)
            _check_compatible(docs[S.STATE]["config"], self.cfg, str(path))
            own_rng = S.rng_file(self.rank) in tensors
            if self.strategy == "fsdp":
                progress = S.restore_full(tensors, docs, self.wrapped, self.optimizer,
                                          self.scheduler, self.scaler)
            else:
                progress = S.restore(tensors, docs, self.params, self.optimizer, self.scheduler,
                                     self.scaler, rank=self.rank)
        if not own_rng:
            # More ranks than were saved: this rank's streams start from the seed. Training
            # draws dropout per micro-batch from (seed, step, chunk), so this changes nothing.
            S.seed_everything(self.cfg.train.seed + 7919 * self.rank + progress.step)
        self.saved_step = progress.step
        last = _last_logged_step(self.out / "events.jsonl")
        lost = max((last or 0) - progress.step, 0)
        self.events.emit("resume", from_step=progress.step, source=source, path=str(path),
                         steps_lost=lost, last_logged_step=last, from_world_size=saved_world,
                         world_size=self.dist.world_size,
                         format="dcp" if is_sharded(manifest.files) else "files",
                         **S.state_digests(self.wrapped, self.optimizer))
        log.info("resumed from step %d (%s, saved by %d rank(s), now %d); %d steps redone",
                 progress.step, source, saved_world, self.dist.world_size, lost)
        self.opts.faults.hit("resume.after_load")
        return progress

    def _evaluate(self, step: int, tag: str) -> dict[str, Any] | None:
        """Under DDP rank 0 evaluates alone on the unwrapped model; under FSDP2 every rank
        runs the same evaluation (each forward needs every rank's shards)."""
        if not self.eval_records or (self.strategy == "ddp" and self.rank != 0):
            return None
        c = self.cfg.eval
        t0 = time.perf_counter()
        # FSDP2 evaluates on every rank in lockstep: abort only on the agreed flag, or a
        # rank whose own flag was just raised (one watcher per node) would leave the rest
        # waiting in a collective.
        stop = self._stop_requested if self.strategy == "fsdp" else self.flag.is_set
        examples = self.eval_examples[: c.max_samples or None]
        res = eval_loss(self.model, examples, c.batch_size, self.tok.pad_token_id, stop)
        if res is None:
            return None
        pairs = [r for r in self.eval_records[: c.max_samples or None] if r.is_pair]
        if c.exact_match and pairs:
            em = exact_match(self.model, self.tok, pairs, c.max_new_tokens, c.batch_size, stop)
            if em is None:
                return None
            res.update(em)
        res["eval_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        self.events.emit("eval", step=step, tag=tag, **res)
        return res

    def _train_step(self, progress: S.Progress) -> dict[str, float]:
        cfg, plan = self.cfg.train, self.batch
        t0 = time.perf_counter()
        idx = self.order.indices(progress.consumed, plan.batch_size)
        # Loss normalizer and token count over the *global* batch, computed locally.
        n_items = sum(D.label_count(self.train_examples[i]) for i in idx)
        tokens = sum(len(self.train_examples[i].input_ids) for i in idx)
        chunks = list(plan.my_chunks())
        total = 0.0
        for k, (chunk, start, size) in enumerate(chunks):
            t_data = time.perf_counter()
            self.opts.faults.hit("step.data")
            batch = D.collate([self.train_examples[i] for i in idx[start:start + size]],
                              self.tok.pad_token_id)
            padded = batch["input_ids"].numel()
            t_fwd = time.perf_counter()
            self.rec.work("data", t_fwd - t_data, padded)
            S.seed_micro_batch(cfg.seed, progress.step, chunk)
            with P.grad_sync(self.wrapped, self.strategy, sync=k == len(chunks) - 1):
                out = self.wrapped(**batch, num_items_in_batch=n_items)
                loss = out.loss
                slow = self.opts.faults.hit("step.forward")
                if slow:  # injected straggler: this forward takes NN % longer
                    time.sleep((time.perf_counter() - t_fwd) * int(slow[4:]) / 100)
                self.rec.work("forward", time.perf_counter() - t_fwd, padded)
                # DDP/FSDP average gradients over ranks; each rank's share is a sum.
                scaled = loss * plan.world_size if plan.world_size > 1 else loss
                if self.scaler is not None:  # pragma: no cover - CUDA fp16 only
                    self.scaler.scale(scaled).backward()
                else:
                    scaled.backward()
            total += float(loss.detach())
        if self.scaler is not None:  # pragma: no cover
            self.scaler.unscale_(self.optimizer)
        if not self.grads_checked:  # a silent no-op training run fails here, loudly
            check_lora_gradients(self.params)
            self.grads_checked = True
        grad_norm = 0.0
        if cfg.max_grad_norm > 0:
            grad_norm = P.grad_norm_value(torch.nn.utils.clip_grad_norm_(
                list(self.params.values()), cfg.max_grad_norm))
        lr = self.scheduler.get_last_lr()[0]
        if self.scaler is not None:  # pragma: no cover
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if plan.world_size > 1:
            total = self._agree(total)
        progress.step += 1
        progress.consumed += plan.batch_size
        progress.tokens += tokens
        dt = time.perf_counter() - t0
        return {"loss": total, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
                "tokens_per_s": tokens / dt, "step_ms": dt * 1e3,
                # Which samples made this step: equal across world sizes and resumes.
                "batch_crc": zlib.crc32(struct.pack(f"<{len(idx)}q", *idx))}

    def _agree(self, local_loss: float) -> float:
        """One small all-reduce per step: the global loss, and whether any rank was told
        to stop (so every rank stops after the same step and saves together)."""
        import torch.distributed as dist

        t = torch.tensor([local_loss, 1.0 if self.flag.is_set() else 0.0], dtype=torch.float64)
        fault = self.opts.faults.hit("step.agree")
        if fault == "skip":  # injected: this rank leaves the collective out
            return local_loss
        if fault == "extra":  # injected: an additional, mis-shaped collective
            dist.all_reduce(torch.zeros(3, dtype=torch.float64))
        dist.all_reduce(t)
        self._stop_agreed = t[1].item() > 0
        if self._stop_agreed and not self.flag.is_set():
            self.flag.set("peer")
        return float(t[0].item())

    def _stop_requested(self) -> bool:
        """Stop after this step? With several ranks: what they all agreed on in this step's
        all-reduce, not the live flag. A watcher thread or a signal can raise one rank's
        flag just after that all-reduce; reading it live, that rank would skip a save and
        leave while the others train on into a collective that never completes."""
        if self.batch.world_size > 1:
            return self._stop_agreed
        return self.flag.is_set()

    def _init_auto_interval(self, step: int) -> None:
        c = self.cfg.checkpoint
        self.auto: AutoInterval | None = None
        if c.interval != "auto":
            return
        failures, hours = 0, 0.0
        if self.rank == 0 and (self.out / "events.jsonl").exists():
            self.events.sync()
            failures, hours = history_from_events(read_events(self.out / "events.jsonl"))
        self.auto = AutoInterval(IntervalPolicy(mtbf_hours=c.mtbf_hours), failures=failures,
                                 hours_observed=hours)
        self._auto_clock = time.monotonic()
        self._auto_last = -1
        self.next_save_step = step + (c.every_steps or 100)  # the first save times δ

    def _save_due(self, step: int) -> str | None:
        c = self.cfg.checkpoint
        if self.auto is not None:
            if step >= self.next_save_step:
                return "auto"
        elif c.every_steps and step % c.every_steps == 0:
            return "steps"
        if c.every_seconds and self._elapsed_since_save() >= c.every_seconds:
            return "seconds"
        return None

    def _elapsed_since_save(self) -> float:
        elapsed = time.monotonic() - self.last_save_time
        if self.dist.is_distributed:  # every rank must decide the same
            elapsed = float(broadcast_object(elapsed))
        return elapsed

    # ------------------------------------------------------------------ main
    def run(self) -> int:
        self._prepare_inputs()
        if self.dist.is_distributed:
            c = self.cfg.distributed
            self.opts.faults.hit("start.init")  # a rank stuck before it joins the group
            beacon = StartupBeacon(self.out, self.rank, self.dist.world_size) \
                if self.cfg.watch.enabled else contextlib.nullcontext()
            with beacon, ProcessGroups(self.dist, c.backend, c.timeout_s) as groups:
                self.groups = groups
                return self._run_with_log()
        return self._run_with_log()

    def _run_with_log(self) -> int:
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            run_id = _run_id(self.out)
            clean_stale(self.ckroot)
            (self.out / "config.yaml").write_text(to_yaml(self.cfg))
        else:
            run_id = ""
        if self.dist.is_distributed:
            run_id = broadcast_object(run_id)
        # Rank 0 owns events.jsonl; other ranks log beside it (the watchdog reads those).
        log_path = self.out / "events.jsonl" if self.rank == 0 else \
            self.out / "ranks" / f"rank{self.rank}" / "events.jsonl"
        self.events = EventLog(log_path, run_id=run_id, rank=self.rank)
        c = self.cfg.checkpoint
        if self.dist.is_distributed:
            assert self.groups is not None
            self.writer: CheckpointWriter | ShardedWriter = ShardedWriter(
                self.ckroot, rank=self.rank, group=self.groups.checkpoint_group, keep=c.keep,
                mode="off" if c.async_mode == "off" else "thread", events=self.events,
                remote=self.remote, faults=self.opts.faults)
        else:
            self.writer = CheckpointWriter(self.ckroot, keep=c.keep, mode=c.async_mode,
                                           events=self.events, remote=self.remote,
                                           faults=self.opts.faults)
        w = self.cfg.watch
        self.rec: Recorder | NullRecorder = (
            Recorder(self.out, self.rank, world_size=self.dist.world_size, interval_s=w.interval_s,
                     faults=self.opts.faults)
            if w.enabled else NullRecorder())
        try:
            with SignalSource(self.flag, self.cfg.preempt.signal), \
                    cloud_watcher(self.cfg.preempt, self.flag, self.events.emit,
                                  local_rank=self.dist.local_rank), \
                    self.rec, self.rec.trace_collectives():
                return self._run()
        except InterruptedError:
            self.events.emit("preempt", step=None, reason=self.flag.reason, saved=False)
            return exitcodes.PREEMPTED
        finally:
            self.writer.close()
            self.events.close()

    def _run(self) -> int:
        cfg = self.cfg
        with self.rec.phase("setup"):
            self._build()
            self.saved_step = -1
            progress = self._resume()
        fresh = progress.step == 0
        self.last_save_time = time.monotonic()
        self._init_auto_interval(progress.step)
        self.events.emit("run_start", step=progress.step, max_steps=cfg.train.max_steps,
                         model=str(self.model_dir), base_fingerprint=self.base_fp,
                         config_hash=self.cfg_hash, train_samples=len(self.train_examples),
                         world_size=self.dist.world_size, strategy=self.strategy or "single",
                         micro_batch_size=self.batch.micro_batch_size,
                         grad_accum=self.batch.accum, pid=os.getpid(),
                         device=_device_name(), market=cfg.cost.market,
                         usd_per_hour=cfg.cost.usd_per_hour,
                         **model_summary(self.model))
        display = ProgressDisplay(cfg.train.max_steps, progress.step,
                                  log_every=cfg.train.log_every_steps, tty=self.opts.tty,
                                  enabled=self.rank == 0)
        if fresh:
            with self.rec.phase("eval"):
                before = self._evaluate(0, "before")
            if before:
                display.write("before: " + _fmt_eval(before))
        try:
            while progress.step < cfg.train.max_steps and not self._stop_requested():
                with self.rec.phase("train_step"):
                    quiet = not self.writer.busy()
                    m = self._train_step(progress)
                    quiet = quiet and not self.writer.busy()
                    self.opts.faults.hit("step.end")
                    self.writer.check()
                self.rec.step_done(progress.step, count_work=quiet)
                if self.auto is not None:
                    self.auto.observe_step(m["step_ms"] / 1e3)
                self.events.emit("step", step=progress.step, epoch=self.order.epoch_of(
                    progress.consumed - 1), **{k: round(v, 6) for k, v in m.items()})
                display.update(progress.step, m["loss"], m["lr"], m["tokens_per_s"])
                if cfg.eval.every_steps and progress.step % cfg.eval.every_steps == 0 \
                        and progress.step < cfg.train.max_steps:
                    with self.rec.phase("eval"):
                        res = self._evaluate(progress.step, "periodic")
                    if res:
                        display.write(f"step {progress.step}: " + _fmt_eval(res))
                reason = self._save_due(progress.step)
                if reason and not self._stop_requested():
                    with self.rec.phase("checkpoint"):
                        self._save(progress, reason, sync=False)
        finally:
            display.close()
        if self._stop_requested():
            with self.rec.phase("checkpoint"):
                return self._preempted(progress)
        with self.rec.phase("checkpoint"):
            self.writer.wait()
            if self.saved_step != progress.step:
                self._save(progress, "final", sync=True)
        with self.rec.phase("eval"):
            after = self._evaluate(progress.step, "after")
        summary: dict[str, Any] = {"step": progress.step}
        with self.rec.phase("export"):
            final = self._export()
        if self.rank == 0:
            summary["final"] = str(final)
            if after:
                summary["eval"] = after
                display.write("after: " + _fmt_eval(after))
            if cfg.export.merged:
                summary["merged"] = str(export_merged(self.model, self.tok, self.out)
                                        if self.strategy != "fsdp" else
                                        export_merged_from(self.model_dir, final, self.cfg.model,
                                                           self.tok, self.out))
            self.events.emit("run_end", status="completed", **summary)
            display.write(f"done: step {progress.step}, adapter in {final}")
            ledger = self._ledger()
            if ledger is not None:
                display.write(ledger)
        barrier()
        return exitcodes.OK

    def _ledger(self) -> str | None:
        """The run's cost ledger (all attempts so far) as a ``cost`` event and one line."""
        from shoestring.report import ledger as L
        from shoestring.report.timeline import load

        try:
            self.events.sync()
            led = L.compute(load(self.out))
        except Exception as e:  # noqa: BLE001 - a report must never fail a finished run
            log.warning("cost ledger unavailable: %s", e)
            return None
        self.events.emit("cost", **led.to_json())
        return led.one_line()

    def _export(self) -> Path:
        if self.strategy == "fsdp":
            state = P.full_adapter_state(self.wrapped)  # a collective: every rank
            return export_adapter(self.model, self.tok, self.out, state_dict=state) \
                if self.rank == 0 else self.out / "final"
        if self.rank == 0:
            return export_adapter(self.model, self.tok, self.out)
        return self.out / "final"

    def _preempted(self, progress: S.Progress) -> int:
        t0 = time.perf_counter()
        saved = False
        self.writer.wait()
        if progress.step > 0:
            if self.saved_step != progress.step:
                self._save(progress, "emergency", sync=True)
            saved = True
        self.events.emit("preempt", step=progress.step, reason=self.flag.reason, saved=saved,
                         notice_to_commit_ms=round((time.time() - (self.flag.set_at or
                                                                    time.time())) * 1e3, 1),
                         save_ms=round((time.perf_counter() - t0) * 1e3, 1))
        self.events.sync()
        # No rank leaves before rank 0 has sealed the checkpoint: torchrun stops the others
        # as soon as one rank exits, which would kill rank 0 in the middle of the seal.
        barrier()
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


def _device_name() -> str:
    """What the cost ledger prices: the GPU's name, or "cpu"."""
    if torch.cuda.is_available():
        return str(torch.cuda.get_device_name(0))
    return "cpu"
