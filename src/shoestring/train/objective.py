"""What a step minimizes (``train.objective``): SFT, DPO, ORPO or SimPO, behind one protocol.

An objective turns a micro-batch into a loss (its share of the global batch's loss:
a sum divided by a normalizer computed over the *global* batch, so micro-batching and
world size do not change the math) and, for preferences, the sums of the metrics TRL
users know (``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``,
``rewards/accuracies``, ``logps/chosen``, ``logps/rejected``) over its pairs.

A preference micro-batch holds k pairs as 2k rows, the chosen ones first (TRL's
layout). DPO's reference is the same model with the LoRA adapter disabled
(``peft``'s ``disable_adapter``; eval mode, no grad: no second copy of the base), or
the reference log-probs precomputed with the data (``ref_logps`` in the batch, see
:mod:`shoestring.train.reflogps`). The formulas are TRL's (``DPOTrainer._compute_loss``,
``sigmoid``/``robust``; ``ORPOTrainer.odds_ratio_loss``; ``CPOTrainer.cpo_loss`` with
``loss_type simpo``), checked equal in the tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from shoestring.config import ConfigError
from shoestring.data.records import IGNORE_INDEX, Example
from shoestring.track.metrics import PREFERENCE_FIELDS
from shoestring.train.chunkedloss import causal_lm_loss
from shoestring.train.config import FinetuneConfig
from shoestring.train.device import to_device
from shoestring.train.samples import PairSamples, Samples

Batch = dict[str, torch.Tensor]

#: The metrics of a preference step or eval, in the order of :attr:`Output.sums`.
#: ``logps/accuracies``: pairs whose chosen answer the policy itself finds likelier.
PREFERENCE_METRICS = PREFERENCE_FIELDS  # the trackers' list: one spelling of the names


@dataclass(frozen=True)
class Output:
    """A micro-batch's loss (already divided by the global normalizer) and, for
    preferences, each metric summed over its pairs (None for SFT)."""

    loss: torch.Tensor
    sums: torch.Tensor | None = None


class Objective(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def metrics(self) -> tuple[str, ...]: ...

    def normalizer(self, samples: Samples, idx: Sequence[int], device: Any) -> torch.Tensor: ...

    def loss(
        self,
        wrapped: torch.nn.Module,
        model: Any,
        batch: dict[str, torch.Tensor],
        norm: torch.Tensor,
    ) -> Output: ...


# --------------------------------------------------------------------------- SFT


@dataclass(frozen=True)
class SFT:
    """transformers' causal-LM loss: sum over label tokens / label tokens of the batch."""

    chunk_tokens: int = 0
    name = "sft"
    metrics: tuple[str, ...] = ()

    def normalizer(self, samples: Samples, idx: Sequence[int], device: Any) -> torch.Tensor:
        return torch.tensor(sum(samples.label_tokens(i) for i in idx), device=device)

    def loss(
        self,
        wrapped: torch.nn.Module,
        model: Any,
        batch: dict[str, torch.Tensor],
        norm: torch.Tensor,
    ) -> Output:
        if self.chunk_tokens:
            return Output(causal_lm_loss(wrapped, model, batch, norm, self.chunk_tokens))
        return Output(wrapped(**batch, num_items_in_batch=norm).loss)


# --------------------------------------------------------------------------- log-probs


def sequence_logps(
    logits: torch.Tensor, labels: torch.Tensor, *, average: bool = False
) -> torch.Tensor:
    """Each row's log-probability of its label tokens (labels shift by one), summed or
    averaged over them, in float32."""
    logits = logits[:, :-1].float()
    labels = labels[:, 1:]
    mask = labels != IGNORE_INDEX
    picked = torch.gather(logits, -1, labels.masked_fill(~mask, 0).unsqueeze(-1)).squeeze(-1)
    per_token = (picked - torch.logsumexp(logits, dim=-1)) * mask
    total = per_token.sum(-1)
    return total / mask.sum(-1) if average else total


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


