"""The global batch and its split over ranks; helpers for sharded (FSDP2) models.

Wrapping and the no-sync context belong to the strategies (``train/strategy.py``).

The global batch — samples per optimizer step — is a config value; the world
size only decides who computes which part of it. Positions
``consumed .. consumed + batch_size - 1`` of the global sample order are cut
into micro-batches of ``micro_batch_size``; rank ``r`` takes micro-batches
``r*A .. (r+1)*A - 1`` where ``A`` is the accumulation count. Loss is the sum
over the global batch divided by the global count of label tokens, which every
rank computes locally (it holds the tokenized data), so no collective is
needed for it; gradients are averaged by DDP/FSDP, hence the ``world_size``
factor on each rank's loss.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from shoestring.config import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's global batch is split for this world size."""

    batch_size: int
    micro_batch_size: int
    world_size: int
    rank: int

    @property
    def accum(self) -> int:
        return self.batch_size // (self.micro_batch_size * self.world_size)

    @classmethod
    def make(cls, batch_size: int, micro_batch_size: int, world_size: int, rank: int) -> BatchPlan:
        micro = micro_batch_size or batch_size // world_size
        if micro <= 0 or batch_size % (micro * world_size):
            raise ConfigError(
                f"train.batch_size {batch_size} (the global batch) must be a multiple of "
                f"train.micro_batch_size ({micro_batch_size or 'auto'} -> {micro}) x world size "
                f"{world_size}; choose a micro_batch_size that divides "
                f"{batch_size // max(world_size, 1)} or a batch_size that is a multiple of "
                f"{max(micro, 1) * world_size}"
            )
        return cls(batch_size, micro, world_size, rank)

    def my_chunks(self) -> Iterator[tuple[int, int, int]]:
        """(chunk index in the global batch, start offset, length) of this rank's micro-batches."""
        for a in range(self.accum):
            chunk = self.rank * self.accum + a
            yield chunk, chunk * self.micro_batch_size, self.micro_batch_size


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The repeated blocks FSDP2 shards one by one (the model's ``_no_split_modules``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ConfigError(
            "distributed.strategy fsdp: cannot find the model's decoder layers "
            f"({type(base).__name__} declares no _no_split_modules)"
        )
    return layers


def grad_norm_value(norm: Any) -> float:
    """clip_grad_norm_ returns a DTensor under FSDP2; make it a float."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


def full_adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The complete trainable weights on CPU, on rank 0 only (a collective under FSDP2:
    call on every rank; the others get an empty dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state: dict[str, torch.Tensor] = get_model_state_dict(
        model,
        options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True),
    )  # type: ignore[assignment]
    return state
