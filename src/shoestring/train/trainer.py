"""Building a trainer: every component, in dependency order, before the first step.

Order: threads and determinism → base model dir (rank 0 materializes the
built-in one first) → memory plan check (before anything heavy) → tokenizer
and tokenized data → base model on the strategy's load device (from the
quantized-base cache when it has it) → LoRA → wrap →
learner (optimizer, schedule, gradient scaler). Nothing is added to a
:class:`Trainer` after :func:`build_trainer` returns, except the counters of
what was saved.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shoestring.config import to_flat
from shoestring.heap import bounded_primitive_cache, unmapped_when_freed
from shoestring.hf import fingerprint, load_tokenizer
from shoestring.secrets import redact
from shoestring.train.baselayout import base_layout, versions
from shoestring.train.baseload import load_base
from shoestring.train.compiled import compile_module
from shoestring.train.config import FinetuneConfig, ResolvedConfig, config_hash, precision_of
from shoestring.train.dataset import DataContext, TrainData, load_train_data
from shoestring.train.device import Precision, set_deterministic
from shoestring.train.grpo import GRPO, make_grpo
from shoestring.train.grpostep import RolloutWorker
from shoestring.train.kernels import apply_kernels, check_family
from shoestring.train.learner import Learner
from shoestring.train.model import apply_lora, resolve_model_dir
from shoestring.train.nf4experts import is_fused_experts
from shoestring.train.objective import SFT, Objective, make_objective
from shoestring.train.reflogps import ReferenceJob, with_reference
from shoestring.train.rewards import load_rewards
from shoestring.train.rollout import Scoring
from shoestring.train.run import Inputs, Run, data_cache_storage
from shoestring.train.sampler import Sampling
from shoestring.train.samples import PromptSamples


@dataclass
class Trainer:
    """One rank's fine-tuning job, built."""

    cfg: ResolvedConfig
    run: Run
    model_dir: Path
    base_fp: str
    tok: Any
    data: TrainData
    learner: Learner
    precision: Precision
    config_flat: dict[str, Any]
    config_hash: str
    saved_step: int = -1
    grads_checked: bool = False
    resumed_meta: dict[str, Any] = field(default_factory=dict)  # the resumed manifest's
    tracker_ids: Callable[[], dict[str, str]] = dict  # tracker runs to continue on resume
    base_source: dict[str, str] = field(default_factory=dict)  # a Hub id's commit, a URL's digest
    base_layout: dict[str, str] = field(default_factory=dict)  # its frozen weights' forms
    objective: Objective = field(default_factory=SFT)  # what a step minimizes
    #: ``train.compile``: the compiled view of ``learner.wrapped`` the steps call.
    compiled: torch.nn.Module | None = None
    #: ``train.objective grpo``: samples and scores each step's completions.
    rollouts: RolloutWorker | None = None

    @property
    def device(self) -> torch.device:
        return self.run.strategy.device

    def meta(self) -> dict[str, Any]:
        """What every checkpoint's manifest records about the run."""
        return {
            "config_hash": self.config_hash,
            "base_fingerprint": self.base_fp,
            **({"base_source": self.base_source} if self.base_source else {}),
            "world_size": self.run.strategy.world_size,
            "strategy": self.run.strategy.name,
            "torch": torch.__version__,
            "versions": versions(),
            "base_layout": self.base_layout,
            "kind": "finetune",
            **({"trackers": ids} if (ids := self.tracker_ids()) else {}),
        }


def _model_dir(cfg: FinetuneConfig, run: Run, inputs: Inputs) -> Path:
    if inputs.model is not None:  # resolved (and downloaded) with the inputs
        return inputs.model.path
    strategy = run.strategy
    if strategy.rank != 0:
        strategy.barrier()  # rank 0 materializes the built-in model first
    model_dir = resolve_model_dir(cfg.model, run.opts.cache_dir)
    if strategy.rank == 0:
        strategy.barrier()
    return model_dir


def _plan_check(cfg: FinetuneConfig, run: Run, model_dir: Path) -> None:
    """Refuse (plan.enforce) a config the planner says will not fit the GPU, before
    anything heavy is loaded. Every rank reaches the same verdict."""
    if run.opts.preflight is None:
        return
    fields = run.opts.preflight(cfg, model_dir, run.strategy.world_size)
    if fields is not None:
        run.events.emit("plan", **fields)


