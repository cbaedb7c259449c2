"""The plan: memory breakdown, fit verdict, largest batch/sequence, advice, time and cost."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from shoestring.gpus import CATALOG, GPU, GiB, MiB
from shoestring.plan.arch import CHECKED_FAMILIES
from shoestring.plan.memory import (
    Workload,
    activation_bytes,
    adapter_bytes,
    grad_bytes,
    load_transient_bytes,
    optimizer_bytes,
    weight_bytes,
)
from shoestring.plan.sharding import (
    HostRAM,
    fsdp_accumulated_grads,
    fsdp_gathered,
    fsdp_host_offload,
    fsdp_static,
    host_ram,
    loader_for,
)

#: CUDA context + cuBLAS workspace outside ``max_memory_allocated`` (seen as
#: 300-600 MiB in the research notes; uncalibrated until benchmarks/plan_vs_cuda.py runs).
CUDA_CONTEXT_BYTES = 500 * MiB
#: cuBLAS workspace, which torch takes from its caching allocator (so it is inside
#: ``max_memory_allocated``) for the stream that runs the matmuls: 32 MiB is torch's
#: default on sm90 (H100/H200); older GPUs get 8 MiB + 128 KiB, so this is an upper
#: bound there (the H200 check behind it: docs/planner.md).
CUBLAS_WORKSPACE_BYTES = 32 * MiB
#: A CPU run's own code and data beyond its tensors (python, torch, transformers, peft,
#: bitsandbytes, tokenizer, data cache, threads): a 7B QLoRA's peak anonymous RSS less
#: the plan's tensors (the measurement: docs/planner.md; ``benchmarks/scale.py`` checks
#: it on other shapes).
CPU_RUNTIME_BYTES = 448 * MiB
#: Allocator fragmentation allowance on the dynamic (activation) part.
FRAGMENTATION = 0.05
#: Model FLOPs utilization assumed per method (uncalibrated). QLoRA's 1.6x
#: slowdown over LoRA is litgpt's measurement (nf4-dq vs LoRA, A100).
MFU = {"full": 0.40, "lora": 0.35, "qlora": 0.35 / 1.6}
#: The ``train.loss_chunk_tokens`` the advice proposes.
ADVISED_CHUNK = 512


@dataclass(frozen=True)
class Schedule:
    """How much training, for the time and cost estimate."""

    steps: int = 1000
    restart_minutes: float = 5.0  # re-provision + reload after a preemption
    checkpoint_minutes: float = 10.0  # work lost per preemption is half of this on average


@dataclass(frozen=True)
class Plan:
    workload: Workload
    gpu: GPU
    breakdown: dict[str, int]
    activation_parts: dict[str, int]
    peak_bytes: int
    fits: bool
    max_micro_batch: int | None
    max_seq_len: int | None
    advice: list[dict[str, Any]]
    tokens: int
    flops_per_token: float
    hours: float | None  # None: not estimated (a CPU run)
    hours_spot: float | None
    cost_usd: float | None
    cost_spot_usd: float | None
    notes: tuple[str, ...] = ()
    #: Bytes in host RAM instead of device memory (``train.offload_activations`` on a
    #: GPU): not part of ``peak_bytes``, which is the device's.
    host_bytes: dict[str, int] = field(default_factory=dict)
    #: Several ranks: one host's RAM (its ranks at the load and while training).
    host_ram: HostRAM | None = None
    #: Several ranks: whether the per-rank peak fits each GPU of the catalog.
    catalog_fits: dict[str, bool] = field(default_factory=dict)

    @property
    def headroom_bytes(self) -> int:
        return self.gpu.memory_bytes - self.peak_bytes

    @property
    def on_cpu(self) -> bool:
        """A CPU run: ``gpu`` is the host's RAM (:func:`host_target`), not a catalog GPU."""
        return self.workload.device == "cpu"


def host_target(memory_bytes: int, source: str) -> GPU:
    """Host RAM as the memory a CPU run must fit in; it has no FLOPs or prices here."""
    return GPU(
        name=f"host RAM ({source})",
        memory_bytes=memory_bytes,
        bf16_flops=0.0,
        fp16_flops=0.0,
        on_demand_usd_h=0.0,
        spot_usd_h=0.0,
        price_source="",
        price_date="",
        preemptions_per_hour=0.0,
    )


