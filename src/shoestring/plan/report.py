"""Render a :class:`Plan` for people (text) and for programs (JSON)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from shoestring.gpus import GiB
from shoestring.plan.arch import Arch
from shoestring.plan.estimate import Plan
from shoestring.plan.memory import Workload
from shoestring.plan.sharding import HostRAM

_LABELS = {
    "weights": "weights",
    "quant_state": "quantization constants",
    "adapters": "LoRA adapters (fp32)",
    "gradients": "gradients",
    "optimizer": "optimizer state",
    "activations": "activations saved for backward",
    "logits_and_backward_transient": "logits / backward transient",
    "workspace": "cuBLAS workspace",
    "overhead": "CUDA context + fragmentation",
    "loading_transient": "loading: beyond the steps' peak",
    "checkpoint_staging": "checkpoint staging (host copy)",
    "gradient_buckets": "DDP gradient buckets",
    "accumulated_gradients": "unsharded grads (accumulation)",
    "gathered_weights": "all-gathered weights (transient)",
}


_HOST_LABELS = {
    "offloaded_activations": "activations saved for backward",
    "sharded_weights": "weight + adapter shards",
    "sharded_gradients": "gradient shards",
    "sharded_optimizer": "optimizer state shards",
    "base": "the whole base, as loaded",
    "adapters": "LoRA adapters (fp32)",
    "load_transient": "one tensor stored + converted",
    "runtime": "runtime (python, libraries)",
}


def _gib(n: float) -> str:
    return f"{n / GiB:7.2f} GiB"


def _hours(h: float) -> str:
    return f"{h:.2f} h" if h >= 0.1 else f"{h * 60:.1f} min"


def to_dict(plan: Plan) -> dict[str, Any]:
    """The machine-readable plan (``shoestring plan --json``)."""
    w = plan.workload
    g = plan.gpu
    return {
        "fits": plan.fits,
        "peak_bytes": plan.peak_bytes,
        "device": w.device,
        "gpu_memory_bytes": None if plan.on_cpu else g.memory_bytes,
        "ram_bytes": g.memory_bytes if plan.on_cpu else None,
        "breakdown": dict(plan.breakdown),
        "host_bytes": dict(plan.host_bytes),
        "activation_parts": dict(plan.activation_parts),
        "max_micro_batch": plan.max_micro_batch,
        "max_seq_len": plan.max_seq_len,
        "advice": plan.advice,
        "tokens": plan.tokens,
        "flops_per_token": plan.flops_per_token,
        "hours": plan.hours,
        "hours_spot": plan.hours_spot,
        "cost_usd": plan.cost_usd,
        "cost_spot_usd": plan.cost_spot_usd,
        "notes": list(plan.notes),
        "host_ram": None if plan.host_ram is None else _host_ram_dict(plan.host_ram),
        "catalog_fits": dict(plan.catalog_fits),
        "gpu": None if plan.on_cpu else asdict(g),
        "workload": {
            **{k: v for k, v in asdict(w).items() if k != "arch"},
            "quant": w.quant,
            "arch": asdict(w.arch),
        },
    }


def _host_ram_dict(h: HostRAM) -> dict[str, Any]:
    return {**asdict(h), "peak": h.peak}


def to_json(plan: Plan) -> str:
    return json.dumps(to_dict(plan), indent=2, sort_keys=True)


def _experts_lora(w: Workload) -> str:
    """An MoE's adapted experts and router, and how its experts are held."""
    x = w.arch.experts
    if x is None:
        return ""
    held = "NF4" if w.nf4_experts else w.dtype
    adapted = [f"{p} r={r}" for p, r in w.expert_lora] + (
        [f"router r={w.router_lora}"] if w.router_lora else []
    )
    return (
        f"; {x.count} experts a layer ({x.top_k} a token) in {held}"
        f"{', LoRA on ' + ', '.join(adapted) if adapted else ', no LoRA'}"
    )


