"""Read-ahead of layer weights into a ring of reused buffers, plus a fixed resident set.

A pass visits the streamed units in the same cyclic order every time (embed,
layer 0 .. L-1, head), so the reader thread can run ``depth`` units ahead
forever and never guess: the consumer takes them in exactly that order. Units
chosen as *resident* are read once into their own buffers and never again —
for a cyclic scan, a fixed pinned set beats LRU, which gets no hits at all.

On CUDA each slot is a pinned host buffer plus a device buffer; the reader
thread issues the host-to-device copy on its own stream and the consumer waits
on that copy's event, so disk reads, PCIe copies and compute all overlap.

Where ``prepare`` runs (:data:`PrepareAt`): ``"ahead"``, in the reader thread into
each slot's own scratch, so preparation overlaps compute too, at the cost of every
slot holding a unit's prepared tensors beside its raw bytes; or ``"on_compute"``, in
the consumer just before compute into one scratch set shared by the whole ring
(the slots hold raw bytes only): a compressed unit's dequantized weights are then
held once, not ``depth + 1`` times. The same ``prepare`` runs on the same bytes
either way, so the tensors are the same to the bit.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from shoestring.infer.shards import ReadPlan, ShardReader, aligned_empty, views

#: Turns the raw views of a unit into the tensors its modules use (dequantize,
#: merge an adapter). Runs in the reader thread, so it overlaps compute too.
Prepare = Callable[[int, dict[str, torch.Tensor], "Slot"], dict[str, torch.Tensor]]

#: Where ``prepare`` runs: in the reader thread into each ring slot's scratch
#: ("ahead"), or in the consumer just before compute into one shared scratch set
#: ("on_compute"; see the module docstring).
PrepareAt = Literal["ahead", "on_compute"]


def _as_read(i: int, tensors: dict[str, torch.Tensor], slot: Slot) -> dict[str, torch.Tensor]:
    return tensors


@dataclass
class Slot:
    """One reusable buffer set: raw bytes (host), its device copy, scratch for ``prepare``."""

    host: torch.Tensor
    device: torch.Tensor | None = None
    scratch: dict[str, torch.Tensor] = field(default_factory=dict)
    ready: torch.cuda.Event | None = None  # the device copy is done
    freed: torch.cuda.Event | None = None  # compute no longer reads the device buffer

    def buffer(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Scratch buffer ``name`` of this shape and dtype: the one kept from the last unit
        that used it, or a new one (kept for the next)."""
        buf = self.scratch.get(name)
        if buf is None or tuple(buf.shape) != tuple(shape) or buf.dtype != dtype:
            buf = self.scratch[name] = torch.empty(shape, dtype=dtype, device=device)
        return buf


