"""Ground truth for the planner, measured on instantiated models (CPU is enough).

These are the yardsticks the memory model is tested against, and what
``benchmarks/plan_vs_cuda.py`` reports beside ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


def _state_tensors(state: Any) -> Iterator[torch.Tensor]:
    """A bitsandbytes QuantState's tensors, its nested (double-quantization) state's too."""
    for s in (state, getattr(state, "state2", None)):
        if s is None:
            continue
        for name in ("absmax", "code", "offset"):
            v = getattr(s, name, None)
            if torch.is_tensor(v):
                yield v


def _quant_tensors(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """Tensors bitsandbytes keeps beside a quantized weight (not parameters or buffers),
    and NF4 expert stacks (``shoestring.train.nf4experts``: kept outside the parameters)."""
    for m in module.modules():
        for stack in getattr(m, "nf4_stacks", {}).values():
            yield stack.packed
            for state in stack.states:
                yield from _state_tensors(state)
        w = getattr(m, "weight", None)
        qs = getattr(w, "quant_state", None)
        if qs is not None:
            yield from _state_tensors(qs)
        # LLM.int8: the row scales live on the weight until the first forward, then
        # move to the module's MatmulLtState (CB there is the weight's own storage).
        for holder in (w, getattr(m, "state", None)):
            for name in ("SCB", "CB"):
                v = getattr(holder, name, None)
                if torch.is_tensor(v):
                    yield v


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def model_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of distinct storages: frozen weights + quantization state, and trainable params."""
    seen: set[tuple[int, int]] = set()
    out = {"frozen": 0, "quant_state": 0, "trainable": 0}

    def count(t: torch.Tensor, key: str) -> None:
        k = _storage_key(t)
        if k not in seen and k[1] > 0:
            seen.add(k)
            out[key] += k[1]

    for p in model.parameters():
        count(p, "trainable" if p.requires_grad else "frozen")
    for b in model.buffers():
        count(b, "frozen")
    for m in model.modules():  # NF4 experts' packed weights: the weights, as Linear4bit's
        for stack in getattr(m, "nf4_stacks", {}).values():
            count(stack.packed, "frozen")
    for q in _quant_tensors(model):
        count(q, "quant_state")
    return out


def grad_bytes(model: torch.nn.Module) -> int:
    return sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Distinct tensor storages in the optimizer state (shared tables counted once)."""
    seen: set[tuple[int, int]] = set()

    def walk(v: Any) -> None:
        if torch.is_tensor(v):
            seen.add(_storage_key(v))
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)

    for st in optimizer.state.values():
        walk(st)
    return sum(n for _, n in seen)


@contextmanager
def saved_tensors(model: torch.nn.Module) -> Iterator[dict[tuple[int, int], int]]:
    """Record the distinct storages autograd saves for backward inside the block.

    Parameters, buffers and quantization state are excluded (they are weights,
    not activations); a storage saved by several ops counts once. Yields the
    ``{storage key: bytes}`` dict, filled as the forward pass runs.
    """
    exclude = {
        _storage_key(t) for t in [*model.parameters(), *model.buffers(), *_quant_tensors(model)]
    }
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        k = _storage_key(t)
        if k not in exclude:
            seen[k] = k[1]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


def saved_activation_bytes(model: torch.nn.Module, forward: Callable[[], Any]) -> int:
    """Bytes saved for backward by ``forward()`` (the returned output is discarded after)."""
    with saved_tensors(model) as seen:
        out = forward()
    total = sum(seen.values())
    del out
    return total


class _LiveTensors(TorchDispatchMode):
    """Every storage an op creates inside the mode, alive until its last tensor dies;
    the peak of their bytes. What existed before (weights) is not counted."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.refs: dict[tuple[int, int], int] = {}
        self.live = self.peak = 0
        self.known: set[tuple[int, int]] = set()

    def _dropped(self, key: tuple[int, int]) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= key[1]

    def _track(self, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key in self.known:
            return
        if key not in self.refs:
            self.refs[key] = 0
            self.live += key[1]
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        weakref.finalize(t, self._dropped, key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
                self._track(t)
        return out


def peak_live_bytes(model: torch.nn.Module, step: Callable[[], Any]) -> int:
    """The peak of the bytes of tensors ``step()`` (a forward and backward) creates and
    holds at once: saved activations, logits and the backward's transients, gradients;
    not the weights, buffers and quantization state that existed before."""
    mode = _LiveTensors()
    mode.known = {
        _storage_key(t) for t in [*model.parameters(), *model.buffers(), *_quant_tensors(model)]
    }
    with mode:
        step()
    return mode.peak