def _model_parts(w: Workload) -> dict[str, int]:
    """Weights, adapters, gradients and optimizer state of one rank (one process: all)."""
    if w.parallelism == "fsdp":
        return _fsdp_parts(w)
    wb = weight_bytes(w)
    parts = {
        "weights": wb["linear"] + wb["embeddings"] + wb["norms"] + wb["buffers"],
        "quant_state": wb["quant_state"],
        "adapters": adapter_bytes(w),
        "gradients": grad_bytes(w),
        "optimizer": optimizer_bytes(w),
    }
    if w.parallelism == "ddp":
        # DDP's reducer keeps its own flat buckets of the gradients (it is built with
        # gradient_as_bucket_view off): a second copy of every trainable gradient.
        parts["gradient_buckets"] = grad_bytes(w)
    return parts


def _fsdp_parts(w: Workload) -> dict[str, int]:
    """One rank's share under FSDP2, rank 0's (the largest): ``plan/sharding.py``."""
    parts = fsdp_static(w, w.world_size)
    if w.cpu_offload:  # the shards, gradients and optimizer state live in host RAM
        parts.update(weights=weight_bytes(w)["buffers"], adapters=0, gradients=0, optimizer=0)
    parts["accumulated_gradients"] = fsdp_accumulated_grads(w)
    parts["gathered_weights"] = fsdp_gathered(w, w.world_size, w.cpu_offload)
    return parts


def breakdown(w: Workload) -> tuple[dict[str, int], dict[str, int]]:
    """Peak-memory components in bytes (per rank), and the activation sub-components."""
    wb = weight_bytes(w)
    act = activation_bytes(w)
    parts = _model_parts(w)
    dynamic = act.device_saved + act.held + max(act.logits, act.recompute)
    dynamic += parts.get("gathered_weights", 0)
    parts |= {
        "activations": act.device_saved + act.held,
        "logits_and_backward_transient": max(act.logits, act.recompute),
        "workspace": CUBLAS_WORKSPACE_BYTES if w.device == "cuda" else 0,
        "overhead": (CUDA_CONTEXT_BYTES if w.device == "cuda" else CPU_RUNTIME_BYTES)
        + int(FRAGMENTATION * dynamic),
    }
    if w.device == "cpu":
        # From the first checkpoint on, the writer keeps a host copy of what it saves (the
        # trainable tensors and the optimizer state) to stage the next one: on a CPU run
        # that is the same memory as training's (checkpoint/writer.py: HostBuffers).
        parts["checkpoint_staging"] = grad_bytes(w) + optimizer_bytes(w)
    # The load's moment (weights, the runtime and one tensor stored + converted), where it
    # is higher than the steps' (a 128k vocabulary converted to float32 on a CPU).
    weights = wb["linear"] + wb["embeddings"] + wb["norms"] + wb["buffers"]
    at_load = weights + wb["quant_state"] + CPU_RUNTIME_BYTES + load_transient_bytes(w)
    parts["loading_transient"] = max(0, at_load - sum(parts.values())) if w.device == "cpu" else 0
    return parts, act.parts


def host_breakdown(w: Workload) -> dict[str, int]:
    """What one rank of a GPU run keeps in host RAM instead: the offloaded activations
    (pinned), and under FSDP2 CPU offload its shards, gradients and optimizer state."""
    host = activation_bytes(w).host
    out = {"offloaded_activations": host} if host else {}
    if w.parallelism == "fsdp" and w.cpu_offload:
        out |= fsdp_host_offload(w, w.world_size)
    return out


def host_ram_of(w: Workload, ranks: int) -> HostRAM:
    """Host memory of one host running ``ranks`` of this run's ranks. FSDP loads the base
    on the CPU (``FSDPStrategy.load_device``); single and DDP load onto the GPU."""
    cpu_load = replace(w, device="cpu")
    return host_ram(
        w,
        ranks,
        loader_for(w.parallelism, w.cpu_offload),
        reads_on_cpu=w.parallelism == "fsdp",
        runtime=CPU_RUNTIME_BYTES,
        load_transient=load_transient_bytes(cpu_load),
        offloaded=host_breakdown(w),
    )


def peak_bytes(w: Workload) -> int:
    return sum(breakdown(w)[0].values())