def _tower(a: Arch) -> str:
    if a.tower is None:
        return ""
    return f" ({a.tower.params / 1e9:.2f}B in a vision tower: frozen, not run on text)"


def _header(plan: Plan) -> list[str]:
    w, g = plan.workload, plan.gpu
    a = w.arch
    method = w.method + (f" ({w.quant})" if w.quant != "none" else "")
    precision = ", autocast" if w.autocast else ""
    return [
        f"model    {a.name}: {a.params / 1e9:.2f}B params{_tower(a)}, {a.layers} layers, "
        f"hidden {a.hidden}, vocab {a.vocab}",
        f"method   {method}, r={w.lora_r} on {','.join(w.adapted) or '-'}{_experts_lora(w)}, "
        f"dtype {w.dtype}{precision}, optimizer {w.optimizer}"
        if w.method != "full"
        else f"method   full fine-tuning, dtype {w.dtype}{precision}, optimizer {w.optimizer}",
        f"batch    micro-batch {w.micro_batch} x seq {w.seq_len}, accumulation {w.grad_accum}, "
        f"gradient checkpointing {'on' if w.gradient_checkpointing else 'off'}"
        f"{', padded' if w.padded else ', packed'}"
        + (f", loss in chunks of {w.loss_chunk_tokens} tokens" if w.loss_chunk_tokens else "")
        + (", activations offloaded to host RAM" if w.offload_activations else "")
        + (", liger kernels (fused linear cross-entropy)" if w.fused else ""),
        f"device   cpu: {g.name} {g.memory_bytes / GiB:.1f} GiB"
        if plan.on_cpu
        else f"gpu      {g.name}: {g.memory_bytes / GiB:.1f} GiB",
        *_layout_line(plan),
        "",
        f"memory (peak, {'host RAM' if plan.on_cpu else _per_gpu(plan)}):",
    ]


def _per_gpu(plan: Plan) -> str:
    w = plan.workload
    if w.parallelism == "fsdp":
        return f"per GPU: rank 0 of {w.world_size}, the largest share"
    return "per GPU" if w.parallelism == "single" else f"per GPU, each of {w.world_size}"


def _layout_line(plan: Plan) -> list[str]:
    w, h = plan.workload, plan.host_ram
    if w.parallelism == "single" or h is None:
        return []
    how = "FSDP2 shards" if w.parallelism == "fsdp" else "DDP replicas"
    return [
        f"ranks    {w.world_size} x {plan.gpu.name}, {how}"
        + (", CPU offload" if w.cpu_offload else "")
        + f", {h.ranks} per host; micro-batch per rank, "
        f"global batch {w.micro_batch * w.grad_accum * w.world_size}"
    ]


def _host_ram_lines(h: HostRAM) -> list[str]:
    """One host's RAM: its ranks at the load's moment and while training."""
    readers = h.ranks if h.loader == "every_rank" else 1
    who = "every rank reads" if h.loader == "every_rank" else "rank 0 reads, the others receive"
    lines = ["", f"host RAM (per host, {h.ranks} ranks; at load {who} the base):"]
    lines.append(f"  at load, per reading rank ({readers}):")
    lines += [f"    {_HOST_LABELS.get(k, k):32s}{_gib(v)}" for k, v in h.load_per_rank.items() if v]
    lines.append(f"  while training, per rank ({h.ranks}):")
    lines += [
        f"    {_HOST_LABELS.get(k, k):32s}{_gib(v)}" for k, v in h.steady_per_rank.items() if v
    ]
    lines.append(
        f"  {'host total: load / training':34s}{_gib(h.load_total)} / {h.steady_total / GiB:.2f}"
        f" GiB; peak {h.peak / GiB:.2f} GiB"
    )
    return lines


