"""Weights stored quantized, grouped by the engine unit they stream in: what the
formats of :mod:`.stored` share (each weight's shape, and a unit's weights once
dequantized). Each format adds how its weights are found, checked and rebuilt."""

from __future__ import annotations

import math
from typing import Generic, Protocol, TypeVar

import torch


class Shaped(Protocol):
    @property
    def shape(self) -> tuple[int, ...]: ...


W = TypeVar("W", bound=Shaped)


class ByUnit(Generic[W]):
    """``weights[i]``: unit ``i``'s stored weights, model key -> the format's record."""

    def __init__(self, weights: dict[int, dict[str, W]]) -> None:
        self.weights = weights

    def shapes(self, i: int) -> dict[str, tuple[int, ...]]:
        """Unit ``i``'s stored-quantized weights: model key -> shape."""
        return {k: w.shape for k, w in self.weights.get(i, {}).items()}

    def kept(self, i: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """What unit ``i``'s hook makes in a dtype of its own, not the compute dtype."""
        return {}

    def scratch(self, i: int, dtype: torch.dtype) -> int:
        """Bytes of unit ``i``'s weights dequantized into ``dtype``."""
        return sum(dtype.itemsize * math.prod(w.shape) for w in self.weights.get(i, {}).values())