def _largest(w: Workload, gpu: GPU, field: str, lo: int, hi: int, step: int = 1) -> int | None:
    """Largest value of ``field`` (multiple of ``step``) in [lo, hi] whose peak fits."""

    def fits(v: int) -> bool:
        changes: dict[str, Any] = {field: v}
        return peak_bytes(replace(w, **changes)) <= gpu.memory_bytes

    if not fits(lo):
        return None
    good, probe = lo, lo
    while probe < hi:  # exponential search, then bisection: peak is monotone in both
        probe = min(probe * 2, hi)
        if not fits(probe):
            break
        good = probe
    else:
        return good
    bad = probe
    while bad - good > step:
        mid = (good + bad) // 2 // step * step
        if mid <= good:
            break
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def flops_per_token(w: Workload) -> float:
    """Training FLOPs per token: forward 2N; backward input-grads 2N (frozen base) or
    4N (full); recompute adds a forward of the layers under checkpointing. Causal
    attention adds 2·L·s·d_q forward (twice that backward); chunked cross-entropy
    recomputes the head's forward; DPO's reference pass is one more forward."""
    a, x = w.arch, w.arch.experts
    layer_lin = sum(i * o for i, o in a.linear_shapes().values())
    if x is not None:  # the router, and each token's top-k experts
        layer_lin += x.count * a.hidden + x.top_k * 3 * a.hidden * x.intermediate
    n_layers = a.layers * layer_lin
    head = a.vocab * a.hidden
    attn = 2 * a.layers * w.seq_len * a.heads * a.head_dim
    fwd = 2 * (n_layers + head) + attn
    bwd = (4 * (n_layers + head) if w.method == "full" else 2 * (n_layers + head)) + 2 * attn
    recompute = 2 * n_layers + attn if w.gradient_checkpointing else 0
    if w.loss_chunk_tokens:
        recompute += 2 * head  # each chunk's logits again in backward
    reference = fwd if w.reference_forward else 0  # DPO's adapter-disabled forward
    return float(fwd + bwd + recompute + reference)


Change = tuple[str, dict[str, Any]]


def _changes(w: Workload) -> list[Change]:
    """Memory-saving changes that keep the global batch and the data."""
    return _model_changes(w) + _batch_changes(w) + _placement_changes(w)


def _model_changes(w: Workload) -> list[Change]:
    """What is trained and how: checkpointing, a 4-bit base, the optimizer, the targets."""
    out: list[Change] = []
    if not w.gradient_checkpointing:
        out.append(
            (
                "gradient checkpointing on (model.gradient_checkpointing: true)",
                {"gradient_checkpointing": True},
            )
        )
    if w.method == "lora":
        out.append(
            ("QLoRA: 4-bit NF4 base (lora.quantize: nf4)", {"method": "qlora", "quantize": "nf4"})
        )
    if w.optimizer == "adamw" and (w.method == "full" or w.expert_lora):
        out.append(("8-bit AdamW (train.optimizer: adamw8bit)", {"optimizer": "adamw8bit"}))
    if w.expert_lora:  # LoRA on every expert: r·E per parameter, often most of the state
        attention = tuple(t for t in w.lora_targets if t in w.arch.linear_shapes())
        out.append(
            (
                f"LoRA on the attention only (lora.target_modules: [{', '.join(attention)}], "
                "no lora.target_parameters)",
                {"lora_targets": attention, "lora_parameters": ()},
            )
        )
    if w.lora_dropout > 0 and w.method != "full":
        out.append(
            ("lora.dropout 0 (no per-module dropout masks and copies)", {"lora_dropout": 0.0})
        )
    return out


def _batch_changes(w: Workload) -> list[Change]:
    """How a micro-batch is laid out and its loss computed."""
    out: list[Change] = []
    if w.padded:
        out.append(
            (
                "pack samples (data.packing: true): no attention-mask bias per layer",
                {"padded": False},
            )
        )
    if not w.loss_chunk_tokens:
        out.append(
            (
                f"chunked cross-entropy (train.loss_chunk_tokens: {ADVISED_CHUNK}): "
                "the logits are never whole",
                {"loss_chunk_tokens": ADVISED_CHUNK},
            )
        )
    return out


def _placement_changes(w: Workload) -> list[Change]:
    """Where the state lives: sharded across ranks, or in host RAM."""
    out: list[Change] = []
    shardable = w.quant != "int8" and w.optimizer == "adamw" and not w.arch.experts
    if w.parallelism == "ddp" and shardable:
        out.append(
            (
                "shard instead of replicating (distributed.strategy: fsdp)",
                {"parallelism": "fsdp"},
            )
        )
    if w.parallelism == "fsdp" and w.device == "cuda" and not w.cpu_offload:
        out.append(
            (
                "shards, gradients and optimizer state in host RAM (distributed.cpu_offload: true)",
                {"cpu_offload": True},
            )
        )
    if w.device == "cuda" and not w.offload_activations:
        out.append(
            (
                "activations in host RAM (train.offload_activations: true)",
                {"offload_activations": True},
            )
        )
    return out


