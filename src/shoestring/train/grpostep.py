"""GRPO's step inputs and its held-out evaluation: one rank's prompts rolled out
(:mod:`shoestring.train.rollout`), the global normalizer, and TRL's metrics.

A step's counts (completions, their tokens, rewards and each function's, truncated
completions, groups with equal rewards) are summed over the ranks in one all-reduce;
the normalizer of ``grpo.loss_type`` comes from them, so every rank divides by the
same global number. Evaluation samples ``grpo.generations`` completions of each
held-out prompt from seeds keyed by the prompt alone (not the step), so the evaluations
before and after training compare the same random draws.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shoestring.data.prompts import Prompt
from shoestring.train.config import GrpoLoss
from shoestring.train.rollout import Rollouts, Scoring
from shoestring.train.sampler import Sampling, sample

Reduce = Callable[[torch.Tensor], torch.Tensor]
#: The seed's step of held-out prompts: one draw for every evaluation of a run.
EVAL_STEP = -1
#: The counts every rank adds up (one all-reduce per step), before the rewards'.
_COUNTS = (
    "completions",
    "completion_tokens",
    "loss_tokens",
    "tokens",
    "truncated",
    "zero_std",
    "scored",
    "reward_sum",
    "reward_sq",
)


def _zero_std_groups(rewards: torch.Tensor, group: int) -> int:
    """Groups whose rewards have zero std (TRL's ``frac_reward_zero_std``, NaN-aware)."""
    g = rewards.view(-1, group)
    count = (~torch.isnan(g)).sum(1)
    mean = torch.nanmean(g, 1, keepdim=True)
    var = torch.nanmean((g - mean) ** 2, 1) * count / (count - 1).clamp(min=1)
    return int((torch.isclose(var.sqrt(), torch.zeros(())) & (count > 1)).sum())


def _local_counts(r: Rollouts, mask_truncated: bool, names: Sequence[str]) -> torch.Tensor:
    rewards = r.rewards.double()
    ok = ~torch.isnan(rewards)
    values = [
        float(len(r.completions)),
        float(sum(len(c) for c in r.completions)),
        float(r.completion_tokens(mask_truncated)),
        float(sum(len(r.prompts[i // r.group].ids) + len(c) for i, c in enumerate(r.completions))),
        float(sum(r.truncated)),
        float(_zero_std_groups(r.rewards, r.group)),
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
    keys = list(_COUNTS)
    for name in names:
        keys += [f"{name}_sum", f"{name}_count"]
    return dict(zip(keys, counts.tolist(), strict=True))


def rollout_metrics(totals: dict[str, float], names: Sequence[str], group: int) -> dict[str, float]:
    """TRL's GRPO metrics from summed counts: ``reward`` (mean weighted reward of the
    scored completions), ``reward_std``, ``frac_reward_zero_std``, completion length and
    clipped ratio, and ``rewards/<name>/mean`` per function."""
    g = totals
    n = g["scored"]
    mean = g["reward_sum"] / max(n, 1.0)
    var = (g["reward_sq"] - n * mean * mean) / (n - 1) if n > 1 else 0.0
    completions = max(g["completions"], 1.0)
    out = {
        "reward": mean,
        "reward_std": max(var, 0.0) ** 0.5,
        "frac_reward_zero_std": g["zero_std"] * group / completions,
        "completions/mean_length": g["completion_tokens"] / completions,
        "completions/clipped_ratio": g["truncated"] / completions,
    }
    for name in names:
        out[f"rewards/{name}/mean"] = g[f"{name}_sum"] / max(g[f"{name}_count"], 1.0)
    return out


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

    def samples(self, tok: Any, n: int) -> list[dict[str, Any]]:
        """The first ``n`` completions as text, with their prompt, rewards and advantage
        (what a person reads to catch a reward being gamed)."""
        r = self.rollouts
        out = []
        for i in range(min(n, len(r.completions))):
            rewards = dict(zip(self.reward_names, r.table[i].tolist(), strict=True))
            out.append(
                {
                    "prompt": r.prompts[i // r.group].raw,
                    "completion": str(tok.decode(r.completions[i], skip_special_tokens=True)),
                    "rewards": {k: None if v != v else round(v, 6) for k, v in rewards.items()},
                    "advantage": round(float(r.advantages[i]), 6),
                    "truncated": r.truncated[i],
                }
            )
        return out

    def metrics(self, sums: torch.Tensor | None, reduce: Reduce) -> dict[str, float]:
        """The step's metrics over the global batch; ``sums``: the loss's KL sums."""
        kl = reduce(sums if sums is not None else torch.zeros(2, dtype=torch.float64))
        out = rollout_metrics(self.totals, self.reward_names, self.rollouts.group)
        if self.with_kl and float(kl[1]) > 0:
            out["kl"] = float(kl[0]) / float(kl[1])
        return out


def _normalizer(loss_type: GrpoLoss, totals: dict[str, float], max_new_tokens: int) -> float:
    """The global batch's divisor of ``grpo.loss_type`` (see :mod:`shoestring.train.grpo`)."""
    if loss_type == "dapo":
        return max(totals["loss_tokens"], 1.0)
    if loss_type == "grpo":
        return max(totals["completions"], 1.0)
    return max(totals["completions"] * max_new_tokens, 1.0)


@dataclass(frozen=True)
class RolloutWorker:
    """Samples and scores one rank's share of a step's prompts."""

    prompts: Sequence[Prompt]
    sampling: Sampling
    scoring: Scoring
    loss_type: GrpoLoss
    with_kl: bool
    seed: int
    pad_id: int
    mask_truncated: bool

    @property
    def reward_names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.scoring.rewards)

    def rollouts(
        self,
        model: Any,
        tok: Any,
        prompts: Sequence[tuple[int, Prompt]],
        step: int,
        device: torch.device,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> Rollouts | None:
        """Each ``(position, prompt)``'s group sampled (eval mode, ``prompts_per_call``
        prompts at a time) and scored; None when stopped before a call."""
        rows: list[tuple[list[int], bool]] = []
        per_call = self.sampling.prompts_per_call
        was_training = model.training
        model.eval()
        try:
            for start in range(0, len(prompts), per_call):
                if should_stop():
                    return None
                part = prompts[start : start + per_call]
                rows += sample(model, part, self.sampling, self.seed, step, self.pad_id, device)
        finally:
            model.train(was_training)
        group = self.sampling.generations
        kept = [p for _, p in prompts]
        completions = [ids for ids, _ in rows]
        table, adv, rewards = self.scoring.advantages(kept, completions, group, tok)
        return Rollouts(kept, completions, [cut for _, cut in rows], table, adv, rewards, group)

    def inputs(
        self,
        model: Any,
        tok: Any,
        positions: Sequence[int],
        step: int,
        device: torch.device,
        reduce: Reduce,
        should_stop: Callable[[], bool],
    ) -> GrpoInputs | None:
        """This rank's rollouts of ``positions`` (its share, in order) at ``step``; None
        when ``should_stop`` (asked before each call, on every rank alike) says stop."""
        pairs = [(p, self.prompts[p]) for p in positions]
        r = self.rollouts(model, tok, pairs, step, device, should_stop)
        if r is None:
            return None
        names = self.reward_names
        totals = _totals(reduce(_local_counts(r, self.mask_truncated, names)), names)
        if self.scoring.scale == "batch":  # TRL's: the std of every reward of the batch
            r.advantages.div_(rollout_metrics(totals, names, r.group)["reward_std"] + 1e-4)
        norm = _normalizer(self.loss_type, totals, self.sampling.max_new_tokens)
        return GrpoInputs(
            r,
            torch.tensor(norm, dtype=torch.float64, device=device),
            int(totals["tokens"]),
            totals,
            names,
            self.pad_id,
            self.mask_truncated,
            self.with_kl,
        )

    @torch.no_grad()
    def evaluate(
        self,
        model: Any,
        tok: Any,
        prompts: Sequence[Prompt],
        device: torch.device,
        should_stop: Callable[[], bool],
    ) -> dict[str, float] | None:
        """The rewards of held-out prompts' completions (one rank; None when stopped)."""
        r = self.rollouts(model, tok, list(enumerate(prompts)), EVAL_STEP, device, should_stop)
        if r is None:
            return None
        names = self.reward_names
        totals = _totals(_local_counts(r, self.mask_truncated, names), names)
        return {**rollout_metrics(totals, names, r.group), "samples": len(prompts)}
