"""GRPO (``train.objective grpo``): the loss of a micro-batch of rollouts, and a step's
inputs made by rolling out (:mod:`shoestring.train.rollout`).

The loss is TRL's ``GRPOTrainer._compute_loss`` with one policy update per rollout
(``num_iterations 1``, TRL's default): the importance ratio is ``exp(logp -
logp.detach())`` (1, with the policy gradient), so PPO's clipping never binds and is
not computed. Per completion token: ``-ratio × advantage``, plus ``beta ×`` the k3
estimate of KL to the reference (the base, adapter disabled) when ``grpo.beta > 0``.
Log-probs are those of the tempered distribution the completions were sampled from
(logits / ``grpo.temperature``, float32). The sum is divided by a normalizer over the
*global* batch: its completion tokens (``dapo``), its completions (``grpo``, each
completion's own mean first) or completions × ``max_completion_tokens``
(``dr_grpo``). Micro-batching and world size therefore do not change the math.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from shoestring.data.prompts import Prompt
from shoestring.data.records import IGNORE_INDEX
from shoestring.train.chunkedloss import completion_logps
from shoestring.train.config import FinetuneConfig, GrpoLoss
from shoestring.train.objective import Output, model_inputs, reference_model
from shoestring.train.rollout import Rollouts, Sampling, Scoring, rollout_seed, sample_group
from shoestring.train.samples import Samples


def token_logps(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """Each position's log-prob of its next label (0 where ignored), tempered, float32:
    ``(rows, width - 1)``."""
    logits = logits[:, :-1].float() / temperature
    labels = labels[:, 1:]
    mask = labels != IGNORE_INDEX
    picked = -F.cross_entropy(
        logits.transpose(1, 2), labels.masked_fill(~mask, 0), reduction="none"
    )
    return picked * mask


@dataclass(frozen=True)
class GRPO:
    beta: float = 0.0
    loss_type: GrpoLoss = "dapo"
    temperature: float = 1.0
    max_completion_tokens: int = 256
    chunk_tokens: int = 0
    name = "grpo"
    #: Summed per step: the KL estimate over completion tokens, and those tokens.
    metrics: tuple[str, ...] = ("kl_sum", "kl_tokens")

    def normalizer(self, samples: Samples, idx: Sequence[int], device: Any) -> torch.Tensor:
        raise TypeError("GRPO's normalizer is counted on its rollouts (GrpoInputs)")

    def logps(
        self, wrapped: torch.nn.Module, model: Any, batch: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        if self.chunk_tokens:
            return completion_logps(wrapped, model, batch, self.chunk_tokens, self.temperature)
        logits = wrapped(**model_inputs(batch)).logits
        return token_logps(logits, batch["labels"], self.temperature)

    def _reference(self, model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with reference_model(model) as ref:
            return self.logps(ref, ref, batch)

    def loss(
        self,
        wrapped: torch.nn.Module,
        model: Any,
        batch: dict[str, torch.Tensor],
        norm: torch.Tensor,
    ) -> Output:
        mask = (batch["labels"][:, 1:] != IGNORE_INDEX).float()
        logp = self.logps(wrapped, model, batch)
        adv = batch["advantages"].to(logp.device, torch.float32).unsqueeze(1)
        per_token = -torch.exp(logp - logp.detach()) * adv
        kl_sum = torch.zeros((), dtype=torch.float64, device=logp.device)
        if self.beta:
            ref = self._reference(model, batch)
            kl = torch.exp(ref - logp) - (ref - logp) - 1
            per_token = per_token + self.beta * kl
            kl_sum = (kl.detach() * mask).sum().double()
        summed = per_token * mask
        if self.loss_type == "grpo":
            total = (summed.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
        else:
            total = summed.sum()
        sums = torch.stack([kl_sum, mask.sum().double()])
        return Output(total / norm.to(total.dtype), sums)


def make_grpo(cfg: FinetuneConfig) -> GRPO:
    g = cfg.grpo
    return GRPO(
        g.beta, g.loss_type, g.temperature, g.max_completion_tokens, cfg.train.loss_chunk_tokens
    )


# --------------------------------------------------------------------------- a step's inputs

#: The rollout counts every rank adds up (one all-reduce per step), before the rewards.
_COUNTS = ("completions", "completion_tokens", "loss_tokens", "tokens", "truncated", "zero_std")


@dataclass
class GrpoInputs:
    """One step's rollouts on this rank, with the global normalizer and counts."""

    rollouts: Rollouts
    norm: torch.Tensor
    tokens: int
    totals: dict[str, float]
    reward_names: tuple[str, ...]
    pad_id: int
    mask_truncated: bool
    with_kl: bool = False

    @property
    def informative(self) -> bool:
        """Some completion of the global batch has a nonzero advantage."""
        return self.totals["zero_std"] < self.totals["completions"] / self.rollouts.group

    def micro_batch(self, start: int, size: int) -> dict[str, torch.Tensor]:
        return self.rollouts.collate(start, size, self.pad_id, self.mask_truncated)

    def metrics(self, sums: torch.Tensor | None, reduce: Reduce) -> dict[str, float]:
        """TRL's GRPO step metrics over the global batch."""
        kl = reduce(sums if sums is not None else torch.zeros(2, dtype=torch.float64))
        g = self.totals
        n = max(g["scored"], 1.0)
        mean = g["reward_sum"] / n
        var = (g["reward_sq"] - n * mean * mean) / (n - 1) if n > 1 else 0.0
        out = {
            "reward": mean,
            "reward_std": max(var, 0.0) ** 0.5,
            "frac_reward_zero_std": g["zero_std"] / max(g["completions"] / self.rollouts.group, 1),
            "completions/mean_length": g["completion_tokens"] / max(g["completions"], 1),
            "completions/clipped_ratio": g["truncated"] / max(g["completions"], 1),
        }
        for name in self.reward_names:
            out[f"rewards/{name}/mean"] = g[f"{name}_sum"] / max(g[f"{name}_count"], 1.0)
        if self.with_kl and float(kl[1]) > 0:
            out["kl"] = float(kl[0]) / float(kl[1])
        return out


