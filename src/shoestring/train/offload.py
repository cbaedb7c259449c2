"""Activation offload (``train.offload_activations``): what autograd saves for backward
lives in host memory between a micro-batch's forward and its backward.

This is torch's ``torch.autograd.graph.save_on_cpu`` mechanism — saved-tensor hooks
that copy each saved tensor to (pinned, on CUDA) host memory in forward and back to
the device when backward needs it — with two differences that keep its cost to the
activations the planner counts (``shoestring plan`` moves its "activations saved for
backward" term from device to host memory):

* weights are left where they are: ``save_on_cpu`` would copy every frozen weight a
  matmul saves (the whole base model, once per micro-batch) to the host and back;
* a storage several ops save (one input shared by q/k/v, views of one buffer) is
  copied once, whole, and restored once while any backward node still uses it.

Inside ``torch.utils.checkpoint`` regions the checkpoint's own hooks take precedence:
their inputs are offloaded, their recomputed tensors stay on the device, as they
should (they live for one layer's backward). On the CPU nothing needs to move: the
hooks only count what passes (``tensors``, ``bytes``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

StorageKey = tuple[int, int]


def _key(st: torch.UntypedStorage) -> StorageKey:
    return st.data_ptr(), st.nbytes()


def _storages(tensors: Iterable[torch.Tensor]) -> set[StorageKey]:
    """Storage keys of ``tensors``; a sharded (DTensor) weight by its local shard."""
    out = set()
    for t in tensors:
        local = getattr(t, "_local_tensor", t)
        if isinstance(local, torch.Tensor) and local.layout == torch.strided:
            out.add(_key(local.untyped_storage()))
    return out


@dataclass
class _Stored:
    """One saved storage: the original (weakly, to tell a reused address from the same
    storage) at a version (an in-place write since means a new copy), its host copy, and
    the device copy restored in backward while in use."""

    original: weakref.ref[torch.UntypedStorage]
    version: int
    host: torch.Tensor | None  # uint8, the whole storage; None: not copied (CPU)
    restored: weakref.ref[torch.UntypedStorage] | None = None


@dataclass(frozen=True)
class _Packed:
    stored: _Stored
    offset: int
    size: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks for one micro-batch's forward and backward on ``device``.
    ``copy`` (default: on any device but the CPU) moves the bytes; without it the
    hooks only count them. Use one instance per micro-batch."""

    def __init__(self, model: torch.nn.Module, device: torch.device, copy: bool | None = None):
        self.device = device
        self.copy = device.type != "cpu" if copy is None else copy
        self.pin = device.type == "cuda"
        self.tensors = 0  # saved tensors the hooks took
        self.bytes = 0  # their distinct storages: what the device no longer holds
        self._weights = _storages((*model.parameters(), *model.buffers()))
        self._stored: dict[StorageKey, _Stored] = {}
        super().__init__(self._pack, self._unpack)

    def _is_weight(self, t: torch.Tensor) -> bool:
        base = t._base if t._base is not None else t
        return isinstance(base, torch.nn.Parameter) or _key(t.untyped_storage()) in self._weights

    def _takes(self, t: torch.Tensor) -> bool:
        return (
            type(t) is torch.Tensor  # no subclasses (DTensor, parameters)
            and t.layout == torch.strided
            and t.device.type == self.device.type
            and t.untyped_storage().nbytes() > 0
            and not self._is_weight(t)
        )

    def _store(self, t: torch.Tensor) -> _Stored:
        st = t.untyped_storage()
        stored = self._stored.get(_key(st))
        if stored is not None and stored.original() is st and stored.version == t._version:
            return stored
        host = None
        if self.copy:
            src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)
            host = torch.empty(src.shape, dtype=torch.uint8, pin_memory=self.pin)
            host.copy_(src, non_blocking=self.pin)
        stored = _Stored(weakref.ref(st), t._version, host)
        self.bytes += st.nbytes()
        self._stored[_key(st)] = stored  # a dead storage at the same address is replaced
        return stored

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._takes(t):
            return t
        self.tensors += 1
        stored = self._store(t)
        if stored.host is None:
            return t
        return _Packed(stored, int(t.storage_offset()), t.size(), t.stride(), t.dtype, t.device)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed  # type: ignore[no-any-return]
        s = packed.stored
        st = s.restored() if s.restored is not None else None
        if st is None:
            assert s.host is not None
            st = s.host.to(packed.device, non_blocking=self.pin).untyped_storage()
            s.restored = weakref.ref(st)
        out = torch.empty(0, dtype=packed.dtype, device=packed.device)
        return out.set_(st, packed.offset, packed.size, packed.stride)
