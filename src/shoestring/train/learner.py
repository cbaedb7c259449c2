"""The learner: the model and everything a step changes and a checkpoint holds."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shoestring.train.config import TrainConfig
from shoestring.train.model import build_optimizer, trainable_parameters


def lr_lambda(warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """Linear warm-up, then cosine decay to ``min_ratio`` of the peak."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


@dataclass
class Learner:
    """``model`` is the PEFT model; ``wrapped`` is what the strategy made of it (the
    same object for one process and FSDP2, a DDP wrapper under DDP). ``params`` are
    the trainable tensors, collected after wrapping (FSDP2 makes them DTensor shards)."""

    model: Any
    wrapped: torch.nn.Module
    params: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler | None

    @property
    def param_names(self) -> list[str]:
        return list(self.params)

    @classmethod
    def build(
        cls,
        model: Any,
        wrapped: torch.nn.Module,
        cfg: TrainConfig,
        scaler: torch.amp.GradScaler | None,
    ) -> Learner:
        params = trainable_parameters(model)
        optimizer = build_optimizer(list(params.values()), cfg.optimizer, cfg.lr, cfg.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda(cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
        )
        return cls(model, wrapped, params, optimizer, scheduler, scaler)

    def apply_gradients(self, max_grad_norm: float, clip: Callable[[Any], float]) -> float:
        """Unscale (fp16), clip, step, zero and advance the schedule; returns the norm."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norm = 0.0
        if max_grad_norm > 0:
            norm = clip(torch.nn.utils.clip_grad_norm_(list(self.params.values()), max_grad_norm))
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return norm

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()