Reduce = Any  # Callable[[torch.Tensor], torch.Tensor]: sums a float64 vector over ranks


def _local_counts(r: Rollouts, mask_truncated: bool, names: Sequence[str]) -> torch.Tensor:
    rewards = r.rewards.double()
    ok = ~torch.isnan(rewards)
    grouped = rewards.view(-1, r.group)
    zero_std = sum(
        1 for row in grouped if torch.nan_to_num(row).max() == torch.nan_to_num(row).min()
    )
    values = [
        float(len(r.completions)),
        float(sum(len(c) for c in r.completions)),
        float(r.completion_tokens(mask_truncated)),
        float(sum(len(r.prompts[i // r.group].ids) + len(c) for i, c in enumerate(r.completions))),
        float(sum(r.truncated)),
        float(zero_std),
        float(ok.sum()),
        float(rewards[ok].sum()),
        float((rewards[ok] ** 2).sum()),
    ]
    for j, _ in enumerate(names):
        col = torch.from_numpy(r.table[:, j])
        good = ~torch.isnan(col)
        values += [float(col[good].sum()), float(good.sum())]
    return torch.tensor(values, dtype=torch.float64)


def _totals(counts: torch.Tensor, names: Sequence[str]) -> dict[str, float]:
    keys = [*_COUNTS, "scored", "reward_sum", "reward_sq"]
    for name in names:
        keys += [f"{name}_sum", f"{name}_count"]
    return dict(zip(keys, counts.tolist(), strict=True))


@dataclass(frozen=True)
class RolloutWorker:
    """Samples and scores one rank's share of a step's prompts."""

    prompts: Sequence[Prompt]
    sampling: Sampling
    scoring: Scoring
    objective: GRPO
    seed: int
    pad_id: int
    mask_truncated: bool

    def _sample(
        self, model: Any, positions: Sequence[int], step: int, device: torch.device
    ) -> tuple[list[Prompt], list[list[int]], list[bool]]:
        prompts, completions, truncated = [], [], []
        was_training = model.training
        model.eval()
        try:
            for p in positions:
                prompt = self.prompts[p]
                seed = rollout_seed(self.seed, step, p)
                for ids, cut in sample_group(
                    model, prompt, self.sampling, seed, self.pad_id, device
                ):
                    completions.append(ids)
                    truncated.append(cut)
                prompts.append(prompt)
        finally:
            model.train(was_training)
        return prompts, completions, truncated

    def inputs(
        self,
        model: Any,
        tok: Any,
        positions: Sequence[int],
        step: int,
        device: torch.device,
        reduce: Reduce,
    ) -> GrpoInputs:
        """This rank's rollouts of ``positions`` (its share, in order) at ``step``."""
        prompts, completions, truncated = self._sample(model, positions, step, device)
        group = self.sampling.generations
        table, adv, rewards = self.scoring.advantages(prompts, completions, group, tok)
        r = Rollouts(prompts, completions, truncated, table, adv, rewards, group)
        names = tuple(x.name for x in self.scoring.rewards)
        totals = _totals(reduce(_local_counts(r, self.mask_truncated, names)), names)
        norm = {
            "dapo": totals["loss_tokens"],
            "grpo": totals["completions"],
            "dr_grpo": totals["completions"] * self.sampling.max_new_tokens,
        }[self.objective.loss_type]
        return GrpoInputs(
            r,
            torch.tensor(max(norm, 1.0), dtype=torch.float64, device=device),
            int(totals["tokens"]),
            totals,
            names,
            self.pad_id,
            self.mask_truncated,
            with_kl=self.objective.beta > 0,
        )
