"""Is everything a step touches on the strategy's device?

Checked once, after the first optimizer step (when the optimizer state exists):
every parameter and buffer of the model, every optimizer state tensor and the
last batch. A tensor left behind on the host would make a GPU run silently
slow (or fail deep inside a kernel); the trainer stops with this list instead.
bitsandbytes keeps its 4-bit quantization constants with each weight, so they
are checked as buffers/attributes of the weight's module.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch


def _same(device: torch.device, t: torch.Tensor) -> bool:
    if t.device.type != device.type:
        return False
    return device.index is None or t.device.index in (None, device.index)


def _state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[tuple[str, torch.Tensor]]:
    for i, st in enumerate(optimizer.state.values()):
        for k, v in st.items():
            # bitsandbytes nests its 8-bit state one level down
            items = v.items() if isinstance(v, Mapping) else [(None, v)]
            for k2, v2 in items:
                if torch.is_tensor(v2) and v2.dim() > 0:  # 0-dim 'step' counters may stay on host
                    yield f"optimizer.state[{i}].{k}" + (f".{k2}" if k2 else ""), v2


def _quant_states(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """bitsandbytes' 4-bit absmax/code tensors, which are neither parameters nor buffers:
    on each weight, and on its module (where FSDP2-sharded 4-bit layers keep them)."""
    owners: list[tuple[str, Any]] = [*model.named_parameters(), *model.named_modules()]
    for name, p in owners:
        qs = getattr(p, "quant_state", None)
        if qs is None:
            continue
        for attr in ("absmax", "code"):
            t = getattr(qs, attr, None)
            if torch.is_tensor(t):
                yield f"{name}.quant_state.{attr}", t


def misplaced(
    device: torch.device,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Mapping[str, Any] | None = None,
    host_state: bool = False,
) -> list[str]:
    """Names (with their device) of tensors not on ``device``; empty when all are.
    ``host_state``: parameters and optimizer state live on the host by design (FSDP2
    CPU offload); only buffers, quant states and the batch are checked."""
    named: list[tuple[str, torch.Tensor]] = [
        *([] if host_state else model.named_parameters()),
        *model.named_buffers(),
        *_quant_states(model),
        *([] if host_state else _state_tensors(optimizer)),
    ]
    named += [(f"batch.{k}", v) for k, v in (batch or {}).items() if torch.is_tensor(v)]
    return [f"{n} on {t.device}" for n, t in named if not _same(device, t)]
