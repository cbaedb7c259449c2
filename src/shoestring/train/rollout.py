"""GRPO's rollouts: completions sampled from the policy, scored, turned into advantages.

Completions are sampled by :mod:`shoestring.train.sampler` in eval mode (no dropout:
they come from the policy being trained), each from its own keyed random stream. A
completion ends at its prompt's first stop token (kept: the model learns to end) or
after ``grpo.max_completion_tokens`` tokens (truncated).

Advantages are TRL's (``multi_objective_aggregation sum_then_normalize``): the
weighted sum of the functions' rewards (NaN where none scored), minus the group's
mean, divided by the group's std (Bessel-corrected) + 1e-4 with ``scale_rewards
group`` (by the whole global batch's std with ``batch``, once the ranks' sums are in:
:mod:`shoestring.train.grpostep`); NaN advantages become 0. A micro-batch is laid out
``[prompt][completion][pad]``, labels on the completion tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from shoestring.data.prompts import Prompt
from shoestring.data.records import IGNORE_INDEX
from shoestring.train.config import RewardScale
from shoestring.train.rewards import Reward, score

Batch = dict[str, torch.Tensor]


def group_advantages(
    table: npt.NDArray[np.float64], weights: Sequence[float], group: int, scale: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, rewards)`` per completion from the functions' rewards (TRL's rule)."""
    t = torch.from_numpy(table).float()
    w = torch.tensor(list(weights), dtype=torch.float32)
    rewards = (t * w).nansum(dim=1)
    rewards[torch.isnan(t).all(dim=1)] = torch.nan
    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    count = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    var = torch.nanmean((grouped - mean) ** 2, dim=1, keepdim=True)
    std = torch.where(count > 1, var * count / (count - 1), torch.nan).sqrt()
    adv = grouped - mean
    if scale:
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv.reshape(-1), nan=0.0), rewards


@dataclass(frozen=True)
class Rollouts:
    """One rank's completions of its share of a step's prompts, ``group`` per prompt."""

    prompts: list[Prompt]
    completions: list[list[int]]
    truncated: list[bool]
    table: npt.NDArray[np.float64]  # (completions, reward functions)
    advantages: torch.Tensor
    rewards: torch.Tensor
    group: int

    def rows(self, first: int, count: int) -> range:
        """The completion rows of prompts ``first .. first + count - 1``."""
        return range(first * self.group, (first + count) * self.group)

    def completion_tokens(self, mask_truncated: bool) -> int:
        return sum(
            len(c)
            for c, cut in zip(self.completions, self.truncated)
            if not (mask_truncated and cut)
        )

    def collate(self, first: int, count: int, pad_id: int, mask_truncated: bool) -> Batch:
        """Prompts ``first ..`` with their completions, right-padded; labels on the
        completion tokens (none on a truncated one with ``mask_truncated``)."""
        rows = self.rows(first, count)
        seqs = [(self.prompts[r // self.group].ids, self.completions[r]) for r in rows]
        width = max(len(p) + len(c) for p, c in seqs)
        ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
        labels = torch.full((len(seqs), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, (r, (p, c)) in enumerate(zip(rows, seqs)):
            n = len(p) + len(c)
            ids[i, :n] = torch.tensor([*p, *c])
            mask[i, :n] = 1
            if not (mask_truncated and self.truncated[r]):
                labels[i, len(p) : n] = torch.tensor(c)
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": labels,
            "advantages": self.advantages[rows.start : rows.stop].clone(),
        }


def _reward_inputs(
    prompts: list[Prompt], completions: list[list[int]], group: int, tok: Any
) -> tuple[list[Any], list[Any], list[list[int]], dict[str, list[Any]]]:
    """What the reward functions receive, one item per completion (TRL's arguments)."""
    owners = [prompts[i // group] for i in range(len(completions))]
    bare = [c[:-1] if c and c[-1] in p.stop else c for c, p in zip(completions, owners)]
    texts = [str(tok.decode(c, skip_special_tokens=True)) for c in bare]
    chat = [p.record.messages is not None for p in owners]
    answers = [[{"role": "assistant", "content": t}] if m else t for t, m in zip(texts, chat)]
    names = dict.fromkeys(k for p in prompts for k in (p.record.columns or {}))
    columns = {k: [(p.record.columns or {}).get(k) for p in owners] for k in names}
    return [p.raw for p in owners], answers, [list(c) for c in completions], columns


@dataclass(frozen=True)
class Scoring:
    rewards: tuple[Reward, ...]
    #: ``grpo.scale_rewards``: ``group`` divides here; ``batch`` later, by the global std.
    scale: RewardScale

    def advantages(
        self, prompts: list[Prompt], completions: list[list[int]], group: int, tok: Any
    ) -> tuple[npt.NDArray[np.float64], torch.Tensor, torch.Tensor]:
        """``(table, advantages, rewards)`` of one rank's completions."""
        table = score(self.rewards, *_reward_inputs(prompts, completions, group, tok))
        weights = [r.weight for r in self.rewards]
        adv, rewards = group_advantages(table, weights, group, self.scale == "group")
        return table, adv, rewards
