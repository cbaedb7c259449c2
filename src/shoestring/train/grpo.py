"""GRPO (``train.objective grpo``): the loss of a micro-batch of rollouts (a step's
rollouts are made by :mod:`shoestring.train.grpostep`).

The loss is TRL's ``GRPOTrainer._compute_loss`` with one policy update per rollout
(``num_iterations 1``, TRL's default): the importance ratio is ``exp(logp -
logp.detach())`` (1, with the policy gradient), so PPO's clipping never binds and is
not computed. Per completion token: ``-ratio × advantage``, plus ``beta ×`` the k3
estimate of KL to the reference (the base, adapter disabled) when ``grpo.beta > 0``.
Log-probs are those of the tempered distribution the completions were sampled from
(logits / ``grpo.temperature``, float32), with the LM head run on the completion
positions only, in checkpointed chunks
(:func:`shoestring.train.chunkedloss.completion_logps`: the prompts never get logits),
unless the model's head cannot be chunked. The sum is divided by a normalizer over the
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

from shoestring.config import ConfigError
from shoestring.data.records import IGNORE_INDEX
from shoestring.train.chunkedloss import causal_lm, completion_logps
from shoestring.train.config import FinetuneConfig, GrpoLoss
from shoestring.train.objective import Output, model_inputs, reference_model
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
    #: Completion positions the LM head runs on at a time (``train.loss_chunk_tokens``,
    #: else :data:`HEAD_CHUNK`); 0: the model's own forward, whole logits (a model whose
    #: head the chunks would bypass: logit soft-capping or scaling).
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


#: Completion positions per LM-head chunk when train.loss_chunk_tokens is 0: at a
#: 128k vocabulary, 0.5 GB of float32 logits at a time.
HEAD_CHUNK = 1024


def head_chunk(cfg: FinetuneConfig, model: Any) -> int:
    """The LM head on completion positions only, in chunks, where the model allows it
    (as TRL's fused head does): prompt positions never get logits."""
    try:
        causal_lm(model)
    except ConfigError:
        return 0
    return cfg.train.loss_chunk_tokens or HEAD_CHUNK


def make_grpo(cfg: FinetuneConfig, model: Any) -> GRPO:
    g = cfg.grpo
    chunk = head_chunk(cfg, model)
    return GRPO(g.beta, g.loss_type, g.temperature, g.max_completion_tokens, chunk)