@contextmanager
def reference_model(model: Any) -> Iterator[Any]:
    """``model`` as DPO's reference for the block: the adapter disabled (the frozen
    base), eval mode (no dropout, no RNG drawn), no autograd."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), model.disable_adapter():
            yield model
    finally:
        model.train(was_training)


def reference_logps(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with reference_model(model) as ref:
        return sequence_logps(ref(**model_inputs(batch)).logits, batch["labels"])


def _pair_sums(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
) -> torch.Tensor:
    c, r = chosen_rewards.detach(), rejected_rewards.detach()
    lc, lr = chosen_logps.detach(), rejected_logps.detach()
    return torch.stack(
        [
            c.sum(),
            r.sum(),
            (c - r).sum(),
            (c > r).float().sum(),
            lc.sum(),
            lr.sum(),
            (lc > lr).float().sum(),
        ]
    ).double()


def _pairs(idx: Sequence[int], device: Any) -> torch.Tensor:
    return torch.tensor(float(len(idx)), dtype=torch.float64, device=device)


def _tokens_and_pairs(tokens: int, idx: Sequence[int], device: Any) -> torch.Tensor:
    """The normalizers of a loss with an NLL term: its tokens, and the pairs."""
    return torch.tensor([float(tokens), float(len(idx))], dtype=torch.float64, device=device)


# --------------------------------------------------------------------------- DPO


@dataclass(frozen=True)
class DPO:
    """TRL's DPO loss, ``sigmoid`` (``robust`` with label smoothing): per pair
    ``-log σ(β Δ)`` with ``Δ`` the chosen minus the rejected log-ratio to the reference
    (summed log-probs of the answer tokens); the mean over the global batch's pairs."""

    beta: float = 0.1
    label_smoothing: float = 0.0
    name = "dpo"
    metrics: tuple[str, ...] = PREFERENCE_METRICS

    def normalizer(self, samples: Samples, idx: Sequence[int], device: Any) -> torch.Tensor:
        return _pairs(idx, device)

    def loss(
        self,
        wrapped: torch.nn.Module,
        model: Any,
        batch: dict[str, torch.Tensor],
        norm: torch.Tensor,
    ) -> Output:
        logps = sequence_logps(wrapped(**model_inputs(batch)).logits, batch["labels"])
        ref = batch.get("ref_logps")
        if ref is None:
            ref = reference_logps(model, batch)
        return self.from_logps(logps, ref.to(logps.dtype), norm)

    def from_logps(self, logps: torch.Tensor, ref: torch.Tensor, norm: torch.Tensor) -> Output:
        chosen, rejected = logps.chunk(2)
        ref_chosen, ref_rejected = ref.chunk(2)
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        delta = self.beta * (chosen_ratio - rejected_ratio)
        ls = self.label_smoothing
        clean = -(1 - ls) * F.logsigmoid(delta)
        flipped = -ls * F.logsigmoid(-delta)
        per_pair = (clean - flipped) / (1 - 2 * ls)
        sums = _pair_sums(self.beta * chosen_ratio, self.beta * rejected_ratio, chosen, rejected)
        return Output(per_pair.sum() / norm.to(per_pair.dtype), sums)


# --------------------------------------------------------------------------- ORPO


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stable on both sides of ``-log 2``."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