def _catalog_lines(plan: Plan) -> list[str]:
    from shoestring.gpus import CATALOG

    if not plan.catalog_fits:
        return []
    lines = ["", f"per-rank peak {plan.peak_bytes / GiB:.2f} GiB on each GPU of the catalog:"]
    for name, ok in plan.catalog_fits.items():
        room = (CATALOG[name].memory_bytes - plan.peak_bytes) / GiB
        lines.append(
            f"  {name:10s} {CATALOG[name].memory_bytes / GiB:6.1f} GiB  "
            + (f"fits, {room:.2f} GiB to spare" if ok else f"does not fit, {-room:.2f} GiB over")
        )
    return lines


def _per_rank(plan: Plan) -> str:
    n = plan.workload.world_size
    return f" ({plan.tokens / n / 1e6:.1f}M per rank, {n} ranks in parallel)" if n > 1 else ""


def _time_lines(plan: Plan) -> list[str]:
    g = plan.gpu
    if plan.hours is None or plan.hours_spot is None:
        return []
    return [
        "",
        f"time     {plan.tokens / 1e6:.1f}M tokens{_per_rank(plan)} x "
        f"{plan.flops_per_token / 1e9:.3g} GFLOP/token = {_hours(plan.hours)} at the assumed "
        "utilization",
        f"cost     on-demand ${plan.cost_usd:.2f} (${g.on_demand_usd_h:.2f}/h); "
        f"spot ${plan.cost_spot_usd:.2f} (${g.spot_usd_h:.2f}/h, {plan.hours_spot:.2f} h incl. "
        f"{g.preemptions_per_hour:.0%}/h preemptions)",
        f"prices   {g.price_source}, {g.price_date}"
        + (f" - {g.price_note}" if g.price_note else ""),
    ]


def to_text(plan: Plan) -> str:
    w, g = plan.workload, plan.gpu
    lines = _header(plan)
    labels = {**_LABELS, "overhead": "runtime + fragmentation"} if plan.on_cpu else _LABELS
    for k, v in plan.breakdown.items():
        if v:
            lines.append(f"  {labels.get(k, k):34s}{_gib(v)}")
    lines.append(f"  {'total':34s}{_gib(plan.peak_bytes)}   of {g.memory_bytes / GiB:.1f} GiB")
    if plan.host_bytes:
        lines.append("host RAM (pinned, not in the GPU total):")
        for k, v in plan.host_bytes.items():
            lines.append(f"  {_HOST_LABELS.get(k, k):34s}{_gib(v)}")
    if plan.host_ram is not None:
        lines += _host_ram_lines(plan.host_ram)
    lines.append("")
    if plan.fits:
        lines.append(f"FITS, {plan.headroom_bytes / GiB:.2f} GiB to spare.")
    else:
        lines.append(f"DOES NOT FIT: {-plan.headroom_bytes / GiB:.2f} GiB over.")
    mb = plan.max_micro_batch
    lines.append(
        f"largest micro-batch at seq {w.seq_len}: {mb if mb else 'none (even 1 is too much)'}"
    )
    ms = plan.max_seq_len
    lines.append(f"largest sequence at micro-batch {w.micro_batch}: {ms if ms else 'none'}")
    if plan.advice:
        lines.append("")
        lines.append("what to change (peak after the change):")
        for adv in plan.advice:
            verdict = "fits" if adv["fits"] else "still too big"
            lines.append(f"  - {adv['change']}: {adv['peak_bytes'] / GiB:.2f} GiB, {verdict}")
    lines += _catalog_lines(plan)
    lines += [f"note     {n}" for n in plan.notes]
    lines += _time_lines(plan)
    lines.append(
        "note     memory terms are exact tensor accounting (byte-exact on CPU; within +3 % of "
        "max_memory_allocated on an H200 for a 0.86B LoRA/QLoRA, 2026-12-04); the "
        + (
            "fragmentation term is an assumption."
            if plan.on_cpu
            else "CUDA-context/fragmentation term and the time model are uncalibrated estimates."
        )
    )
    return "\n".join(lines)
