"""Per-rank memory of a multi-GPU run: DDP replicas, FSDP2 shards, and per-host RAM.

What FSDP2 (torch 2.13, ``torch/distributed/fsdp/_fully_shard``) allocates, as
``train/strategy.py`` uses it (``fully_shard`` on every decoder layer, then on the
root; no ``MixedPrecisionPolicy``):

* **Sharded parameters.** Each parameter is split on dim 0 into ``ceil(d0 / N)``-row
  chunks (``torch.chunk``); every rank allocates a full chunk, zero-padded when its
  rows run short (``padded_sharded_param_size``), so each rank holds
  ``ceil(d0 / N) * (numel / d0)`` elements of every parameter. An nf4 weight is its
  packed bytes viewed as a ``(packed / itemsize, 1)`` tensor of the compute dtype
  (``train/shard4bit.py``), sharded like any other.
* **Replicated.** The quant states (absmax, code tables) stay on their modules, whole,
  on every rank; buffers (the rotary tables) are not sharded.
* **Gradients** of the trainable parameters: one reduce-scatter output per group, the
  padded chunk of each (``foreach_reduce``). With gradient accumulation
  (``set_requires_gradient_sync(False)`` between micro-batches) the unsharded gradients
  are kept until the last micro-batch.
* **Optimizer state** (AdamW): ``zeros_like`` of the local shard, whose rows are the
  rank's own (not padded): ``min(c, max(0, d0 - rank * c))`` rows of chunk ``c``; the
  last ranks may hold fewer rows, rank 0 always a full chunk (the largest).
* **Gathered weights (transient).** The root group (embeddings, final norm, head) is not
  resharded after the forward (FSDP2's default for the root), so it is whole from the
  start of the forward to the end of the backward. A decoder layer is all-gathered into
  a flat buffer and copied out into its unsharded parameters; the forward prefetches the
  next layer implicitly and the backward explicitly (one layer ahead), and a flat buffer
  may live until the next layer's copy-out. Bounded here by two layers, each with its
  buffer (4x one layer's padded weights), plus one layer's gradients being
  reduce-scattered (the unsharded gradients and the reduce-scatter input). This bound is
  an assumption read from the source, not a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil, prod
from typing import Literal

from shoestring.config import ConfigError
from shoestring.plan.memory import Parallelism, Workload, adapter_bytes, weight_bytes

#: Who reads the base from disk in a multi-rank run: every rank (each loads the whole
#: base before it keeps its part: DDP, and FSDP2 with CPU offload), or rank 0 alone, the
#: others receiving their shards (DCP ``set_model_state_dict(..., broadcast_from_rank0)``).
Loader = Literal["every_rank", "rank0_broadcast"]


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as FSDP2 sees it: its shape, bytes per element, and whether it trains."""

    shape: tuple[int, ...]
    itemsize: int
    trainable: bool = False

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_numel(self) -> int:
        return prod(self.shape[1:])


def chunk_rows(rows: int, world_size: int) -> int:
    """Rows of every rank's (padded) chunk: ``torch.chunk``'s chunk size."""
    return ceil(rows / world_size)


def local_rows(rows: int, world_size: int, rank: int) -> int:
    """Rows that are ``rank``'s own (the rest of its chunk is padding)."""
    c = chunk_rows(rows, world_size)
    return min(c, max(0, rows - rank * c))


def padded_shard_bytes(p: ParamSpec, world_size: int) -> int:
    """Bytes one rank allocates for its shard of ``p`` (padding included)."""
    return chunk_rows(p.rows, world_size) * p.row_numel * p.itemsize


def padded_full_bytes(p: ParamSpec, world_size: int) -> int:
    """Bytes of ``p`` all-gathered (every rank's padded chunk)."""
    return world_size * padded_shard_bytes(p, world_size)