def _learner(
    cfg: FinetuneConfig, run: Run, model_dir: Path, base_fp: str, precision: Precision
) -> Learner:
    check_family(cfg.train.kernels, model_dir)  # a family liger cannot patch: before loading
    t0 = time.perf_counter()
    # On a CPU the load's blocks go back to the OS as they are freed, and what is left
    # is trimmed; the steps keep glibc's usual threshold (shoestring.heap).
    on_cpu = run.strategy.device.type == "cpu"
    with unmapped_when_freed() if on_cpu else contextlib.nullcontext():
        loaded = load_base(cfg, run, model_dir, base_fp)
    if on_cpu and any(is_fused_experts(m) for m in loaded.model.modules()):
        bounded_primitive_cache()  # before the first matmul: a shape per expert and step
    seconds = round(time.perf_counter() - t0, 3)
    if cfg.train.kernels != "none":
        run.events.emit("kernels", **apply_kernels(cfg.train.kernels, loaded.model))
    model = apply_lora(loaded.model, cfg.lora, cfg.train.seed, cfg.model.gradient_checkpointing)
    model.train()
    wrapped = run.strategy.wrap(model, getattr(run.rec, "ddp_comm_hook", None))
    # After wrapping: under FSDP2 with one reader, that is when the shards arrive.
    fields = loaded.fields | run.strategy.load_fields()
    run.events.emit("load", phase="model", seconds=seconds, **fields)
    return Learner.build(model, wrapped, cfg.train, precision.make_scaler())


def _data_context(cfg: FinetuneConfig, run: Run) -> DataContext:
    return DataContext(
        cache_dir=run.opts.cache_dir,
        remote=data_cache_storage(cfg) if cfg.data.cache else None,
        should_stop=run.flag.is_set,
        tty=bool(run.opts.tty) and run.strategy.rank == 0,
    )


def rollout_worker(
    cfg: FinetuneConfig, data: TrainData, objective: Objective, pad_id: int
) -> RolloutWorker | None:
    """``train.objective grpo``: what samples and scores each step's completions."""
    if not isinstance(objective, GRPO):
        return None
    assert isinstance(data.samples, PromptSamples), "GRPO trains on prompts"
    g = cfg.grpo
    return RolloutWorker(
        data.samples.prompts,
        Sampling(
            g.generations,
            g.max_completion_tokens,
            g.temperature,
            g.top_p,
            g.top_k,
            g.sample_prompts,
        ),
        Scoring(load_rewards(g.rewards, g.reward_weights), g.scale_rewards),
        objective.loss_type,
        objective.beta > 0,
        cfg.train.seed,
        pad_id,
        g.mask_truncated,
    )


def build_trainer(cfg: ResolvedConfig, run: Run, inputs: Inputs) -> Trainer:
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    device = run.strategy.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if cfg.train.deterministic:
        set_deterministic(device)
    model_dir = _model_dir(cfg, run, inputs)
    _plan_check(cfg, run, model_dir)
    base_fp = fingerprint(model_dir)
    t0 = time.perf_counter()
    tok = load_tokenizer(model_dir)
    data = load_train_data(cfg, inputs.data, inputs.batch, tok, _data_context(cfg, run))
    run.events.emit("load", phase="data", seconds=round(time.perf_counter() - t0, 3))
    precision = Precision(precision_of(cfg), device)
    learner = _learner(cfg, run, model_dir, base_fp, precision)
    online = cfg.train.objective == "grpo"
    objective = make_grpo(cfg, learner.model) if online else make_objective(cfg)
    if cfg.dpo.precompute_ref and cfg.train.objective == "dpo":
        job = ReferenceJob(cfg, run, learner.model, base_fp, precision, tok.pad_token_id)
        data = with_reference(job, data, inputs.data.key)
    return Trainer(
        cfg,
        run,
        model_dir,
        base_fp,
        tok,
        data,
        learner,
        precision,
        redact(to_flat(cfg)),  # written into every checkpoint: no credentials
        config_hash(cfg),
        base_source=inputs.model.record() if inputs.model is not None else {},
        base_layout=base_layout(learner.model),
        objective=objective,
        compiled=compile_module(learner.wrapped) if cfg.train.compile else None,
        rollouts=rollout_worker(cfg, data, objective, tok.pad_token_id),
    )
