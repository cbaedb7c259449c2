"""``train.compile``: the training forward and backward through ``torch.compile``.

The strategy's module is compiled once (inductor; AOTAutograd compiles its backward),
with dynamic shapes: one graph for every batch length, so an uninterrupted run and a
resumed one, which meet the lengths in another order, compute with the same kernels.
Compilation happens in :func:`warm_up`, before the first step of each process, on that
step's own first micro-batch; its gradients are dropped, nothing else is touched (each
micro-batch reseeds dropout), so the steps that follow are exactly those of the same
run without the warm-up. Its seconds are a ``compile`` event, never part of a step's
time. Eval and generation use the eager module.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from shoestring.config import ConfigError
from shoestring.train.config import TrainConfig


def check_compile(train: TrainConfig) -> None:
    if train.compile and train.loss_chunk_tokens:
        raise ConfigError(
            "train.compile: the chunked cross-entropy (train.loss_chunk_tokens) swaps the "
            "model's head inside each step, which a compiled graph does not follow; "
            "set train.loss_chunk_tokens 0 or train.compile false"
        )


def compile_module(module: torch.nn.Module) -> torch.nn.Module:
    """A compiled view of ``module`` (same parameters, same state-dict owner)."""
    compiled: torch.nn.Module = torch.compile(module, dynamic=True)  # type: ignore[assignment]
    return compiled


def warm_up(
    forward_backward: Callable[[], Any], zero_grad: Callable[[], None], eager: bool
) -> dict[str, Any]:
    """Run one forward and backward (which compiles both), drop its gradients; the
    ``compile`` event's fields. ``eager``: torch.compile handed the module back unchanged
    (TORCHDYNAMO_DISABLE=1), so nothing was compiled; the event says so."""
    t0 = time.perf_counter()
    forward_backward()
    zero_grad()
    return {
        "seconds": round(time.perf_counter() - t0, 3),
        "backend": "inductor",
        "dynamic": True,
        **({"eager": "torch.compile returned the module (TORCHDYNAMO_DISABLE)"} if eager else {}),
    }