class LayerStreamer:
    """Serves unit tensors in cyclic order; reads ahead ``depth`` streamed units."""

    def __init__(
        self,
        plans: list[ReadPlan],
        resident: set[int],
        *,
        depth: int,
        device: torch.device,
        prepare: Prepare,
        direct_io: bool = True,
        drop_raw: set[int] | None = None,
        prepare_at: PrepareAt = "ahead",
    ) -> None:
        self.plans = plans
        self.device = device
        self.cuda = device.type == "cuda"
        self.prepare = prepare
        self.prepare_at = prepare_at
        # "on_compute": the one scratch set every streamed unit is prepared into.
        self._shared = Slot(torch.empty(0, dtype=torch.uint8))
        self.prepare_s = 0.0  # consumer time spent preparing units ("on_compute")
        self.reader = ShardReader(direct=direct_io)
        self.order = [i for i in range(len(plans)) if i not in resident]
        self.wait_s = 0.0  # consumer time blocked on the reader (I/O not hidden)
        self._resident: dict[int, dict[str, torch.Tensor]] = {}
        for i in sorted(resident):
            slot = self._new_slot(plans[i].nbytes)
            self._resident[i] = self._load(i, slot)
            if drop_raw and i in drop_raw:  # all in scratch: the raw bytes are not needed
                raw = slot.host.untyped_storage().data_ptr()
                if any(t.untyped_storage().data_ptr() == raw for t in self._resident[i].values()):
                    raise RuntimeError(f"unit {i}: prepared tensors still use its raw buffer")
                slot.host = torch.empty(0, dtype=torch.uint8)
        self.resident_bytes = sum(plans[i].nbytes for i in resident)
        self.streamed_bytes = sum(plans[i].read_bytes for i in self.order)
        # Bytes of the streamed units handed to compute: what the passes so far read,
        # without the read-ahead still in the ring (``reader.bytes_read`` includes it).
        self.served_bytes = 0
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._free: queue.Queue[Slot] = queue.Queue()
        self._ready: queue.Queue[tuple[int, Slot, dict[str, torch.Tensor]]] = queue.Queue()
        self._cursor = 0
        self._inflight: dict[int, Slot] = {}
        # The read-ahead ring: none when every unit is resident.
        self.slot_bytes = max((plans[i].nbytes for i in self.order), default=0)
        self.slots = min(depth, len(self.order)) + 1 if self.order else 0
        if self.order:
            for _ in range(self.slots):
                self._free.put(self._new_slot(self.slot_bytes))
            self._thread = threading.Thread(target=self._run, name="layer-reader", daemon=True)
            self._thread.start()

    def _new_slot(self, nbytes: int) -> Slot:
        slot = Slot(aligned_empty(nbytes, pin=self.cuda))
        if self.cuda:
            slot.device = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        return slot

    def _load(
        self, i: int, slot: Slot, stream: torch.cuda.Stream | None = None, prepare: bool = True
    ) -> dict[str, torch.Tensor]:
        """Read unit ``i`` into ``slot`` (and copy it to the device), then prepare it into
        the slot's scratch, or not (``prepare`` False: the raw views)."""
        plan = self.plans[i]
        run = self.prepare if prepare else _as_read
        if self.cuda and slot.ready is not None:
            slot.ready.synchronize()  # the last copy out of host is done
        self.reader.read(plan, slot.host)
        buf = slot.host
        if self.cuda:
            assert slot.device is not None  # every CUDA slot has its device buffer
            if slot.freed is not None and stream is not None:
                stream.wait_event(slot.freed)
            with torch.cuda.stream(stream):
                slot.device.copy_(slot.host, non_blocking=True)
                buf = slot.device
                tensors = run(i, views(plan, buf), slot)
                slot.ready = torch.cuda.Event()
                slot.ready.record(stream)
            return tensors
        return run(i, views(plan, buf), slot)

    def _run(self) -> None:
        stream = torch.cuda.Stream(self.device) if self.cuda else None
        k, ahead = 0, self.prepare_at == "ahead"
        try:
            while not self._stop.is_set():
                slot = self._free.get()
                if self._stop.is_set():
                    return
                i = self.order[k % len(self.order)]
                self._ready.put((i, slot, self._load(i, slot, stream, ahead)))
                k += 1
        except BaseException as e:  # surfaced to the consumer in acquire()
            self._error = e
            self._ready.put((-1, Slot(torch.empty(0)), {}))

    def acquire(self, i: int) -> dict[str, torch.Tensor]:
        """The tensors of unit ``i``; blocks until read. Units must come in cyclic order."""
        if i in self._resident:
            return self._resident[i]
        t0 = time.perf_counter()
        j, slot, tensors = self._ready.get()
        self.wait_s += time.perf_counter() - t0
        if self._error is not None:
            raise self._error
        expect = self.order[self._cursor % len(self.order)]
        if j != i or i != expect:
            raise RuntimeError(f"layer streamer out of order: asked for {i}, read {j}")
        self._cursor += 1
        self.served_bytes += self.plans[i].read_bytes
        if self.cuda and slot.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(slot.ready)
        self._inflight[i] = slot
        if self.prepare_at == "on_compute":
            return self._prepare_now(i, tensors)
        return tensors

    def _prepare_now(self, i: int, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Prepare unit ``i`` into the shared scratch (on CUDA: on the current stream,
        after the wait on its copy's event, so before compute and before ``release``
        records that the slot's device buffer is free). The unit prepared before it is
        released by then: one unit is prepared at a time."""
        t0 = time.perf_counter()
        tensors = self.prepare(i, raw, self._shared)
        self.prepare_s += time.perf_counter() - t0
        return tensors

    def release(self, i: int) -> None:
        slot = self._inflight.pop(i, None)
        if slot is None:
            return
        if self.cuda:
            slot.freed = torch.cuda.Event()
            slot.freed.record(torch.cuda.current_stream(self.device))
        self._free.put(slot)

    def close(self) -> None:
        self._stop.set()
        if self.order:
            self._free.put(Slot(torch.empty(0)))
            self._thread.join(timeout=30)
        self.reader.close()
