"""`shoestring finetune`: the life of a run.

open the run → build the trainer → resume (or start) → train → finish, or, on a
preemption flag, finish the step, save synchronously and exit 75. Everything
that differs between one process, DDP and FSDP2 is the strategy's business
(``train/strategy.py``); when to save is the save policy's (``train/saves.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shoestring import exitcodes
from shoestring.checkpoint.attemptlog import PUSH_EVERY_S
from shoestring.checkpoint.interval import history_from_events
from shoestring.events import read_tail
from shoestring.rundir import hold, require_writable
from shoestring.train import state as S
from shoestring.train.chunkedloss import causal_lm
from shoestring.train.config import FinetuneConfig, ResolvedConfig
from shoestring.train.device import Accelerator, resolve
from shoestring.train.evaluate import eval_loss, exact_match
from shoestring.train.model import model_summary
from shoestring.train.objective import eval_preferences, held_out_pairs
from shoestring.train.progress import ProgressDisplay
from shoestring.train.resume import resume
from shoestring.train.resumecheck import check_resume
from shoestring.train.run import Inputs, RunOptions, open_run
from shoestring.train.saves import SavePolicy
from shoestring.train.step import RolloutStopped, compile_warm_up, train_step
from shoestring.train.tracking import check_trackers, tracking
from shoestring.train.trainer import Trainer, build_trainer

__all__ = ["RunOptions", "finetune"]

log = logging.getLogger("shoestring.finetune")

#: How much of the log's end ``checkpoint.interval auto`` reads for the failure history.
HISTORY_BYTES = 16 << 20


def finetune(cfg: FinetuneConfig, opts: RunOptions | None = None) -> int:
    """Run (or resume) a fine-tuning job; returns an exit code from :mod:`shoestring.exitcodes`."""
    opts = opts or RunOptions()
    resolved = resolve(cfg, opts.accelerator or Accelerator.probe(), opts.dist.local_rank)
    check_trackers(resolved.track)
    with _one_job(resolved, opts):
        return _finetune(resolved, opts)


@contextlib.contextmanager
def _one_job(cfg: FinetuneConfig, opts: RunOptions) -> Iterator[None]:
    """Rank 0 holds the output dir's lock (a second job on it is refused at once) and
    checks that it can write there, before anything is read or loaded."""
    if opts.dist.rank != 0:
        yield
        return
    out = Path(cfg.output_dir)
    with hold(out, "wait for it to end, or use another output_dir"):
        require_writable(out)
        yield


def _finetune(cfg: ResolvedConfig, opts: RunOptions) -> int:
    inputs = Inputs.prepare(cfg, opts.dist, opts.cache_dir, opts.hub_access())
    # Refuses before the run directory is touched or any weights load (rank 0 also
    # checks a named checkpoint's hashes, as the load does).
    deep = cfg.checkpoint.verify and opts.dist.rank == 0
    check_resume(cfg, opts.resume, inputs.remote, opts.cache_dir, deep=deep, model=inputs.model)
    with open_run(cfg, opts, inputs.remote, inputs.model) as run:
        try:
            with run.rec.phase("setup"):
                t = build_trainer(cfg, run, inputs)
                if cfg.train.loss_chunk_tokens:  # a model it cannot chunk: refused before step 1
                    causal_lm(t.learner.model)
                progress = resume(t, opts.resume)
                if t.compiled is not None and progress.step < cfg.train.max_steps:
                    # its own phase, never inside a step's time
                    with run.rec.phase("compile"):
                        run.events.emit(
                            "compile", step=progress.step, **compile_warm_up(t, progress)
                        )
            saves = _save_policy(t, progress.step)
            with tracking(t, progress.step if t.saved_step >= 0 else None) as tracked:
                display = begin(t, progress)
                stopped = train(t, progress, saves, display)
                code = preempted(t, progress) if stopped else finish(t, progress, display)
                return tracked.ended_with(code)
        except InterruptedError:  # a stop signal while tokenizing or loading
            run.events.emit("preempt", step=None, reason=run.flag.reason, saved=False)
            return exitcodes.PREEMPTED


def _save_policy(t: Trainer, step: int) -> SavePolicy:
    c, run = t.cfg.checkpoint, t.run
    failures, hours = 0, 0.0
    if c.interval == "auto" and run.strategy.rank == 0 and run.dir.events.exists():
        run.events.sync()
        # The recent history only: a start costs the same however long the log is.
        failures, hours = history_from_events(read_tail(run.dir.events, HISTORY_BYTES))
    return SavePolicy.from_config(
        c, step, failures=failures, hours_observed=hours, share=run.strategy.share
    )


def save(t: Trainer, progress: S.Progress, reason: str, *, sync: bool) -> float:
    """Hand the state to the writer; returns the seconds training was blocked."""
    t0 = time.perf_counter()
    t.run.strategy.save(
        t.run.writer,
        t.learner,
        progress,
        reason=reason,
        sync=sync,
        config=t.config_flat,
        meta=t.meta(),
    )
    t.saved_step = progress.step
    return time.perf_counter() - t0


def _evaluate_rollouts(t: Trainer, step: int, tag: str) -> dict[str, Any] | None:
    """GRPO: the rewards of the held-out prompts' completions."""
    assert t.rollouts is not None
    if not t.data.eval_prompts or not t.run.strategy.evaluates_here():
        return None
    t0 = time.perf_counter()
    prompts = t.data.eval_prompts[: t.cfg.eval.max_samples or None]
    stop = t.run.strategy.eval_stop(t.run.flag)
    with t.precision.autocast():
        res = t.rollouts.evaluate(t.learner.model, t.tok, prompts, t.device, stop)
    return _eval_done(t, step, tag, res, t0)


