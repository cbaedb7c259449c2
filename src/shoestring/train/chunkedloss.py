"""Chunked cross-entropy (``train.loss_chunk_tokens``): the LM head and the loss over
N token positions at a time, so the vocabulary-sized logits are never whole.

The decoder runs through the strategy's wrapped module (so DDP's forward prepares its
gradient reducer and FSDP2 unshards the root, exactly as in the plain path) with the
causal LM's ``lm_head`` swapped for a pass-through for that one call: the model then
returns its final hidden states where the logits would be. Each chunk of hidden
states then goes through the real head — whatever module it is, a LoRA-adapted head
included — and ``cross_entropy(..., reduction="sum")`` in fp32, inside
``torch.utils.checkpoint`` (non-reentrant): autograd keeps only the chunk's inputs
(views of the hidden states and of the shifted labels), and backward recomputes one
chunk's logits at a time. The reduction is transformers' ``ForCausalLMLoss``: labels
shifted by one, ``-100`` ignored, the sum divided by ``num_items_in_batch``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from shoestring.config import ConfigError

KEY = "train.loss_chunk_tokens"
IGNORE_INDEX = -100
#: Config fields of models that transform the head's output before the loss (Gemma 2/3
#: soft-capping, Cohere and Granite scaling, ...): chunking the bare head would skip it.
_LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "lm_head_multiplier",
    "output_multiplier_scale",
)


class _HiddenStates(torch.nn.Module):
    """Stands in for ``lm_head`` during the decoder call: returns its input."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def causal_lm(model: Any) -> Any:
    """The Hugging Face causal LM inside a PEFT model (or the model itself), after
    checking that the chunked loss computes what its own loss would."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not isinstance(getattr(base, "lm_head", None), torch.nn.Module):
        raise ConfigError(f"{KEY}: {type(base).__name__} has no lm_head module to chunk")
    from transformers.loss.loss_utils import ForCausalLMLoss

    if getattr(base, "loss_function", None) is not ForCausalLMLoss:
        raise ConfigError(
            f"{KEY}: {type(base).__name__} computes its loss with something other than "
            "transformers' ForCausalLMLoss; set it to 0 for this model"
        )
    cfg = getattr(base, "config", None)
    for name in _LOGIT_TRANSFORMS:
        if getattr(cfg, name, None) not in (None, 1, 1.0):
            raise ConfigError(
                f"{KEY}: {type(base).__name__} transforms its logits ({name}); "
                "the chunked loss would skip that: set it to 0 for this model"
            )
    return base


@contextmanager
def _decoder_only(base: Any) -> Iterator[torch.nn.Module]:
    """Within the block, ``base``'s forward returns hidden states as its logits; yields
    the real head."""
    head = base.lm_head
    base.lm_head = _HiddenStates()
    try:
        yield head
    finally:
        base.lm_head = head


def _chunk_loss(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def _has_dropout(module: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in module.modules())


def chunked_lm_loss(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    num_items: torch.Tensor,
    chunk_tokens: int,
) -> torch.Tensor:
    """``ForCausalLMLoss(head(hidden), labels, num_items_in_batch=num_items)``, computed
    ``chunk_tokens`` positions at a time (over the flattened batch) under checkpoint."""
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    # The head's RNG is replayed in the recompute only if it draws any (LoRA dropout on
    # an adapted lm_head); otherwise each chunk would keep a copy of the RNG state.
    rng = head.training and _has_dropout(head)
    total: torch.Tensor | None = None
    for h, y in zip(flat.split(chunk_tokens), shifted.split(chunk_tokens)):
        part = checkpoint(_chunk_loss, head, h, y, use_reentrant=False, preserve_rng_state=rng)
        total = part if total is None else total + part
    assert total is not None, "an empty batch has no loss"
    return total / num_items


def causal_lm_loss(
    wrapped: torch.nn.Module,
    model: Any,
    batch: Mapping[str, torch.Tensor],
    num_items: torch.Tensor,
    chunk_tokens: int,
) -> torch.Tensor:
    """The training loss of ``batch`` through ``wrapped`` (the strategy's module around
    ``model``) with the head and cross-entropy chunked."""
    base = causal_lm(model)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with _decoder_only(base) as head:
        hidden = wrapped(**inputs).logits
    return chunked_lm_loss(head, hidden, batch["labels"], num_items, chunk_tokens)


def _chunk_logps(
    head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, temperature: float
) -> torch.Tensor:
    logits = head(hidden).float() / temperature
    return -F.cross_entropy(logits, labels, reduction="none")


def completion_logps(
    wrapped: torch.nn.Module,
    model: Any,
    batch: Mapping[str, torch.Tensor],
    chunk_tokens: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Each position's tempered log-prob of its next label (0 where ignored), float32,
    ``(rows, width - 1)``: the head runs on the labelled positions only, ``chunk_tokens``
    at a time under checkpoint (GRPO's completion tokens; the prompts get no logits)."""
    base = causal_lm(model)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    with _decoder_only(base) as head:
        hidden = wrapped(**inputs).logits
    labels = batch["labels"][:, 1:]
    where = (labels != IGNORE_INDEX).reshape(-1).nonzero().squeeze(-1)
    flat = hidden[:, :-1].reshape(-1, hidden.shape[-1]).index_select(0, where)
    targets = labels.reshape(-1).index_select(0, where)
    rng = head.training and _has_dropout(head)
    parts = [
        checkpoint(
            _chunk_logps, head, h, y, temperature, use_reentrant=False, preserve_rng_state=rng
        )
        for h, y in zip(flat.split(chunk_tokens), targets.split(chunk_tokens))
    ]
    values = torch.cat(parts) if parts else flat.new_zeros(0, dtype=torch.float32)
    out = torch.zeros(labels.numel(), dtype=torch.float32, device=hidden.device)
    return out.index_put((where,), values).view_as(labels)
