"""Data-parallel (DDP) and sharded (FSDP2) wrapping of the LoRA model, and the global batch.

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

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

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
    def make(cls, batch_size: int, micro_batch_size: int, world_size: int,
             rank: int) -> "BatchPlan":
        micro = micro_batch_size or batch_size // world_size
        if micro <= 0 or batch_size % (micro * world_size):
            raise ConfigError(
                f"train.batch_size {batch_size} (the global batch) must be a multiple of "
                f"train.micro_batch_size ({micro_batch_size or 'auto'} -> {micro}) x world size "
                f"{world_size}; choose a micro_batch_size that divides "
                f"{batch_size // max(world_size, 1)} or a batch_size that is a multiple of "
                f"{max(micro, 1) * world_size}")
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
        raise ConfigError("distributed.strategy fsdp: cannot find the model's decoder layers "
                          f"({type(base).__name__} declares no _no_split_modules)")
    return layers


def wrap(model: Any, strategy: str, device: torch.device) -> torch.nn.Module:
    """DDP-wrap or FSDP2-shard ``model`` in place; returns the module to call."""
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        # Decoder LMs have no running-stat buffers (rotary tables are constants), so
        # skip DDP's per-forward buffer broadcast: one collective less per micro-batch.
        return DDP(model, device_ids=ids, forward_sync_buffers=False)
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
        return model  # type: ignore[no-any-return]  # fully_shard swapped its class in place
    raise ConfigError(f"distributed.strategy: unknown strategy {strategy!r} (ddp|fsdp)")


@contextlib.contextmanager
def grad_sync(wrapped: torch.nn.Module, strategy: str | None, sync: bool) -> Iterator[None]:
    """Skip the gradient all-reduce on all but the last micro-batch of a step."""
    if sync or strategy is None:
        yield
    elif strategy == "ddp":
        with wrapped.no_sync():  # type: ignore[operator]
            yield
    else:
        wrapped.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            wrapped.set_requires_gradient_sync(True)  # type: ignore[operator]


def grad_norm_value(norm: Any) -> float:
    """clip_grad_norm_ returns a DTensor under FSDP2; make it a float."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


def full_adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The complete trainable weights on CPU, on rank 0 only (a collective under FSDP2:
    call on every rank; the others get an empty dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True, ignore_frozen_params=True))
