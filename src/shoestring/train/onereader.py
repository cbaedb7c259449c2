"""One reader of the base per job under FSDP2 (issue 27 item 2).

Rank 0 loads the base as every rank used to (from the quantized-base cache, or read and
quantized). The other ranks build the same model on the meta device
(:func:`shoestring.train.model.empty_base_model`), apply LoRA and ``fully_shard`` it
exactly as rank 0 does, and receive their shards: a non-reader never holds more than its
shards plus the one full tensor in flight, so host RAM is one model per job, not one per
rank. Three things travel from the reader, each by torch's or bitsandbytes' own means:

1. **Quant states** (nf4), before LoRA (peft sizes and types the adapters from the base
   layer, so the packed weight must already look as on rank 0): neither parameters nor
   buffers, they go per ``Linear4bit`` in bitsandbytes' own serialization
   (``QuantState.as_dict(packed=True)`` -> ``QuantState.from_dict``), with the packed
   weight's shape and dtype, in one ``broadcast_object_list`` each.
2. **The weights**, after ``fully_shard``: ``set_model_state_dict(model, full,
   StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))`` with rank 0's
   full state (parameters and persistent buffers, the packed nf4 bytes in their float
   view among them) and an empty dict elsewhere. torch broadcasts one tensor at a time;
   each rank copies its slice into its (``to_empty``-allocated) shard and frees the rest.
3. **Non-persistent buffers** (the rotary ``inv_freq``): in no state dict, and garbage
   after ``to_empty``; broadcast as they are.

Before the weights move, the reader's names, shapes and dtypes are compared with every
rank's model (``set_model_state_dict`` would otherwise cast silently): a difference is an
error on every rank, not a hang or a quietly different model.

``broadcast_from_rank0`` knows only global rank 0, so one reader serves the whole job
(several nodes too: at most one model per host). A reader per node would cut the
cross-node traffic to one copy per node; it needs per-node groups and its own
broadcast-then-slice loop and is not built.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

#: The rank that reads the base (``broadcast_from_rank0`` knows no other).
READER = 0

Agree = Callable[[bool], bool]  # whether every rank says ok (a collective)
Spec = dict[str, tuple[tuple[int, ...], str, int]]  # name -> shape, dtype, bytes


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (0 where the OS does not say)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return 0
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def _quant_message(module: Any) -> dict[str, Any]:
    weight = module.weight
    state = weight.quant_state.as_dict(packed=True)
    return {
        "shape": tuple(weight.shape),
        "dtype": weight.dtype,
        "state": {k: v.cpu() for k, v in state.items()},
    }


def _set_quantized(module: Any, msg: dict[str, Any]) -> None:
    """``module``'s weight as the reader holds it: packed bytes (on meta) and quant state."""
    from bitsandbytes.functional import QuantState
    from bitsandbytes.nn.modules import Params4bit

    state = QuantState.from_dict(dict(msg["state"]), device=torch.device("cpu"))
    module.weight = Params4bit(
        torch.empty(msg["shape"], dtype=msg["dtype"], device="meta"),
        requires_grad=False,
        quant_state=state,
        blocksize=state.blocksize,
        compress_statistics=state.nested,
        quant_type=state.quant_type,
        quant_storage=msg["dtype"],
        module=module,
        bnb_quantized=True,
    )
    module.quant_state = state


def share_quant_states(model: torch.nn.Module, agree: Agree) -> int:
    """A collective: the reader sends each ``Linear4bit``'s quant state and packed-weight
    shape; the others set them on their meta model. Returns the bytes of quant state."""
    import torch.distributed as dist

    from shoestring.train.shard4bit import linear4bit_modules

    here = dist.get_rank() == READER
    modules = linear4bit_modules(model)
    names = _from_reader([n for n, _ in modules] if here else None)
    _agreed(names == [n for n, _ in modules], agree, "its 4-bit layers", names)
    moved = 0
    for _, module in modules:
        msg = _from_reader(_quant_message(module) if here else None)
        moved += sum(_nbytes(t) for t in msg["state"].values())
        if not here:
            _set_quantized(module, msg)
    return moved


def _from_reader(obj: Any) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=READER)
    return box[0]


def _agreed(ok: bool, agree: Agree, what: str, detail: Any) -> None:
    if not agree(ok):
        raise RuntimeError(
            f"distributed.strategy fsdp: the model a rank built on the meta device differs "
            f"from the one rank {READER} read in {what}"
            + ("" if ok else f" (rank {READER}: {str(detail)[:300]})")
        )


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What ``set_model_state_dict`` fills: parameters and persistent buffers by name, no
    copies (bitsandbytes' extra quant-state entries of ``state_dict()`` left out)."""
    kept = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    kept |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    return {k: v for k, v in model.state_dict().items() if k in kept}


def _spec(state: dict[str, torch.Tensor]) -> Spec:
    return {k: (tuple(v.shape), str(v.dtype), _nbytes(v)) for k, v in state.items()}


def _non_persistent_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """Buffers no state dict carries (the rotary ``inv_freq``), in module order."""
    found = []
    for module in model.modules():
        skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
        found += [b for n, b in module.named_buffers(recurse=False) if n in skip]
    return found


def held_bytes(model: torch.nn.Module) -> int:
    """What this rank keeps of the model: its parameter shards, buffers, quant states."""
    from shoestring.train.shard4bit import linear4bit_modules

    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += _nbytes(local)
    total += sum(_nbytes(b) for b in model.buffers())
    for _, m in linear4bit_modules(model):
        state: Any = m.quant_state
        total += sum(_nbytes(t) for t in state.as_dict(packed=True).values())
    return total


@dataclass
class SharedBase:
    """The weights on their way from the reader, across ``fully_shard``: captured before
    (:meth:`capture`: the reader's full state, checked against every rank's model), sent
    after (:meth:`fill`)."""

    full: dict[str, torch.Tensor]  # the reader's; {} elsewhere
    spec: Spec
    fields: dict[str, Any] = field(default_factory=dict)  # the ``load`` event's, after fill

    @classmethod
    def capture(cls, model: torch.nn.Module, agree: Agree) -> SharedBase:
        """Before ``fully_shard`` (a collective)."""
        import torch.distributed as dist

        full = full_state(model) if dist.get_rank() == READER else {}
        spec = _from_reader(_spec(full) if full else None)
        mine = _spec(full_state(model))
        wrong = sorted(k for k in spec.keys() | mine.keys() if spec.get(k) != mine.get(k))
        where = {k: (spec.get(k), mine.get(k)) for k in wrong[:3]}
        _agreed(not wrong, agree, "names, shapes or dtypes", where)
        return cls(full, spec)

    def fill(self, model: torch.nn.Module, device: torch.device) -> dict[str, Any]:
        """After ``fully_shard`` (a collective): every rank's shards hold the reader's
        weights. Returns the ``load`` event's fields."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        t0 = time.perf_counter()
        here = dist.get_rank() == READER
        if not here:
            model.to_empty(device=device)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, dict(self.full), options=options)
        self.full = {}  # the reader's full copy goes now
        buffers = _non_persistent_buffers(model)
        for b in buffers:
            dist.broadcast(b, src=READER)
        moved = sum(n for _, _, n in self.spec.values()) + sum(_nbytes(b) for b in buffers)
        self.fields = {
            "base_readers": [READER],
            "received_bytes": 0 if here else moved,
            "kept_bytes": held_bytes(model),
            "share_s": round(time.perf_counter() - t0, 3),
            "peak_rss_bytes": peak_rss_bytes(),
        }
        return self.fields
