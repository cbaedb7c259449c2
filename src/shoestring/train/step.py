"""One optimizer step over this rank's share of the global batch.

The loss normaliser (label tokens of the *global* batch) is computed locally —
every rank holds the tokenized data — so it needs no collective. Each
micro-batch draws dropout from (seed, step, chunk), never from the world size.
Losses accumulate on the device; the one host sync per step is the agreement
(or, in one process, reading the loss for the log).
"""

from __future__ import annotations

import contextlib
import struct
import time
import zlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from shoestring.checkpoint.faults import Slow
from shoestring.train import state as S
from shoestring.train.compiled import warm_up
from shoestring.train.device import peak_memory, to_device
from shoestring.train.model import check_lora_gradients
from shoestring.train.objective import Output, mean_metrics
from shoestring.train.offload import HostOffload
from shoestring.train.parallel import grad_norm_value
from shoestring.train.placement import misplaced
from shoestring.train.trainer import Trainer


class StepInputs(Protocol):
    """What one step trains on, on this rank: micro-batches by offset into this rank's
    positions, the global normalizer and token count, and the step's metrics."""

    norm: torch.Tensor
    tokens: int

    @property
    def informative(self) -> bool:
        """Whether the step can move the weights (GRPO: not when every advantage is 0):
        the first such step checks that every adapter got a gradient."""
        ...

    def micro_batch(self, start: int, size: int) -> dict[str, torch.Tensor]: ...

    def metrics(
        self, sums: torch.Tensor | None, reduce: Callable[[torch.Tensor], torch.Tensor]
    ) -> dict[str, float]: ...


@dataclass
class SampleInputs:
    """Offline objectives (SFT, preferences): positions of the tokenized samples."""

    t: Trainer
    idx: list[int]
    positions: list[int]

    def __post_init__(self) -> None:
        samples = self.t.data.samples
        self.norm = self.t.objective.normalizer(samples, self.idx, self.t.device)
        self.tokens = sum(samples.tokens(i) for i in self.idx)

    @property
    def informative(self) -> bool:
        return True

    def micro_batch(self, start: int, size: int) -> dict[str, torch.Tensor]:
        return self.t.data.samples.collate(
            self.positions[start : start + size], self.t.tok.pad_token_id
        )

    def metrics(
        self, sums: torch.Tensor | None, reduce: Callable[[torch.Tensor], torch.Tensor]
    ) -> dict[str, float]:
        return _objective_metrics(self.t, sums, len(self.idx), reduce)


def _reduce(t: Trainer) -> Callable[[torch.Tensor], torch.Tensor]:
    """Sums a tensor over the ranks (on the strategy's device), or returns it."""

    def reduce(x: torch.Tensor) -> torch.Tensor:
        if t.run.strategy.world_size == 1:
            return x
        import torch.distributed as dist

        y = x.to(t.device)
        dist.all_reduce(y)
        return y.cpu()

    return reduce


class RolloutStopped(Exception):
    """Every rank agreed to stop while sampling a step's completions: the step is
    abandoned (nothing of it was applied), and the run saves the state before it. The
    rerun samples the same completions again (their seeds are keyed by the step)."""


def _before_each_call(t: Trainer) -> Callable[[], bool]:
    """Asked before each generate call: whether every rank agrees to stop now (a
    preemption notice must not wait for a whole step's sampling)."""

    def stop() -> bool:
        t.run.faults.hit("step.rollout")
        agreed = not t.run.strategy.all_agree(not t.run.flag.is_set())
        if agreed and not t.run.flag.is_set():
            t.run.flag.set("peer")
        return agreed

    return stop


def step_inputs(t: Trainer, idx: list[int], step: int) -> StepInputs:
    """The rank's positions of the global batch ``idx``; with GRPO, rolled out now
    (:class:`RolloutStopped` when a stop is agreed midway)."""
    positions = [
        idx[i] for _, start, size in t.data.batch.my_chunks() for i in range(start, start + size)
    ]
    if t.rollouts is None:
        return SampleInputs(t, idx, positions)
    t_roll = time.perf_counter()
    model, stop = t.learner.model, _before_each_call(t)
    inputs = t.rollouts.inputs(model, t.tok, positions, step, t.device, _reduce(t), stop)
    if inputs is None:
        raise RolloutStopped(f"stopped while sampling step {step + 1}'s completions")
    t.run.rec.work("rollout", time.perf_counter() - t_roll, inputs.tokens)
    shown = t.cfg.grpo.log_completions
    if shown and t.run.strategy.rank == 0:
        t.run.events.emit("completions", step=step + 1, samples=inputs.samples(t.tok, shown))
    return inputs


def _micro_batch(t: Trainer, inputs: StepInputs, start: int, size: int) -> dict[str, torch.Tensor]:
    t_data = time.perf_counter()
    t.run.faults.hit("step.data")
    batch = to_device(inputs.micro_batch(start, size), t.device)
    t.run.rec.work("data", time.perf_counter() - t_data, batch["input_ids"].numel())
    return batch


def _saved_tensors(t: Trainer) -> AbstractContextManager[Any]:
    """Where autograd keeps this micro-batch's saved tensors: host RAM with
    ``train.offload_activations``, else where they are made."""
    if t.cfg.train.offload_activations:
        return HostOffload(t.learner.model, t.device)
    return contextlib.nullcontext()