@dataclass(frozen=True)
class ORPO:
    """ORPO as TRL computes it: the NLL of the chosen sequences (every non-pad token
    after the first, prompt included; mean over the global batch's tokens) minus
    ``λ`` × the mean ``log σ(log odds ratio)`` of the averaged answer log-probs."""

    beta: float = 0.1
    name = "orpo"
    metrics: tuple[str, ...] = PREFERENCE_METRICS

    def normalizer(self, samples: Samples, idx: Sequence[int], device: Any) -> torch.Tensor:
        assert isinstance(samples, PairSamples), "ORPO trains on pairs"
        return _tokens_and_pairs(sum(samples.chosen_positions(i) for i in idx), idx, device)

    def loss(
        self,
        wrapped: torch.nn.Module,
        model: Any,
        batch: dict[str, torch.Tensor],
        norm: torch.Tensor,
    ) -> Output:
        logits = wrapped(**model_inputs(batch)).logits
        k = logits.shape[0] // 2
        whole = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)[:k]
        nll = F.cross_entropy(
            logits[:k, :-1].float().reshape(-1, logits.shape[-1]),
            whole[:, 1:].reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        chosen, rejected = sequence_logps(logits, batch["labels"], average=True).chunk(2)
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        ratio = self.beta * F.logsigmoid(log_odds)
        norm = norm.to(nll.dtype)
        loss = nll / norm[0] - ratio.sum() / norm[1]
        return Output(loss, _pair_sums(self.beta * chosen, self.beta * rejected, chosen, rejected))


# --------------------------------------------------------------------------- SimPO


@dataclass(frozen=True)
class SimPO:
    """SimPO (Meng, Xia and Chen 2024) as TRL's ``CPOTrainer`` computes it (``loss_type
    simpo``): per pair ``-log σ(β (mean log p chosen - mean log p rejected) - γ)`` (the
    means over each answer's tokens; label smoothing as CPO's), the mean over the global
    batch's pairs, plus ``alpha`` × the NLL of the chosen answers (the mean over their
    tokens: CPO-SimPO when 1). No reference model: memory as ORPO's."""

    beta: float = 2.0
    gamma: float = 0.5
    alpha: float = 0.0
    label_smoothing: float = 0.0
    name = "simpo"
    metrics: tuple[str, ...] = PREFERENCE_METRICS

    def normalizer(self, samples: Samples, idx: Sequence[int], device: Any) -> torch.Tensor:
        assert isinstance(samples, PairSamples), "SimPO trains on pairs"
        return _tokens_and_pairs(sum(samples.chosen_labels(i) for i in idx), idx, device)

    def loss(
        self,
        wrapped: torch.nn.Module,
        model: Any,
        batch: dict[str, torch.Tensor],
        norm: torch.Tensor,
    ) -> Output:
        labels = batch["labels"]
        summed = sequence_logps(wrapped(**model_inputs(batch)).logits, labels)
        counts = (labels[:, 1:] != IGNORE_INDEX).sum(-1).clamp(min=1)
        chosen, rejected = (summed / counts).chunk(2)
        z = self.beta * (chosen - rejected) - self.gamma
        ls = self.label_smoothing
        per_pair = -(1 - ls) * F.logsigmoid(z) - ls * F.logsigmoid(-z)
        norm = norm.to(per_pair.dtype)
        loss = per_pair.sum() / norm[1]
        if self.alpha:
            loss = loss - self.alpha * summed.chunk(2)[0].sum() / norm[0]
        return Output(loss, _pair_sums(self.beta * chosen, self.beta * rejected, chosen, rejected))


# --------------------------------------------------------------------------- choice


def make_objective(cfg: FinetuneConfig) -> Objective:
    kind = cfg.train.objective
    if kind == "dpo":
        return DPO(cfg.dpo.beta, cfg.dpo.label_smoothing)
    if kind == "orpo":
        return ORPO(cfg.dpo.beta)
    if kind == "simpo":
        d = cfg.dpo
        return SimPO(d.beta, d.simpo_gamma, d.cpo_alpha, d.label_smoothing)
    assert kind != "grpo", "GRPO is made by shoestring.train.grpo.make_grpo"
    return SFT(cfg.train.loss_chunk_tokens)


def check_objective(cfg: FinetuneConfig) -> None:
    """Options that do not go with preference pairs, refused by name before any work."""
    kind = cfg.train.objective
    if kind == "grpo":
        return check_online(cfg)
    if cfg.data.format == "prompt":
        raise ConfigError(
            "data.format: prompt records (no answer) are read by train.objective grpo only"
        )
    if kind == "sft":
        return
    if cfg.data.packing:
        raise ConfigError(
            f"data.packing: train.objective {kind} trains on (chosen, rejected) pairs, "
            "which are not packed; set data.packing false"
        )
    if cfg.train.loss_chunk_tokens:
        raise ConfigError(
            f"train.loss_chunk_tokens: not available with train.objective {kind}; set it to 0"
        )
    if cfg.dpo.precompute_ref and kind != "dpo":
        raise ConfigError("dpo.precompute_ref: only train.objective dpo has a reference model")


def check_online(cfg: FinetuneConfig) -> None:
    """GRPO's options that do not go together, refused by name before any work; the
    reward functions are imported here, so a typo fails now."""
    from shoestring.train.rewards import load_rewards

    if cfg.data.format not in ("auto", "prompt"):
        raise ConfigError(
            f'data.format: train.objective grpo reads prompt records ({{"prompt": ...}}), '
            f"not {cfg.data.format}; set data.format auto or prompt"
        )
    if cfg.data.packing:
        raise ConfigError(
            "data.packing: train.objective grpo trains on its own completions; set it false"
        )
    if cfg.train.compile:
        raise ConfigError(
            "train.compile: not available with train.objective grpo yet; set it false"
        )
    if cfg.distributed.strategy == "fsdp":
        raise ConfigError(
            "distributed.strategy: train.objective grpo samples with generate, which FSDP "
            "would run one gathered layer at a time; use ddp"
        )
    if cfg.train.kernels != "none":
        raise ConfigError(
            "train.kernels: the fused kernels replace the loss GRPO computes; set it none"
        )
    load_rewards(cfg.grpo.rewards, cfg.grpo.reward_weights)


def mean_metrics(names: Sequence[str], sums: torch.Tensor, pairs: int) -> dict[str, float]:
    return {n: v / max(pairs, 1) for n, v in zip(names, sums.tolist(), strict=True)}


def held_out_pairs(examples: list[Example], max_samples: int) -> list[Example]:
    """The held-out examples evaluation reads: the first ``max_samples`` pairs (0: all)."""
    return examples[: 2 * max_samples or None]


@torch.no_grad()
def eval_preferences(
    objective: Objective,
    model: Any,
    examples: Sequence[Example],
    batch_size: int,
    pad_id: int,
    should_stop: Callable[[], bool],
    device: Any = None,
    ref: npt.NDArray[np.float64] | None = None,
) -> dict[str, float] | None:
    """The objective's loss and metrics over held-out pairs (examples ``2i``, ``2i + 1``),
    ``batch_size`` pairs at a time, in eval mode; None when stopped. ``ref``: the
    examples' precomputed reference log-probs (DPO then runs no reference forward)."""
    assert ref is None or len(ref) == len(examples), "one reference log-prob per example"
    pairs = PairSamples(examples, ref)
    n = len(pairs)
    if not n:
        return None
    norm = objective.normalizer(pairs, range(n), device)
    was_training = model.training
    model.eval()
    loss, sums = 0.0, torch.zeros(len(objective.metrics), dtype=torch.float64, device=device)
    try:
        for start in range(0, n, batch_size):
            if should_stop():
                return None
            batch = to_device(
                pairs.collate(range(start, min(start + batch_size, n)), pad_id), device
            )
            out = objective.loss(model, model, batch, norm)
            loss += float(out.loss)
            if out.sums is not None:
                sums += out.sums
    finally:
        model.train(was_training)
    return {"loss": loss, **mean_metrics(objective.metrics, sums, n), "pairs": n}