def evaluate(t: Trainer, step: int, tag: str) -> dict[str, Any] | None:
    """Loss/perplexity and exact match on the held-out set, where the strategy says."""
    if t.rollouts is not None:
        return _evaluate_rollouts(t, step, tag)
    if not t.data.eval_examples or not t.run.strategy.evaluates_here():
        return None
    c, model = t.cfg.eval, t.learner.model
    t0 = time.perf_counter()
    stop = t.run.strategy.eval_stop(t.run.flag)
    if t.objective.metrics:  # preference pairs: the objective's loss and reward metrics
        with t.precision.autocast():
            pairs = held_out_pairs(t.data.eval_examples, c.max_samples)
            res = eval_preferences(
                t.objective,
                model,
                pairs,
                c.batch_size,
                t.tok.pad_token_id,
                stop,
                t.device,
                ref=t.data.eval_ref,
            )
        return _eval_done(t, step, tag, res, t0)
    with t.precision.autocast():
        res = eval_loss(
            model,
            t.data.eval_examples[: c.max_samples or None],
            c.batch_size,
            t.tok.pad_token_id,
            stop,
            t.device,
        )
        probes = t.data.probes[: c.max_samples or None]
        if res is not None and c.exact_match and probes:
            em = exact_match(model, t.tok, probes, c.max_new_tokens, c.batch_size, stop, t.device)
            res = None if em is None else {**res, **em}
    return _eval_done(t, step, tag, res, t0)