def _module(t: Trainer) -> torch.nn.Module:
    """What a step's forward calls: the compiled view (``train.compile``), else the
    model as the strategy wrapped it."""
    return t.compiled if t.compiled is not None else t.learner.wrapped


def _forward_backward(
    t: Trainer, batch: dict[str, torch.Tensor], n_items: torch.Tensor, last: bool
) -> Output:
    """The objective's loss of one micro-batch (``n_items``: its normalizer over the
    global batch), backward; the detached loss and metric sums."""
    strategy, learner = t.run.strategy, t.learner
    t_fwd = time.perf_counter()
    with strategy.grad_sync(learner.wrapped, last), _saved_tensors(t):
        with t.precision.autocast():
            out = t.objective.loss(_module(t), learner.model, batch, n_items)
            loss = out.loss
        slow = t.run.faults.hit("step.forward")
        if isinstance(slow, Slow):  # injected straggler: this forward takes NN % longer
            slow.stretch(time.perf_counter() - t_fwd)
        t.run.rec.work("forward", time.perf_counter() - t_fwd, batch["input_ids"].numel())
        # DDP/FSDP average gradients over ranks; each rank's share is a sum.
        learner.backward(loss * strategy.world_size if strategy.world_size > 1 else loss)
    return Output(loss.detach(), out.sums)


class MisplacedTensorError(RuntimeError):
    """A tensor the step touches is not on the strategy's device (a bug, not bad input)."""


def check_placement(t: Trainer, batch: dict[str, torch.Tensor]) -> None:
    """After the first step: everything on the strategy's device, or stop with the list."""
    offload = t.cfg.distributed.cpu_offload and t.run.strategy.name == "fsdp"
    wrong = misplaced(t.device, t.learner.model, t.learner.optimizer, batch, host_state=offload)
    if wrong:
        raise MisplacedTensorError(
            f"{len(wrong)} tensor(s) are not on {t.device}, the "
            f"device training runs on: {'; '.join(wrong[:8])}"
        )


def _objective_metrics(
    t: Trainer,
    sums: torch.Tensor | None,
    pairs: int,
    reduce: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, float]:
    """The preference metrics of the global batch: this rank's sums, summed over ranks."""
    names = t.objective.metrics
    if not names:
        return {}
    if sums is None:  # a rank with no micro-batch this step
        sums = torch.zeros(len(names), dtype=torch.float64, device=t.device)
    return mean_metrics(names, reduce(sums), pairs)


def train_step(t: Trainer, progress: S.Progress) -> dict[str, Any]:
    plan, cfg = t.data.batch, t.cfg.train
    t0 = time.perf_counter()
    idx = t.data.order.indices(progress.consumed, plan.batch_size)
    inputs = step_inputs(t, idx, progress.step)
    tokens = inputs.tokens
    chunks = list(plan.my_chunks())
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    sums: torch.Tensor | None = None
    local = 0
    for k, (chunk, _, size) in enumerate(chunks):
        batch = _micro_batch(t, inputs, local, size)
        local += size
        S.seed_micro_batch(cfg.seed, progress.step, chunk)
        out = _forward_backward(t, batch, inputs.norm, last=k == len(chunks) - 1)
        total += out.loss
        if out.sums is not None:
            sums = out.sums if sums is None else sums + out.sums
    first = not t.grads_checked and inputs.informative
    if first:  # a silent no-op training run fails here, loudly
        check_lora_gradients(t.learner.params)
        t.grads_checked = True
    lr = t.learner.scheduler.get_last_lr()[0]
    grad_norm = t.learner.apply_gradients(cfg.max_grad_norm, grad_norm_value)
    if first:
        check_placement(t, batch)
    loss = t.run.strategy.agree(total, t.run.flag, t.run.faults)
    progress.step += 1
    progress.consumed += plan.batch_size
    progress.tokens += tokens
    dt = time.perf_counter() - t0
    return {
        "loss": loss,
        **inputs.metrics(sums, _reduce(t)),
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": tokens,
        "tokens_per_s": tokens / dt,
        "step_ms": dt * 1e3,
        # Which samples made this step: equal across world sizes and resumes.
        "batch_crc": zlib.crc32(struct.pack(f"<{len(idx)}q", *idx)),
        **peak_memory(t.device),
    }


def compile_warm_up(t: Trainer, progress: S.Progress) -> dict[str, Any]:
    """``train.compile``: compile forward and backward on the next step's first
    micro-batch, outside any step's time; its gradients are dropped (train/compiled.py)."""
    idx = t.data.order.indices(progress.consumed, t.data.batch.batch_size)
    _, start, size = next(iter(t.data.batch.my_chunks()))
    n_items = t.objective.normalizer(t.data.samples, idx, t.device)
    batch = to_device(
        t.data.samples.collate(idx[start : start + size], t.tok.pad_token_id), t.device
    )

    def forward_backward() -> None:
        with t.run.strategy.grad_sync(t.learner.wrapped, False):
            with t.precision.autocast():
                loss = t.objective.loss(_module(t), t.learner.model, batch, n_items).loss
            loss.backward()

    return warm_up(
        forward_backward,
        lambda: t.learner.optimizer.zero_grad(set_to_none=True),
        eager=t.compiled is t.learner.wrapped,
    )
