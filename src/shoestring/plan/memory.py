"""Byte-exact memory model of LoRA / QLoRA / full fine-tuning of a Llama-style model.

Every term is derived from what the libraries actually allocate, not from rules
of thumb, and each is checked against instantiated tiny models in
``tests/test_plan_memory.py``:

* **weights**: parameters and buffers; for bitsandbytes 4-bit, the packed
  weights plus their quantization state (blockwise absmax, double-quantized
  into uint8 with a second fp32 absmax per 256 blocks, code tables, offset);
  for 8-bit, int8 weights plus one fp32 scale per output row. Embeddings, head
  and norms stay in the compute dtype (we never upcast them to fp32).
* **adapters / gradients**: PEFT keeps adapters in fp32 even on a 16-bit base
  (``autocast_adapter_dtype``); gradients match the trainable parameters.
* **optimizer**: torch AdamW keeps two moments in the parameter dtype plus a
  4-byte step per tensor; bitsandbytes 8-bit AdamW keeps uint8 moments with one
  fp32 absmax per 256 values, but falls back to fp32 moments for tensors under
  4096 elements (``min_8bit_size``).
* **activations**: the tensors autograd saves for backward, walked op by op
  through the HF Llama forward with PEFT's LoRA layers (see :func:`_layer_saved`),
  tracking which tensors require grad (the first layer of a frozen model saves
  less, because nothing before it requires grad). With chunked cross-entropy
  (``train.loss_chunk_tokens``) the head saves only its checkpointed inputs; with
  activation offload (``train.offload_activations``) on CUDA the saved bytes live in
  host RAM and only what backward brings back is on the device (:func:`_restored`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import ceil
from typing import Literal

from shoestring.plan.arch import ALL_LINEARS, LINEARS, Arch
from shoestring.train.config import ComputeDtype, DeviceKind, Kernels, Optimizer, Quantize

Method = Literal["full", "lora", "qlora"]
#: How the ranks share the work (``distributed.strategy``; ``single``: one process).
Parallelism = Literal["single", "ddp", "fsdp"]
DTYPE_BYTES: dict[ComputeDtype, int] = {"float32": 4, "bfloat16": 2, "float16": 2}

#: bitsandbytes 4-bit: values per absmax block, blocks per second-level absmax.
NF4_BLOCK = 64
NF4_NESTED_BLOCK = 256
#: bitsandbytes 8-bit optimizers: values per absmax block; smaller tensors stay 32-bit.
OPT8_BLOCK = 256
OPT8_MIN_SIZE = 4096


@dataclass(frozen=True)
class Workload:
    """What is trained, and how. Shapes only: nothing is loaded."""

    arch: Arch
    method: Method = "lora"
    quantize: Quantize = "none"  # qlora implies nf4 unless int8
    dtype: ComputeDtype = "bfloat16"  # compute / base-weight dtype
    lora_r: int = 16
    lora_targets: tuple[str, ...] = ALL_LINEARS  # those the model has are adapted
    lora_dropout: float = 0.05
    seq_len: int = 2048
    micro_batch: int = 1
    grad_accum: int = 1
    gradient_checkpointing: bool = True
    optimizer: Optimizer = "adamw"
    padded: bool = True  # batches carry an attention mask (no packing)
    device: DeviceKind = "cuda"  # dropout masks are 1-byte bools on CUDA, 4-byte floats on CPU
    #: The step runs under 16-bit autocast (``train.precision bf16|fp16`` on a 16-bit
    #: model): the fp32 LoRA matmuls then run, and save their inputs, in ``dtype``.
    autocast: bool = False
    double_quant: bool = True
    #: ``train.loss_chunk_tokens``: the head and the loss over this many positions at a
    #: time, checkpointed (0: the whole micro-batch at once, transformers' own loss).
    loss_chunk_tokens: int = 0
    #: ``train.offload_activations``: saved tensors live in host RAM (on CUDA).
    offload_activations: bool = False
    #: Several processes: ``ddp`` (a replica each) or ``fsdp`` (FSDP2 shards) over
    #: ``world_size`` ranks; the batch fields above are per rank (``plan/sharding.py``).
    parallelism: Parallelism = "single"
    world_size: int = 1
    #: ``distributed.cpu_offload``: FSDP2's shards, gradients and optimizer state in host RAM.
    cpu_offload: bool = False
    #: ``train.objective dpo`` without ``dpo.precompute_ref``: each micro-batch also runs
    #: a no-grad forward of the base with the adapter disabled (the reference).
    reference_forward: bool = False
    #: ``train.objective grpo``: each step first samples its completions (generate).
    sampled: bool = False
    #: The objective reads the model's logits (preference tuning, GRPO); SFT keeps only
    #: the loss, so its logits are freed before backward.
    logits_read: bool = False
    #: ``train.kernels``: 'liger' fuses the head and the loss (no whole logits), SwiGLU
    #: (the SiLU output is recomputed) and RMSNorm (its input saved in its own dtype).
    kernels: Kernels = "none"
    #: ``lora.target_parameters``: an MoE's fused expert parameters adapted at ``lora_r``.
    lora_parameters: tuple[str, ...] = ()

    @property
    def quant(self) -> Quantize:
        if self.method == "qlora":
            return self.quantize if self.quantize != "none" else "nf4"
        return self.quantize if self.method == "lora" else "none"

    @property
    def e(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def adapted(self) -> tuple[str, ...]:
        """The adapted ``nn.Linear`` layers (an MoE layer's experts are not among them)."""
        shapes = self.arch.linear_shapes()
        return () if self.method == "full" else tuple(t for t in self.lora_targets if t in shapes)

    @property
    def expert_lora(self) -> tuple[tuple[str, int], ...]:
        """An MoE's adapted expert parameters and their ranks, as peft maps the v4 names
        of its experts (``gate_proj`` + ``up_proj`` -> ``gate_up_proj`` at twice the rank,
        ``down_proj``) and adds ``lora.target_parameters`` at ``lora_r``."""
        if self.arch.experts is None or self.method == "full":
            return ()
        ranks = {p: self.lora_r for p in self.lora_parameters}
        if {"gate_proj", "up_proj"} <= set(self.lora_targets):
            ranks["gate_up_proj"] = 2 * self.lora_r
        if "down_proj" in self.lora_targets:
            ranks["down_proj"] = self.lora_r
        return tuple(sorted(ranks.items()))

    @property
    def router_lora(self) -> int:
        """LoRA rank on an MoE's router weight: peft's ``all-linear`` adapts it (0: frozen)."""
        every = self.arch.experts is not None and set(LINEARS) <= set(self.lora_targets)
        return self.lora_r if every and self.method != "full" else 0

    @property
    def nf4_experts(self) -> bool:
        """An MoE's experts held in NF4 (``shoestring.train.nf4experts``) and computed
        per routed expert; otherwise in ``dtype``, run by transformers' grouped matmul."""
        return self.arch.experts is not None and self.quant == "nf4"

    @property
    def fused(self) -> bool:
        return self.kernels == "liger"

    @property
    def offloads(self) -> bool:
        """Saved activations leave the device (a CPU run keeps them where they are)."""
        return self.offload_activations and self.device == "cuda"


# --------------------------------------------------------------------------- static memory


def _nf4_bytes(n: int, double_quant: bool) -> int:
    """Packed 4-bit weight plus its QuantState, as bitsandbytes allocates it."""
    blocks = ceil(n / NF4_BLOCK)
    packed = (n + 1) // 2
    if not double_quant:
        return packed + 4 * blocks + 16 * 4  # fp32 absmax, 16-entry code
    # uint8 absmax + fp32 absmax per 256 blocks + 256-entry fp32 code + 16-entry code + offset
    return packed + blocks + 4 * ceil(blocks / NF4_NESTED_BLOCK) + 256 * 4 + 16 * 4 + 4


def weight_bytes(w: Workload) -> dict[str, int]:
    """Bytes of the base model: quantized linears, 16-bit rest, buffers."""
    a, e = w.arch, w.e
    lin = quant = 0
    for name, (i, o) in a.linear_shapes().items():
        n = i * o
        if w.quant == "nf4":
            lin += a.layers * (n + 1) // 2
            quant += a.layers * (_nf4_bytes(n, w.double_quant) - (n + 1) // 2)
        elif w.quant == "int8":
            lin += a.layers * n
            quant += a.layers * 4 * o  # SCB: one fp32 absmax per output row
        else:
            lin += a.layers * n * e
        if a.linear_bias(name):
            lin += a.layers * o * e
    if a.tower is not None:  # kept in the dtype, as lora.quantize leaves it (train.towers)
        lin += a.tower.params * e
    experts, expert_state = _expert_weight_bytes(w)
    emb = a.vocab * a.hidden * (1 if a.tie_embeddings else 2) * e
    per_layer = 4 if a.sandwich_norms else 2
    norms = (per_layer * a.layers + 1) * a.hidden * e + a.layers * a.qk_norm_width * e
    # inv_freq + original_inv_freq (fp32) of each rotary table; Gemma's embedding scale
    rotary = (2 if a.local_rope else 1) * 2 * (a.rotated // 2) * 4
    return {
        "linear": lin + experts,
        "quant_state": quant + expert_state,
        "embeddings": emb,
        "norms": norms,
        "buffers": rotary
        + (e if a.scaled_embeddings else 0)
        + (a.tower.buffer_bytes if a.tower else 0),
    }


def _expert_weight_bytes(w: Workload) -> tuple[int, int]:
    """An MoE's experts and routers: (weights, quantization state). NF4 experts are
    quantized one expert's matrix at a time, always double-quantized, and leave a
    one-element placeholder where each fused parameter was."""
    a, x, e = w.arch, w.arch.experts, w.e
    if x is None:
        return 0, 0
    stored = state = 0
    for i, o in x.param_shapes(a.hidden).values():
        n = i * o
        if w.nf4_experts:
            stored += x.count * ((n + 1) // 2) + e
            state += x.count * (_nf4_bytes(n, double_quant=True) - (n + 1) // 2)
        else:
            stored += x.count * n * e
    return a.layers * (stored + x.count * a.hidden * e), a.layers * state


def _expert_trainable(w: Workload) -> list[int]:
    """One MoE layer's LoRA tensors on the experts (``[r·E, in]`` and ``[out, r·E]``, as
    peft's ``ParamWrapper`` holds them) and on the router."""
    a, x = w.arch, w.arch.experts
    if x is None:
        return []
    shapes = x.param_shapes(a.hidden)
    sizes = [
        n
        for p, r in w.expert_lora
        for n in (r * x.count * shapes[p][0], r * x.count * shapes[p][1])
    ]
    if w.router_lora:
        sizes += [w.router_lora * a.hidden, w.router_lora * x.count]
    return sizes


def trainable_tensors(w: Workload) -> list[int]:
    """Element counts of every trainable tensor (what the optimizer sees)."""
    a = w.arch
    if w.method == "full":
        sizes = [a.vocab * a.hidden] + ([] if a.tie_embeddings else [a.vocab * a.hidden])
        for _ in range(a.layers):
            for name, (i, o) in a.linear_shapes().items():
                sizes.append(i * o)
                if a.linear_bias(name):
                    sizes.append(o)
            sizes += [a.hidden, a.hidden]
        return sizes + [a.hidden]
    shapes = a.linear_shapes()
    per_layer = [
        n for t in w.adapted for n in (w.lora_r * shapes[t][0], w.lora_r * shapes[t][1])
    ] + _expert_trainable(w)
    return per_layer * a.layers


def adapter_bytes(w: Workload) -> int:
    """LoRA matrices (fp32). Zero for full fine-tuning: the weights term holds them."""
    return 0 if w.method == "full" else 4 * sum(trainable_tensors(w))


def grad_bytes(w: Workload) -> int:
    per = w.e if w.method == "full" else 4
    return per * sum(trainable_tensors(w))


def optimizer_bytes(w: Workload) -> int:
    """Optimizer state exactly as torch / bitsandbytes allocate it."""
    per = w.e if w.method == "full" else 4  # torch keeps moments in the parameter dtype
    total = 0
    sizes = trainable_tensors(w)
    for n in sizes:
        if w.optimizer == "adamw":
            total += 2 * per * n + 4  # exp_avg, exp_avg_sq, step tensor
        elif n < OPT8_MIN_SIZE:
            total += 2 * 4 * n  # bnb keeps small tensors in fp32 (step is a Python int)
        else:
            total += 2 * n + 2 * 4 * ceil(n / OPT8_BLOCK)
    if w.optimizer != "adamw" and any(n >= OPT8_MIN_SIZE for n in sizes):
        total += 2 * 256 * 4  # qmap1 / qmap2, shared by all tensors
    return total


# --------------------------------------------------------------------------- activations


@dataclass
class _Tally:
    """Saved-for-backward bytes, by component."""

    parts: dict[str, int] = field(default_factory=dict)

    def add(self, key: str, n: int) -> None:
        self.parts[key] = self.parts.get(key, 0) + n

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def _linear(
    w: Workload, t: _Tally, name: str, x_rg: bool, shared: set[str], group: str, din: int, T: int
) -> bool:
    """Saves of one (possibly LoRA-wrapped) Linear; returns whether its output requires grad."""
    e = w.e
    if w.method == "full":
        if group not in shared:  # the weight gradient needs the input; one copy per input
            shared.add(group)
            t.add("linear_inputs", T * din * e)
        return True
    if name not in w.adapted:
        return x_rg
    cast = e != 4  # PEFT casts the input to the fp32 adapter dtype, per module
    # Under autocast, lora_A/lora_B cast their fp32 inputs back to the compute dtype
    # and save those copies: the adapter matmuls run in 16 bits.
    lora_e = e if w.autocast else 4
    # CUDA's fused native_dropout saves a bool mask; CPU's dropout is input * (bernoulli
    # / (1 - p)), which saves that scaled mask in the input's dtype: fp32 after PEFT's cast.
    mask_bytes = 1 if w.device == "cuda" else 4
    if w.lora_dropout > 0:
        if x_rg:
            t.add("lora_inputs", T * din * mask_bytes)  # dropout runs on the fp32 cast
        t.add("lora_inputs", T * din * lora_e)  # dropped input, saved by lora_A
    elif cast:
        t.add("lora_inputs", T * din * lora_e)
    elif group not in shared:
        shared.add(group)
        t.add("lora_inputs", T * din * 4)
    t.add("lora_inputs", T * w.lora_r * lora_e)  # lora_A output, saved by lora_B
    if w.autocast:
        # autocast's cached 16-bit copies of the fp32 adapter weights, saved for the
        # input gradients: lora_B's always, lora_A's only if its input requires grad.
        dout = w.arch.linear_shapes()[name][1]
        t.add("lora_weights", w.lora_r * (dout + (din if x_rg else 0)) * e)
    return True


def _norm(w: Workload, t: _Tally, x_rg: bool, T: int) -> bool:
    """HF RMSNorm: fp32 input and rsqrt saved; the normalized tensor too if the weight
    trains (Gemma's in fp32). Gemma's forms ``1 + weight`` in fp32 at each call, which
    its product saves when the input requires grad."""
    a = w.arch
    if x_rg:  # liger's RMSNorm saves its input as it comes, with the fp32 rstd
        t.add("norms", T * a.hidden * (w.e if w.fused else 4) + T * 4)
        if a.norm_offset:
            t.add("norms", a.hidden * 4)
    if w.method == "full":
        t.add("norms", T * a.hidden * (4 if a.norm_offset else w.e))
        return True
    return x_rg


def _masked(w: Workload, layer: int) -> bool:
    """Whether SDPA gets a mask in this layer: padding, or a sliding window the sequence
    reaches (transformers drops the mask of a window longer than the sequence)."""
    a = w.arch
    return w.padded or (bool(a.sliding) and a.sliding[layer] and w.seq_len >= a.window)


def _layer_saved(w: Workload, s_rg: bool, t: _Tally, rope: set[str], layer: int) -> bool:
    """Decoder layer ``layer`` without checkpointing; returns whether its output requires
    grad. ``rope`` collects the rotary tables it uses (saved once for the model)."""
    a, e = w.arch, w.e
    b, s = w.micro_batch, w.seq_len
    T = b * s
    qd, kvd = a.heads * a.head_dim, a.kv_heads * a.head_dim
    shared: set[str] = set()
    n_rg = _norm(w, t, s_rg, T)
    if a.fused_projections:  # q, k and v are views of one output
        q = k = v = _linear(w, t, "qkv_proj", n_rg, shared, "attn_in", a.hidden, T)
    else:
        q = _linear(w, t, "q_proj", n_rg, shared, "attn_in", a.hidden, T)
        k = _linear(w, t, "k_proj", n_rg, shared, "attn_in", a.hidden, T)
        v = _linear(w, t, "v_proj", n_rg, shared, "attn_in", a.hidden, T)
    _qk_norm_saved(w, t, q, k, T)
    if q or k:  # cos/sin: the local table in Gemma 3's sliding layers
        rope.add(a.rope_table(layer))
    attn_rg = q or k or v
    masked = _masked(w, layer)
    if attn_rg:
        # SDPA keeps q, k, v, out and the fp32 logsumexp. With a mask, HF repeats
        # grouped KV heads into a copy (SDPA's native GQA needs mask=None).
        repeat = masked and 1 < a.kv_heads < a.heads
        kv_saved = qd if repeat else kvd
        # A fused projection's v is a view of its whole q|k|v output, which SDPA keeps.
        v_saved = qd + 2 * kvd if a.fused_projections and not repeat else kv_saved
        t.add("attention", T * (2 * qd + kv_saved + v_saved) * e + b * a.heads * s * 4)
        if masked:
            t.add("attention", b * s * s * e)  # the mask as SDPA's float bias, per layer
    if attn_rg and not a.fused_projections:
        # SDPA writes its output in the query's memory order, (b, s, heads, dim) after
        # Llama's rotation, so the transpose + reshape feeding o_proj is a view of the
        # saved output: no new storage. Phi-3 rotates by concatenating (b, heads, s,
        # dim) tensors, so its o_proj input is a copy.
        shared.add("o_in")
    o = _linear(w, t, "o_proj", attn_rg, shared, "o_in", qd, T)
    if a.sandwich_norms:  # Gemma's post-attention norm, on the attention's output
        o = _norm(w, t, o, T)
    s_rg = s_rg or o
    n_rg = _norm(w, t, s_rg, T)
    mlp = _experts_saved if a.experts else _mlp_saved
    m_rg = mlp(w, t, n_rg, shared, T)
    if a.sandwich_norms:  # and its post-feedforward norm
        m_rg = _norm(w, t, m_rg, T)
    return m_rg or s_rg


def _router_saved(w: Workload, t: _Tally, n_rg: bool, T: int) -> bool:
    """The router: ``F.linear`` to E logits (with LoRA, peft forms the weight and the
    input is saved), a fp32 softmax, top-k, renormalized; returns whether the top-k
    weights require grad."""
    a, e, x = w.arch, w.e, w.arch.experts
    assert x is not None
    if w.router_lora:
        t.add("router", T * a.hidden * e + x.count * a.hidden * e)
    if not (n_rg or w.router_lora):
        return False
    t.add("router", T * x.count * 4 + T * x.top_k * 8)  # softmax output, top-k indices
    if x.renormalized:  # the in-place division saves its result and the fp32 sums
        t.add("router", T * x.top_k * 4 + T * 4)
    return True


def _experts_saved(w: Workload, t: _Tally, n_rg: bool, shared: set[str], T: int) -> bool:
    """An MoE block: the router, then each token's top-k experts (``T·k`` rows in all);
    returns whether its output requires grad. NF4 experts run per routed expert with the
    LoRA factored; 16-bit ones run transformers' grouped matmul on weights peft forms."""
    a, e, x = w.arch, w.e, w.arch.experts
    assert x is not None
    R = T * x.top_k
    weighted = _router_saved(w, t, n_rg, T)
    ranks = dict(w.expert_lora)
    if not (n_rg or ranks or weighted):
        return False
    shapes = x.param_shapes(a.hidden)
    for p, r in ranks.items():
        i, o = shapes[p]
        if e != 4:  # the fp32 factors, cast to the dtype (in fp32: the adapters' own)
            t.add("experts", x.count * r * (i + o) * e)
        if w.nf4_experts:
            t.add("experts", R * r * e)  # x @ rhs_e^T, saved by @ lhs_e^T
        else:
            t.add("experts", x.count * i * o * e)  # the formed W + s·lhs@rhs
    h_rg = n_rg or "gate_up_proj" in ranks
    if "gate_up_proj" in ranks:
        t.add("experts", R * a.hidden * e)  # the routed rows
    if h_rg:
        t.add("experts", R * 3 * x.intermediate * e)  # gate|up, and silu(gate)
    if "down_proj" in ranks:
        t.add("experts", R * x.intermediate * e)  # silu(gate)·up
    y_rg = h_rg or "down_proj" in ranks
    if weighted:
        t.add("experts", R * a.hidden * e)  # each expert's output, times its weight
    if y_rg:
        t.add("experts", R * (4 if x.fp32_weights else e))  # the weights
    if w.nf4_experts:
        t.add("experts", R * 16 + (R * a.hidden * e if y_rg or weighted else 0))
    else:  # the rows' order, its inverse and the sort, and the experts' offsets
        t.add("experts", R * 3 * 8 + x.count * 4)
    return y_rg or weighted


def _qk_norm_saved(w: Workload, t: _Tally, q_rg: bool, k_rg: bool, T: int) -> None:
    """Qwen3's, OLMoE's and Gemma 3's q/k RMSNorm: each saves its fp32 input and its
    rsqrt (one a head, or one a token over all heads); the normalized tensor too when
    the weight trains."""
    a = w.arch
    if a.qk_norm == "none":
        return
    per_head = a.qk_norm == "head"
    for rg, heads in ((q_rg, a.heads), (k_rg, a.kv_heads)):
        if rg:
            t.add("attention", T * heads * a.head_dim * 4 + T * (heads if per_head else 1) * 4)
            if a.norm_offset:  # Gemma's 1 + weight, in fp32
                t.add("attention", a.head_dim * 4)
        if w.method == "full":  # the normalized tensor, for the weight's gradient
            t.add("attention", T * heads * a.head_dim * (4 if a.norm_offset else w.e))


def _mlp_saved(w: Workload, t: _Tally, n_rg: bool, shared: set[str], T: int) -> bool:
    """A dense SwiGLU MLP; returns whether its output requires grad."""
    a, e = w.arch, w.e
    if a.fused_projections:  # the activation keeps gate|up (gate is a view), the product act
        gu = _linear(w, t, "gate_up_proj", n_rg, shared, "mlp_in", a.hidden, T)
        if gu:
            t.add("mlp", T * 3 * a.intermediate * e)
        return _linear(w, t, "down_proj", gu, shared, "down_in", a.intermediate, T)
    g = _linear(w, t, "gate_proj", n_rg, shared, "mlp_in", a.hidden, T)
    u = _linear(w, t, "up_proj", n_rg, shared, "mlp_in", a.hidden, T)
    f = a.intermediate
    if g:
        t.add("mlp", T * f * e)  # silu input
    if u and not w.fused:  # liger's SwiGLU recomputes it from the gate output
        t.add("mlp", T * f * e)  # silu output, for d(product)/d(up)
    if g:
        t.add("mlp", T * f * e)  # up output, for d(product)/d(silu)
    return _linear(w, t, "down_proj", g or u, shared, "down_in", f, T)


def _head(w: Workload, t: _Tally, T: int) -> None:
    """What the LM head and the loss save."""
    a, e = w.arch, w.e
    if w.fused:
        # liger's fused linear cross-entropy computes the hidden states' gradient during
        # the forward, chunk by chunk, and saves it whole; beside it the shifted labels.
        t.add("head", T * a.hidden * e + T * 8)
        return
    if w.loss_chunk_tokens:
        # Checkpointed chunks: autograd keeps only their inputs, views of the final
        # hidden states and of the shifted int64 labels, and the divisor
        # (num_items_in_batch, an int64 scalar); each chunk's logits are recomputed.
        t.add("head", T * a.hidden * e + T * 8 + 8)
        return
    if w.method == "full":
        t.add("head", T * a.hidden * e)  # lm_head input, for its weight gradient
    t.add("head", T * a.vocab * 4 + T * 8 + 4)  # fp32 log-softmax, shifted labels, weight


def _logits(w: Workload, T: int) -> int:
    """The loss's transient in backward (plus one dequantized weight for 4/8-bit)."""
    a, e = w.arch, w.e
    c = min(w.loss_chunk_tokens, T)
    if w.fused:
        # One chunk's logits (its gradient written in place), in the compute dtype.
        peak = liger_chunk_tokens(T, a.vocab, a.hidden) * a.vocab * e
    elif c:
        # One chunk at a time: its recomputed fp32 log-probs, their gradient and the
        # fp32 logits' gradient; beside them the hidden states' gradient being gathered
        # (whole, twice, when the chunks' parts are concatenated).
        peak = max(c * a.vocab * 12 + T * a.hidden * e, 2 * T * a.hidden * e)
    else:
        # In backward the upcast fp32 logits' gradient and the log-softmax gradient live
        # together (measured: tests/test_plan_memory.py); the logits themselves (dtype)
        # too where the objective read them, while SFT drops them with the model output.
        peak = T * a.vocab * (8 + (e if w.logits_read else 0))
    if w.quant != "none":
        # bitsandbytes dequantizes one weight at a time to the compute dtype (NF4
        # experts: one expert's matrix).
        shapes = [*a.linear_shapes().values()]
        if w.nf4_experts and a.experts:
            shapes += a.experts.param_shapes(a.hidden).values()
        peak += max(i * o for i, o in shapes) * e
    return peak


def liger_chunk_tokens(tokens: int, vocab: int, hidden: int) -> int:
    """Positions per chunk of liger-kernel's fused linear cross-entropy (0.8.5,
    ``fused_linear_cross_entropy_forward``): the logits of a chunk are bounded by the
    hidden states' size, ``next_power_of_2(ceil(BT / ceil(V / H)))``, at most BT."""
    inc_factor = -(-vocab // hidden)
    per = -(-tokens // inc_factor)
    return min(1 << (per - 1).bit_length(), tokens)


def _restored(w: Workload, T: int, per_layer: int) -> tuple[int, int]:
    """With offload, what backward copies back to the device on top of the loss's and
    the layers' transients (upper bounds: a backward node frees what it restored).
    Returns (extra for the loss, the layers' transient)."""
    a, e = w.arch, w.e
    if w.loss_chunk_tokens or w.fused:
        loss = T * a.hidden * e + T * 8  # the chunks' inputs (liger: the input gradient)
    else:
        loss = T * a.vocab * 4 + T * 8  # the log-softmax and the labels
    # Checkpointing: a layer's input comes back for its recompute, whose saves stay on
    # the device. Without: at most one layer's saves are back at a time.
    layers = per_layer + (T * a.hidden * e if w.gradient_checkpointing else 0)
    return loss, layers


@dataclass(frozen=True)
class Activations:
    """Activation memory of one micro-batch."""

    saved: int  # bytes autograd holds at the end of the forward pass
    parts: dict[str, int]
    logits: int  # transient at the start of backward: logits, their grads
    recompute: int  # transient during backward with checkpointing: one layer's saves
    per_layer: int  # one (non-first) layer's saves without checkpointing
    held: int = 0  # kept alive by checkpoint closures, outside autograd's saved tensors
    host: int = 0  # of ``saved``, the bytes offloaded to host RAM (not on the device)

    @property
    def device_saved(self) -> int:
        return self.saved - self.host

    @property
    def peak(self) -> int:
        """Device bytes at the peak."""
        return self.device_saved + self.held + max(self.logits, self.recompute)


def _largest_layer(w: Workload) -> tuple[_Tally, bool]:
    """The saves of the layer that saves most (a sliding layer's mask, or a full one's)
    and whether a layer's output requires grad: what a recompute holds."""
    kinds = {w.arch.sliding[i]: i for i in range(len(w.arch.sliding))} or {False: 0}
    probes = []
    for layer in kinds.values():
        probe = _Tally()
        probes.append((probe, _layer_saved(w, True, probe, set(), layer)))
    return max(probes, key=lambda p: p[0].total)


def _held(w: Workload) -> int:
    """Under checkpointing, cos/sin (one pair a rotary table) and the bool 4D masks (the
    padding one, and a reached window's) are captured by the recompute closures rather
    than saved through autograd; they stay alive all the same."""
    a, b, s = w.arch, w.micro_batch, w.seq_len
    windowed = any(_masked(w, i) and a.sliding[i] for i in range(len(a.sliding)))
    full_layers = not a.sliding or not all(a.sliding)
    masks = int(w.padded and full_layers) + int(windowed)
    tables = len({a.rope_table(i) for i in range(a.layers)})
    return tables * 2 * s * a.rotated * w.e + masks * b * s * s


def activation_bytes(w: Workload) -> Activations:
    """Bytes saved for backward by one micro-batch, plus the backward transients."""
    a, e = w.arch, w.e
    b, s = w.micro_batch, w.seq_len
    T = b * s
    t = _Tally()
    rope: set[str] = set()
    full = w.method == "full"
    if full:
        t.add("embeddings", T * 8)  # token ids, for the embedding gradient
    # enable_input_require_grads makes the embedding output require grad under GC.
    s_rg = full or w.gradient_checkpointing
    probe, per_layer_rg = _largest_layer(w)
    held = 0
    if w.gradient_checkpointing:
        t.add("checkpoints", a.layers * T * a.hidden * e)  # each layer's input
        held = _held(w)
        s_rg = s_rg or per_layer_rg
    else:
        for layer in range(a.layers):
            s_rg = _layer_saved(w, s_rg, t, rope, layer)
    t.add("attention", len(rope) * 2 * s * a.rotated * e)  # cos, sin of each table
    _norm(w, t, s_rg, T)
    _head(w, t, T)
    logits = _logits(w, T)
    recompute = probe.total if w.gradient_checkpointing else 0
    if w.offloads:
        loss, recompute = _restored(w, T, probe.total)
        logits += loss
    return Activations(
        saved=t.total,
        parts=dict(t.parts),
        logits=logits,
        recompute=recompute,
        per_layer=probe.total,
        held=held,
        host=t.total if w.offloads else 0,
    )


def load_transient_bytes(w: Workload) -> int:
    """Host memory a CPU run's load holds beyond the loaded weights, for a moment:
    transformers materializes a stored tensor (a copy out of the memory-mapped file)
    and its conversion to ``model.dtype`` side by side. The largest such tensor is the
    embedding or the head (never quantized); checked against 7B and 8B loads
    (docs/planner.md, "host RAM"). A GPU run's load
    converts on the device one tensor at a time, inside the step peak; a stored dtype
    equal to ``model.dtype`` is mapped, not copied."""
    a = w.arch
    if w.device != "cpu" or a.checkpoint_itemsize == w.e:
        return 0
    return a.vocab * a.hidden * (a.checkpoint_itemsize + w.e)