def _eval_done(
    t: Trainer, step: int, tag: str, res: dict[str, Any] | None, t0: float
) -> dict[str, Any] | None:
    if res is None:
        return None
    res["eval_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
    t.run.events.emit("eval", step=step, tag=tag, **res)
    return res


def begin(t: Trainer, progress: S.Progress) -> ProgressDisplay:
    """The ``run_start`` event, the display, and the 'before' evaluation of a fresh run."""
    cfg, run = t.cfg, t.run
    run.events.emit(
        "run_start",
        step=progress.step,
        max_steps=cfg.train.max_steps,
        model=str(t.model_dir),
        base_fingerprint=t.base_fp,
        **({"base_source": t.base_source} if t.base_source else {}),
        config_hash=t.config_hash,
        train_samples=t.data.samples_count,
        train_rows=len(t.data.samples),
        world_size=run.strategy.world_size,
        strategy=run.strategy.name,
        micro_batch_size=t.data.batch.micro_batch_size,
        grad_accum=t.data.batch.accum,
        pid=os.getpid(),
        device=_device_name(t),
        train_device=cfg.train.device,
        precision=cfg.train.precision,
        dtype=cfg.model.dtype,
        deterministic=cfg.train.deterministic,
        market=cfg.cost.market,
        usd_per_hour=cfg.cost.usd_per_hour,
        **model_summary(t.learner.model),
    )
    run.events.emit("data", **t.data.summary)
    run.publish_events()
    display = ProgressDisplay(
        cfg.train.max_steps,
        progress.step,
        log_every=cfg.train.log_every_steps,
        tty=run.opts.tty,
        enabled=run.strategy.rank == 0,
    )
    if progress.step == 0:
        with run.rec.phase("eval"):
            before = evaluate(t, 0, "before")
        if before:
            display.write("before: " + _fmt_eval(before))
    return display


def train(t: Trainer, progress: S.Progress, saves: SavePolicy, display: ProgressDisplay) -> bool:
    """Step until max_steps or a stop; returns True when stopped by the flag."""
    cfg, run = t.cfg, t.run
    try:
        while progress.step < cfg.train.max_steps and not run.strategy.stop_requested(run.flag):
            with run.rec.phase("train_step"):
                quiet = not run.writer.busy()
                try:
                    m = train_step(t, progress)
                except RolloutStopped as e:  # GRPO: nothing of the step was applied
                    run.events.emit("step_abandoned", step=progress.step + 1, reason=str(e))
                    return True
                quiet = quiet and not run.writer.busy()
                run.faults.hit("step.end")
                run.writer.check()
            run.rec.step_done(progress.step, count_work=quiet)
            saves.observe_step(m["step_ms"] / 1e3)
            run.events.emit(
                "step",
                step=progress.step,
                epoch=t.data.order.epoch_of(progress.consumed - 1),
                **{k: round(v, 6) for k, v in m.items()},
            )
            display.update(progress.step, m["loss"], m["lr"], m["tokens_per_s"])
            run.publish_events(every_s=PUSH_EVERY_S)
            _periodic_eval(t, progress.step, display)
            reason = saves.due(progress.step)
            if reason and not run.strategy.stop_requested(run.flag):
                with run.rec.phase("checkpoint"):
                    _save_in_background(t, progress, reason, saves)
    finally:
        display.close()
    return run.strategy.stop_requested(run.flag)


def _periodic_eval(t: Trainer, step: int, display: ProgressDisplay) -> None:
    every = t.cfg.eval.every_steps
    if every and step % every == 0 and step < t.cfg.train.max_steps:
        with t.run.rec.phase("eval"):
            res = evaluate(t, step, "periodic")
        if res:
            display.write(f"step {step}: " + _fmt_eval(res))


def _save_in_background(t: Trainer, progress: S.Progress, reason: str, saves: SavePolicy) -> None:
    blocked = save(t, progress, reason, sync=False)
    interval = saves.saved(progress.step, blocked, background=True)
    if interval is not None and t.run.strategy.rank == 0:
        t.run.events.emit("interval", **interval)
    t.run.publish_events()


def finish(t: Trainer, progress: S.Progress, display: ProgressDisplay) -> int:
    """The last save, the 'after' evaluation, the exports and the cost ledger."""
    run = t.run
    with run.rec.phase("checkpoint"):
        run.writer.wait()
        if t.saved_step != progress.step:
            save(t, progress, "final", sync=True)
    with run.rec.phase("eval"):
        after = evaluate(t, progress.step, "after")
    with run.rec.phase("export"):
        final = run.strategy.export(t.learner, t.tok, run.out)
        merged = (
            run.strategy.export_merged(t.learner, final, t.model_dir, t.cfg, t.tok, run.out)
            if t.cfg.export.merged and run.strategy.rank == 0
            else None
        )
        gguf = _export_gguf(t, final) if t.cfg.export.gguf != "none" else None
    if run.strategy.rank == 0:
        _report_end(t, progress, final, merged, after, display, gguf=gguf)
    run.strategy.barrier()
    return exitcodes.OK


def _export_gguf(t: Trainer, final: Path) -> Path | None:
    """``export.gguf``: rank 0 writes OUTPUT/gguf/ (FSDP2: from final/ onto a fresh base)."""
    from shoestring.train.ggufexport import gguf_at_end

    run = t.run
    if run.strategy.rank != 0:
        return None
    model = t.learner.model if run.strategy.whole_model else None
    return gguf_at_end(model, final, t.model_dir, t.cfg, t.tok, run.out)


def _report_end(
    t: Trainer,
    progress: S.Progress,
    final: Any,
    merged: Any,
    after: dict[str, Any] | None,
    display: ProgressDisplay,
    gguf: Path | None = None,
) -> None:
    summary: dict[str, Any] = {"step": progress.step, "final": str(final)}
    if after:
        summary["eval"] = after
        display.write("after: " + _fmt_eval(after))
    if merged is not None:
        summary["merged"] = str(merged)
    if gguf is not None:
        summary["gguf"] = str(gguf)
        display.write(f"GGUF in {gguf} (Ollama: Modelfile beside it)")
    t.run.events.emit("run_end", status="completed", **summary)
    display.write(f"done: step {progress.step}, adapter in {final}")
    ledger = _ledger(t)
    t.run.publish_events()
    if ledger is not None:
        display.write(ledger)


def _ledger(t: Trainer) -> str | None:
    """The run's cost ledger (all attempts so far) as a ``cost`` event and one line."""
    if t.run.opts.ledger is None:
        return None
    try:
        t.run.events.sync()
        fields, line = t.run.opts.ledger(t.run.out)
    except Exception as e:  # noqa: BLE001 - a report must never fail a finished run
        log.warning("cost ledger unavailable: %s", e)
        return None
    t.run.events.emit("cost", **fields)
    return line


def preempted(t: Trainer, progress: S.Progress) -> int:
    """Stopped by the flag: commit an emergency checkpoint, then exit 75 together."""
    run = t.run
    with run.rec.phase("checkpoint"):
        t0 = time.perf_counter()
        run.writer.wait()
        saved = progress.step > 0
        if saved and t.saved_step != progress.step:
            save(t, progress, "emergency", sync=True)
        flagged_at = run.flag.set_at or time.time()
        run.events.emit(
            "preempt",
            step=progress.step,
            reason=run.flag.reason,
            saved=saved,
            notice_to_commit_ms=round((time.time() - flagged_at) * 1e3, 1),
            save_ms=round((time.perf_counter() - t0) * 1e3, 1),
        )
        run.events.sync()
        run.publish_events()
        # No rank leaves before rank 0 has sealed the checkpoint: torchrun stops the others
        # as soon as one rank exits, which would kill rank 0 in the middle of the seal.
        run.strategy.barrier()
    log.warning(
        "preempted (%s) at step %d; checkpoint committed, exiting %d to be resumed",
        run.flag.reason,
        progress.step,
        exitcodes.PREEMPTED,
    )
    return exitcodes.PREEMPTED


def _fmt_eval(res: dict[str, Any]) -> str:
    if "reward" in res:
        return (
            f"eval reward {res['reward']:.4f} (std {res['reward_std']:.4f}) over "
            f"{res['samples']} prompts, completions of {res['completions/mean_length']:.1f} tokens"
        )
    if "rewards/accuracies" in res:
        return (
            f"eval loss {res['loss']:.4f}, reward accuracy "
            f"{100 * res['rewards/accuracies']:.1f}% (margin {res['rewards/margins']:.3f}), "
            f"policy prefers chosen {100 * res['logps/accuracies']:.1f}% of {res['pairs']} pairs"
        )
    parts = [f"eval loss {res['loss']:.4f}", f"ppl {res['perplexity']:.2f}"]
    if "exact_match" in res:
        parts.append(f"exact-match {100 * res['exact_match']:.1f}% of {res['samples']}")
    return ", ".join(parts)


def _device_name(t: Trainer) -> str:
    """What the cost ledger prices: the GPU's name, or "cpu"."""
    if t.device.type == "cuda":
        import torch

        return str(torch.cuda.get_device_name(t.device))
    return "cpu"