def _smaller_micro_batch(w: Workload, gpu: GPU) -> tuple[str, Workload] | None:
    mb = _largest(w, gpu, "micro_batch", 1, w.micro_batch)
    if mb is None or mb >= w.micro_batch:
        return None
    accum = -(-w.micro_batch * w.grad_accum // mb)
    return (
        f"micro-batch {mb} with gradient accumulation {accum} (same global batch)",
        replace(w, micro_batch=mb, grad_accum=accum),
    )


def _advice(w: Workload, gpu: GPU, peak: int, max_mb: int | None) -> list[dict[str, Any]]:
    """What to change: single changes with the peak each gives, then the smallest
    combination that fits (greedy: the most effective change first)."""
    out: list[dict[str, Any]] = []

    def entry(change: str, alt: Workload) -> dict[str, Any]:
        p = peak_bytes(alt)
        return {"change": change, "peak_bytes": p, "fits": p <= gpu.memory_bytes}

    smaller = _smaller_micro_batch(w, gpu)
    if smaller:
        out.append(entry(*smaller))
    for change, kw in _changes(w):
        e = entry(change, replace(w, **kw))
        if e["peak_bytes"] < peak:
            out.append(e)
    if not any(e["fits"] for e in out):
        cur, steps, left = w, [], _changes(w)
        while left and peak_bytes(cur) > gpu.memory_bytes:
            best = min(left, key=lambda c: peak_bytes(replace(cur, **c[1])))
            left.remove(best)
            cur = replace(cur, **best[1])
            steps.append(best[0])
        if peak_bytes(cur) > gpu.memory_bytes:
            smaller = _smaller_micro_batch(cur, gpu)
            if smaller:
                steps.append(smaller[0])
                cur = smaller[1]
        if len(steps) > 1:
            out.append(entry("together: " + "; ".join(steps), cur))
    for g in sorted(CATALOG.values(), key=lambda g: g.spot_usd_h):
        if w.device == "cuda" and g.memory_bytes >= peak and g.name != gpu.name:
            out.append(
                {
                    "change": f"a larger GPU: {g.name} ({g.memory_bytes / GiB:.0f} GiB, "
                    f"spot ${g.spot_usd_h:.2f}/h)",
                    "peak_bytes": peak,
                    "fits": True,
                }
            )
            break
    out.sort(key=lambda a: (not a["fits"], a["peak_bytes"]))
    return out


def _time_and_cost(w: Workload, gpu: GPU, schedule: Schedule) -> dict[str, float | None]:
    """Hours and dollars, on demand and on spot; None for a CPU run (the time model is
    GPU tensor-core FLOPs at an assumed utilization, and a CPU has no catalog price)."""
    if w.device == "cpu":
        return dict.fromkeys(("hours", "hours_spot", "cost_usd", "cost_spot_usd"))
    tokens = schedule.steps * w.micro_batch * w.grad_accum * w.seq_len  # one rank's
    peak_flops = gpu.peak_flops(w.dtype) or gpu.fp16_flops
    hours = tokens * flops_per_token(w) / (peak_flops * MFU[w.method]) / 3600
    # Each preemption costs a restart plus, on average, half a checkpoint interval of
    # redone work; the overhead time is itself exposed to preemption, hence the division.
    lost_h = (schedule.restart_minutes + schedule.checkpoint_minutes / 2) / 60
    exposure = gpu.preemptions_per_hour * lost_h
    hours_spot = hours / (1 - exposure) if exposure < 1 else float("inf")
    return {
        "hours": hours,
        "hours_spot": hours_spot,
        "cost_usd": hours * gpu.on_demand_usd_h * w.world_size,
        "cost_spot_usd": hours_spot * gpu.spot_usd_h * w.world_size,
    }


def _parallel_notes(w: Workload) -> list[str]:
    """What a multi-rank plan assumes."""
    if w.parallelism == "single":
        return []
    common = (
        "NCCL's own buffers are not counted; time assumes the ranks compute in parallel "
        "with no communication cost; cost is for all the GPUs"
    )
    if w.parallelism == "ddp":
        return [f"DDP over {w.world_size} ranks: per GPU, a whole replica plus the reducer's "
                f"gradient buckets; {common}"]  # fmt: skip
    return [
        f"FSDP2 over {w.world_size} ranks: per GPU, rank 0's share (the largest; later ranks "
        "may hold fewer optimizer rows); every parameter sharded on dim 0, padded to "
        f"{w.world_size} equal chunks; quant states and buffers replicated",
        "all-gathered weights: an upper bound read from torch 2.13's FSDP2, not measured: the "
        "root (embeddings, final norm, head) whole from the forward to the end of the "
        "backward, two decoder layers gathered at once (prefetch) each with its all-gather "
        "buffer, one layer's gradients being reduce-scattered"
        + (
            "; the unsharded gradients are kept across the accumulated micro-batches"
            if w.grad_accum > 1
            else ""
        ),  # fmt: skip
        common,
    ]


def _notes(w: Workload, gpu: GPU) -> tuple[str, ...]:
    notes = _parallel_notes(w)
    family = w.arch.family
    if family and family not in CHECKED_FAMILIES:
        notes.append(
            f"model_type {family!r} is planned as a Llama-style layer (separate q/k/v and "
            "gate/up projections, two RMSNorms); the tensor terms are checked to the byte "
            f"for {', '.join(sorted(CHECKED_FAMILIES))} only"
        )
    if w.sampled:
        notes.append(
            "GRPO: the sequences are each prompt's sampled completions (prompt up to "
            "data.max_length + grpo.max_completion_tokens); the time counts training only, "
            "not the sampling (generate, one token per forward), which often takes longer"
        )
    if w.device == "cpu":
        notes.append(
            "a CPU run: the peak is host RAM, the tensors plus "
            f"{CPU_RUNTIME_BYTES / GiB:.2f} GiB for the process's own code and libraries "
            "(measured, in 'overhead'); time and cost are not estimated for CPUs"
        )
        if w.arch.experts is not None:
            notes.append(
                "a mixture of experts on a CPU: the plan counts tensors, not the heap's "
                "holes; at OLMoE-1B-7B's shape the steps peaked at 0.97x this plan (one run), "
                "1.08-1.46x before finetune capped oneDNN's primitive cache and wrote "
                "checkpoints without a serialized copy (benchmarks/README.md)"
            )
    elif w.dtype == "bfloat16" and not gpu.bf16_flops:
        notes.append(
            f"{gpu.name} has no bfloat16: use model.dtype float16 (QLoRA's authors "
            "report fp16 compute instabilities; timed here at the fp16 peak)"
        )
    if w.offload_activations:
        notes.append(
            "offloaded activations (train.offload_activations) already live in host RAM "
            "on a CPU run: the total above is unchanged"
            if w.device == "cpu"
            else "offloaded activations: in host RAM (below), not in the GPU total; backward "
            "brings them back a node at a time (in the transient); the PCIe copies are not "
            "in the time estimate"
        )
    if w.optimizer == "paged_adamw8bit" and w.device == "cuda":
        notes.append(
            "paged optimizer state can move to host RAM under pressure: it absorbs "
            "spikes, the steady peak above is unchanged"
        )
    return tuple(notes)


def make_plan(
    w: Workload, gpu: GPU, schedule: Schedule = Schedule(), gpus_per_host: int | None = None
) -> Plan:
    """Everything ``shoestring plan`` prints. For a CPU run (``w.device == "cpu"``) the
    ``gpu`` is the host's RAM (:func:`host_target`). Several ranks (``w.world_size``):
    the memory is one rank's, and the host RAM that of ``gpus_per_host`` ranks (default:
    all on one host)."""
    parts, act_parts = breakdown(w)
    peak = sum(parts.values())
    fits = peak <= gpu.memory_bytes
    max_mb = _largest(w, gpu, "micro_batch", 1, 4096)
    max_seq = _largest(w, gpu, "seq_len", 64, 1 << 20, step=64)
    several = w.parallelism != "single"
    return Plan(
        workload=w,
        gpu=gpu,
        breakdown=parts,
        activation_parts=act_parts,
        notes=_notes(w, gpu),
        peak_bytes=peak,
        fits=fits,
        max_micro_batch=max_mb,
        max_seq_len=max_seq,
        advice=[] if fits else _advice(w, gpu, peak, max_mb),
        host_bytes=host_breakdown(w),
        host_ram=host_ram_of(w, gpus_per_host or w.world_size) if several else None,
        catalog_fits={g.name: peak <= g.memory_bytes for g in CATALOG.values()} if several else {},
        tokens=schedule.steps * w.micro_batch * w.grad_accum * w.seq_len * w.world_size,
        flops_per_token=flops_per_token(w),
        **_time_and_cost(w, gpu, schedule),
    )