def _base_weight(w: Workload, din: int, dout: int) -> ParamSpec:
    """A linear's base weight as FSDP2 shards it (nf4: packed bytes in a float view)."""
    e = w.e
    if w.quant == "nf4":
        packed = (din * dout + 1) // 2
        if packed % e:
            raise ConfigError(
                f"distributed.strategy fsdp: a {din}x{dout} nf4 weight holds {packed} packed "
                f"bytes, not a multiple of {e} ({w.dtype}); shard4bit cannot shard it"
            )
        return ParamSpec((packed // e, 1), e)
    return ParamSpec((dout, din), e, trainable=w.method == "full")


def layer_params(w: Workload) -> list[ParamSpec]:
    """The parameters of one decoder layer (one FSDP2 group)."""
    a, e, full = w.arch, w.e, w.method == "full"
    out: list[ParamSpec] = []
    for name, (din, dout) in a.linear_shapes().items():
        out.append(_base_weight(w, din, dout))
        if a.linear_bias(name):
            out.append(ParamSpec((dout,), e, trainable=full))
        if name in w.adapted:  # PEFT's fp32 lora_A (r, in) and lora_B (out, r)
            out += [ParamSpec((w.lora_r, din), 4, True), ParamSpec((dout, w.lora_r), 4, True)]
    return out + [ParamSpec((a.hidden,), e, trainable=full)] * 2  # the two RMSNorms


def root_params(w: Workload) -> list[ParamSpec]:
    """The root group: embeddings, the final norm, and the head unless it is tied."""
    a, e, full = w.arch, w.e, w.method == "full"
    emb = ParamSpec((a.vocab, a.hidden), e, trainable=full)
    norm = ParamSpec((a.hidden,), e, trainable=full)
    return [emb, norm] + ([] if a.tie_embeddings else [emb])


def tower_params(w: Workload) -> list[ParamSpec]:
    """A vision tower's parameters (Gemma 3 4B+): frozen in the dtype, sharded with the
    rest, never gathered (text does not run it); its non-linear ones as one vector."""
    t, e = w.arch.tower, w.e
    if t is None:
        return []
    linears = [p for i, o in t.linears for p in (ParamSpec((o, i), e), ParamSpec((o,), e))]
    return linears + [ParamSpec((t.other,), e)]


def all_params(w: Workload) -> list[ParamSpec]:
    return layer_params(w) * w.arch.layers + root_params(w) + tower_params(w)


def _grad_itemsize(p: ParamSpec) -> int:
    return p.itemsize  # gradients take their parameter's dtype (fp32 LoRA, e for full)


def fsdp_static(w: Workload, world_size: int, rank: int = 0) -> dict[str, int]:
    """One rank's persistent bytes under FSDP2: sharded weights (and replicated buffers),
    replicated quant states, sharded adapters, gradients and AdamW state."""
    params = all_params(w)
    frozen = sum(padded_shard_bytes(p, world_size) for p in params if not p.trainable)
    trained = [p for p in params if p.trainable]
    shard = sum(padded_shard_bytes(p, world_size) for p in trained)
    wb = weight_bytes(w)
    lora = w.method != "full"
    optimizer = sum(
        2 * local_rows(p.rows, world_size, rank) * p.row_numel * p.itemsize + 4 for p in trained
    )
    return {
        "weights": frozen + (0 if lora else shard) + wb["buffers"],
        "quant_state": wb["quant_state"],
        "adapters": shard if lora else 0,
        "gradients": sum(
            chunk_rows(p.rows, world_size) * p.row_numel * _grad_itemsize(p) for p in trained
        ),
        "optimizer": optimizer,
    }


def fsdp_gathered(w: Workload, world_size: int, cpu_offload: bool = False) -> int:
    """Transient unsharded bytes at the step's peak (see the module docstring). With CPU
    offload, the two layers' shards are also copied to the device for their all-gathers."""
    layer = layer_params(w)
    root = sum(padded_full_bytes(p, world_size) for p in root_params(w))
    one_layer = sum(padded_full_bytes(p, world_size) for p in layer)
    layer_grads = sum(
        padded_full_bytes(p, world_size) // p.itemsize * _grad_itemsize(p)
        for p in layer
        if p.trainable
    )
    copies = 2 * sum(padded_shard_bytes(p, world_size) for p in layer) if cpu_offload else 0
    return root + 4 * one_layer + 2 * layer_grads + copies


def fsdp_host_offload(w: Workload, world_size: int) -> dict[str, int]:
    """What ``distributed.cpu_offload`` keeps in one rank's (pinned) host RAM."""
    s = fsdp_static(w, world_size)
    return {
        "sharded_weights": s["weights"] - weight_bytes(w)["buffers"] + s["adapters"],
        "sharded_gradients": s["gradients"],
        "sharded_optimizer": s["optimizer"],
    }


def fsdp_accumulated_grads(w: Workload) -> int:
    """Unsharded gradients FSDP2 keeps across the micro-batches of one step."""
    if w.grad_accum <= 1:
        return 0
    return sum(prod(p.shape) * _grad_itemsize(p) for p in all_params(w) if p.trainable)


def loader_for(strategy: Parallelism, cpu_offload: bool = False) -> Loader:
    """Who reads the base under ``strategy``: under FSDP2 rank 0 alone, which broadcasts
    each rank its shards (``train/onereader.py``; the others start on the meta device),
    except with ``distributed.cpu_offload``, where every rank still reads it; single and
    DDP ranks each hold a whole replica, so each reads."""
    return "rank0_broadcast" if strategy == "fsdp" and not cpu_offload else "every_rank"


@dataclass(frozen=True)
class HostRAM:
    """Host memory of one host: its ranks' bytes at the load's moment and while training."""

    ranks: int
    loader: Loader
    load_per_rank: dict[str, int]  # one reading rank at load: base, adapters, runtime, transient
    steady_per_rank: dict[str, int]  # one rank while training: runtime, offloaded tensors
    load_total: int
    steady_total: int

    @property
    def peak(self) -> int:
        return max(self.load_total, self.steady_total)


def host_ram(
    w: Workload,
    ranks: int,
    loader: Loader,
    reads_on_cpu: bool,
    runtime: int,
    load_transient: int,
    offloaded: dict[str, int],
) -> HostRAM:
    """Per-host RAM. ``reads_on_cpu``: the base is loaded into host memory before it goes
    to the GPU (FSDP); otherwise it loads onto the device (single, DDP) and the host holds
    the runtime alone. ``offloaded``: what one rank keeps in host RAM while training."""
    wb = weight_bytes(w)
    reader = (
        {
            "base": sum(wb.values()),
            "adapters": adapter_bytes(w),
            "load_transient": load_transient,
            "runtime": runtime,
        }
        if reads_on_cpu
        else {"runtime": runtime}
    )
    readers = ranks if loader == "every_rank" else 1
    steady = {"runtime": runtime, **offloaded}
    load_total = readers * sum(reader.values()) + (ranks - readers) * runtime
    return HostRAM(
        ranks=ranks,
        loader=loader,
        load_per_rank=reader,
        steady_per_rank=steady,
        load_total=load_total,
        steady_total=ranks * sum(steady.values()),
    )
