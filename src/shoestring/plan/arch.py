"""Model shapes the planner needs, from a ``config.json`` or a built-in preset.

Decoder-only Llama-style models (Llama, Mistral, Qwen2/3, Gemma 3): RMSNorm, rotary
attention with grouped KV heads, a gated (SwiGLU, GeGLU) MLP. That covers the popular
1B-8B models people fine-tune on small GPUs. Gemma 3's differences are modelled: its
RMSNorm scales by (1 + weight) in fp32, four norms a layer, q/k norms, and sliding-window
layers with their own rotary table; Gemma 2's soft-capped logits are refused by name.
Three mixture-of-experts families share that attention and replace every MLP by routed
SwiGLU experts (:class:`Experts`): Mixtral, Qwen3-MoE and OLMoE.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from shoestring.hf import VISION_FAMILIES, bnb_stored, vision_language_parts

#: RMSNorm of the queries and keys before RoPE: per head (Qwen3), over all heads (OLMoE).
QkNorm = Literal["none", "head", "all"]

#: The Linear layers of a Llama-style decoder layer, in forward order.
LINEARS: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
#: Phi-3's fused projections (q, k and v in one; gate and up in one), and every name a
#: target list may use (``all-linear``: those the model has).
FUSED_LINEARS: tuple[str, ...] = ("qkv_proj", "gate_up_proj")
ALL_LINEARS: tuple[str, ...] = LINEARS + FUSED_LINEARS


@dataclass(frozen=True)
class Experts:
    """The routed experts that replace the MLP of every decoder layer (transformers 5
    holds them fused: ``gate_up_proj [E, 2F, H]`` and ``down_proj [E, H, F]``), and the
    router's ``[E, H]`` weight."""

    count: int
    top_k: int
    intermediate: int  # one expert's
    renormalized: bool  # the top-k weights are divided by their sum
    fp32_weights: bool = False  # the top-k weights stay fp32 (Mixtral), not the dtype

    def param_shapes(self, hidden: int) -> dict[str, tuple[int, int]]:
        """``{parameter: (in_features, out_features)}`` of one expert's matrices."""
        return {
            "gate_up_proj": (hidden, 2 * self.intermediate),
            "down_proj": (self.intermediate, hidden),
        }

    def params_per_layer(self, hidden: int) -> int:
        return self.count * (3 * hidden * self.intermediate + hidden)


@dataclass(frozen=True)
class Tower:
    """A vision tower and its projector beside the decoder (Gemma 3 from 4B up). Text
    batches never run it and no adapter goes on it, so it costs its weights only.
    ``linears``: ``(in, out)`` of its ``nn.Linear`` layers, each with a bias (kept in the
    dtype under ``lora.quantize``, as finetune loads it); ``other``: every other parameter
    (patch convolution, position embeddings, layer norms, the projector)."""

    linears: tuple[tuple[int, int], ...]
    other: int
    patches: int  # its ``position_ids`` buffer: one int64 a patch

    @property
    def buffer_bytes(self) -> int:
        return 8 * self.patches

    @property
    def params(self) -> int:
        return sum(i * o + o for i, o in self.linears) + self.other


def siglip_tower(vision: Mapping[str, Any], text_hidden: int, name: str) -> Tower:
    """Gemma 3's SigLIP encoder (no pooling head) and its projector (a ``[h, hidden]``
    matrix and an RMSNorm), counted from ``vision_config``."""
    if vision.get("model_type") != "siglip_vision_model" or vision.get("vision_use_head", True):
        raise Unmodelled(
            f"{name}: a vision tower of type {vision.get('model_type')!r} (pooling head: "
            f"{vision.get('vision_use_head', True)}); the planner models Gemma 3's SigLIP "
            "encoder without a head"
        )
    h, f, n = (
        int(vision["hidden_size"]),
        int(vision["intermediate_size"]),
        int(vision["num_hidden_layers"]),
    )
    patch, side = int(vision["patch_size"]), int(vision["image_size"])
    per_layer = ((h, h),) * 4 + ((h, f), (f, h))  # q, k, v, out; fc1, fc2
    conv = int(vision.get("num_channels", 3)) * patch * patch * h + h
    patches = (side // patch) ** 2
    norms = (4 * n + 2) * h  # two LayerNorms a layer and one after, weight and bias
    return Tower(per_layer * n, conv + patches * h + norms + h * text_hidden + h, patches)


@dataclass(frozen=True)
class Arch:
    """Shape of a Llama-style causal LM."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tie_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    mlp_bias: bool = False
    checkpoint_itemsize: int = 2  # bytes per weight as stored (bf16/fp16; fp32: 4)
    prequantized: str = "none"  # a bitsandbytes checkpoint (*-bnb-4bit): nf4 | int8
    qk_norm: QkNorm = "none"
    experts: Experts | None = None  # a mixture of experts: no dense MLP linears
    norm_offset: bool = False  # RMSNorm scales by (1 + weight), in fp32 (Gemma)
    sandwich_norms: bool = False  # a norm after the attention and the MLP too (Gemma 2/3)
    window: int = 0  # the sliding window's span in tokens (0: every layer sees all)
    sliding: tuple[bool, ...] = ()  # per layer: attends through the window
    local_rope: bool = False  # sliding layers rotate by their own cos/sin (Gemma 3)
    scaled_embeddings: bool = False  # the embedding scaled by a stored sqrt(hidden) (Gemma)
    family: str = ""  # config.json's model_type ("": a preset or the built-in model)
    fused_projections: bool = False  # qkv_proj and gate_up_proj (Phi-3, Phi-4-mini)
    rotary_dim: int = 0  # features each head rotates (0: all; Phi-4-mini: 3/4 of them)
    tower: Tower | None = None  # a vision tower beside the decoder, never run on text

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``{name: (in_features, out_features)}`` of the ``nn.Linear`` layers of one
        decoder layer (an MoE layer's experts are not among them)."""
        h, f, q, kv = (
            self.hidden,
            self.intermediate,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
        )
        if self.fused_projections:
            return {"qkv_proj": (h, q + 2 * kv), "o_proj": (q, h), "gate_up_proj": (h, 2 * f),
                    "down_proj": (f, h)}  # fmt: skip
        attention = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
        if self.experts:
            return attention
        return {**attention, "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}

    @property
    def rotated(self) -> int:
        """Features of each head that RoPE rotates (its cos/sin tables' width)."""
        return self.rotary_dim or self.head_dim

    def rope_table(self, layer: int) -> str:
        """The rotary table layer ``layer`` rotates by."""
        return "local" if self.local_rope and self.sliding and self.sliding[layer] else "global"

    @property
    def qk_norm_width(self) -> int:
        """Weights of the q and k norms of one layer."""
        if self.qk_norm == "head":
            return 2 * self.head_dim
        return (self.heads + self.kv_heads) * self.head_dim if self.qk_norm == "all" else 0

    def linear_bias(self, name: str) -> bool:
        if name in ("q_proj", "k_proj", "v_proj"):
            return self.attention_bias
        return self.mlp_bias if name in ("gate_proj", "up_proj", "down_proj") else False

    @property
    def params(self) -> int:
        """Total parameter count."""
        per_layer = (
            sum(
                i * o + (o if self.linear_bias(n) else 0)
                for n, (i, o) in self.linear_shapes().items()
            )
            + (4 if self.sandwich_norms else 2) * self.hidden
            + self.qk_norm_width
            + (self.experts.params_per_layer(self.hidden) if self.experts else 0)
        )
        emb = self.vocab * self.hidden
        tower = self.tower.params if self.tower else 0
        return (
            self.layers * per_layer + self.hidden + emb * (1 if self.tie_embeddings else 2) + tower
        )

    @property
    def active_params(self) -> int:
        """Parameters a token is computed with: a mixture of experts counts its top-k,
        and a vision tower none."""
        x, tower = self.experts, self.tower.params if self.tower else 0
        if x is None:
            return self.params - tower
        idle = (x.count - x.top_k) * 3 * self.hidden * x.intermediate
        return self.params - tower - self.layers * idle


#: The keys a mixture-of-experts config counts its routed experts by (Qwen2/3-MoE and
#: OLMoE; Mixtral and gpt-oss; DeepSeek).
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def experts_of(cfg: Mapping[str, Any]) -> int:
    """How many routed experts an MoE layer of this config has (0: a dense model)."""
    counts = [int(cfg.get(k) or 0) for k in EXPERT_KEYS]
    return max(counts) if max(counts) > 1 else 0


class Unmodelled(ValueError):
    """A config whose memory the planner does not model (it says why)."""


class MixtureOfExperts(Unmodelled):
    """A mixture-of-experts config the planner does not model."""


#: The mixture-of-experts families modelled: the key of one expert's intermediate size,
#: and their routers (softmax, top-k, renormalized always or by ``norm_topk_prob``; the
#: weights left in fp32 or cast to the dtype).
MOE_FAMILIES: dict[str, tuple[str, bool | None, bool]] = {
    "mixtral": ("intermediate_size", True, True),
    "qwen3_moe": ("moe_intermediate_size", None, False),
    "olmoe": ("intermediate_size", None, False),
}
#: Attention with q/k RMSNorm: per head, or over all heads' features.
QK_NORMS: dict[str, QkNorm] = {
    "qwen3": "head",
    "qwen3_moe": "head",
    "olmoe": "all",
    "gemma3_text": "head",
}
#: The families whose tensors the tests check to the byte on tiny models; any other
#: model_type is planned as the Llama-style layer it is assumed to be, and says so.
CHECKED_FAMILIES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "mixtral", "qwen3_moe",
     "olmoe"}
)  # fmt: skip
#: Families whose projections are fused (one q/k/v linear, one gate/up linear).
FUSED_FAMILIES = frozenset({"phi3"})
#: Families whose RMSNorm scales by (1 + weight), in fp32; and of those, the ones with a
#: norm after the attention and after the MLP as well (four a layer).
OFFSET_NORMS = frozenset({"gemma", "gemma2", "gemma3_text"})
SANDWICH_NORMS = frozenset({"gemma2", "gemma3_text"})


def _window(cfg: Mapping[str, Any], layers: int) -> tuple[int, tuple[bool, ...]]:
    """The sliding window and which layers attend through it: ``layer_types`` where
    the config lists them (Gemma 3, Qwen2/3), or ``sliding_window_pattern`` (Gemma 3
    before them), else every layer (Mistral v0.1)."""
    span = int(cfg.get("sliding_window") or 0)
    if not span or cfg.get("use_sliding_window") is False:
        return 0, ()
    types = cfg.get("layer_types")
    # Gemma 3 configs written before layer_types: every n-th layer full
    every = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 0)
    if types:
        sliding = tuple(t == "sliding_attention" for t in types)
    elif every:
        sliding = tuple((i + 1) % every != 0 for i in range(layers))
    else:
        sliding = (True,) * layers
    return (span, sliding) if any(sliding) else (0, ())


def _check_softcapping(cfg: Mapping[str, Any], name: str) -> None:
    """Gemma 2's attention logit soft-capping makes transformers run eager attention,
    whose saved probabilities (and the capped logits') the planner does not count."""
    capped = [k for k in ("attn_logit_softcapping", "final_logit_softcapping") if cfg.get(k)]
    if capped:
        raise Unmodelled(
            f"{name}: {', '.join(capped)} set ({cfg.get('model_type')}): soft-capped logits "
            "run through eager attention, whose saved probabilities the planner does not "
            "model; it models Llama, Mistral, Qwen2/3, Gemma 3 and their MoE kin"
        )


def _experts(cfg: Mapping[str, Any], name: str) -> Experts | None:
    count = experts_of(cfg)
    if not count:
        return None
    family = str(cfg.get("model_type") or "")
    if family not in MOE_FAMILIES:
        raise MixtureOfExperts(
            f"{name}: a mixture-of-experts model ({family or 'no model_type'}, {count} experts "
            f"a layer); the planner models {', '.join(sorted(MOE_FAMILIES))}, whose every "
            "layer routes to SwiGLU experts without a shared expert"
        )
    sparse_step = int(cfg.get("decoder_sparse_step") or 1)
    if cfg.get("mlp_only_layers") or sparse_step != 1:
        raise MixtureOfExperts(
            f"{name}: mlp_only_layers / decoder_sparse_step {sparse_step}: some layers are "
            "dense; the planner models a mixture of experts whose every layer is sparse"
        )
    key, renormalized, fp32_weights = MOE_FAMILIES[family]
    return Experts(
        count=count,
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate=int(cfg[key]),
        renormalized=bool(cfg.get("norm_topk_prob")) if renormalized is None else renormalized,
        fp32_weights=fp32_weights,
    )


def from_hf_config(cfg: Mapping[str, Any], name: str = "config.json") -> Arch:
    """An :class:`Arch` from a Hugging Face ``config.json`` dict; a mixture-of-experts
    family outside :data:`MOE_FAMILIES` is refused (:class:`MixtureOfExperts`): counting
    it as the dense model its attention describes would leave out its experts; so is a
    vision-language family outside :data:`VISION_FAMILIES`."""
    if "vision_config" in cfg:
        return _with_tower(cfg, name)
    return _decoder(cfg, name)


def _with_tower(cfg: Mapping[str, Any], name: str) -> Arch:
    """A vision-language checkpoint fine-tuned on text: its decoder, and its tower's
    weights (every key filled by transformers: :func:`shoestring.hf.vision_language_parts`)."""
    family = str(cfg.get("model_type") or "")
    if family not in VISION_FAMILIES:
        raise Unmodelled(
            f"{name}: a vision-language model ({family or 'no model_type'}); the planner "
            f"models {', '.join(sorted(VISION_FAMILIES))} (a text decoder beside a tower)"
        )
    text, vision = vision_language_parts(cfg)
    for key in ("torch_dtype", "dtype", "quantization_config"):  # stated once, at the top
        if cfg.get(key) is not None:
            text[key] = cfg[key]
    arch = _decoder(text, name)
    return replace(arch, tower=siglip_tower(vision, arch.hidden, name))


def _decoder(cfg: Mapping[str, Any], name: str) -> Arch:
    family = str(cfg.get("model_type") or "")
    _check_softcapping(cfg, name)
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        window, sliding = _window(cfg, int(cfg["num_hidden_layers"]))
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        return Arch(
            name=name,
            hidden=hidden,
            intermediate=int(cfg["intermediate_size"]),
            layers=int(cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            vocab=int(cfg["vocab_size"]),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            checkpoint_itemsize=4
            if str(cfg.get("torch_dtype") or cfg.get("dtype") or "") == "float32"
            else 2,
            prequantized=bnb_stored(cfg),
            qk_norm=QK_NORMS.get(family, "none"),
            experts=_experts(cfg, name),
            norm_offset=family in OFFSET_NORMS,
            sandwich_norms=family in SANDWICH_NORMS,
            window=window,
            sliding=sliding,
            local_rope=family == "gemma3_text",
            scaled_embeddings=family in OFFSET_NORMS,
            family=family,
            fused_projections=family in FUSED_FAMILIES,
            rotary_dim=int(head_dim * float(cfg.get("partial_rotary_factor") or 1.0)),
        )
    except KeyError as e:
        raise ValueError(
            f"{name}: missing {e.args[0]!r}; the planner needs a Llama-style "
            "decoder config (hidden_size, intermediate_size, num_hidden_layers, "
            "num_attention_heads, vocab_size)"
        ) from None


def _preset(name: str, **kw: Any) -> Arch:
    return Arch(name=name, **kw)


#: Popular 7B-8B architectures (shapes from each model's published config.json).
PRESETS: dict[str, Arch] = {
    a.name: a
    for a in (
        _preset(
            "llama-2-7b",
            hidden=4096,
            intermediate=11008,
            layers=32,
            heads=32,
            kv_heads=32,
            head_dim=128,
            vocab=32000,
        ),
        _preset(
            "llama-3-8b",
            hidden=4096,
            intermediate=14336,
            layers=32,
            heads=32,
            kv_heads=8,
            head_dim=128,
            vocab=128256,
        ),
        _preset(
            "mistral-7b",
            hidden=4096,
            intermediate=14336,
            layers=32,
            heads=32,
            kv_heads=8,
            head_dim=128,
            vocab=32768,
        ),
        _preset(
            "qwen2.5-7b",
            hidden=3584,
            intermediate=18944,
            layers=28,
            heads=28,
            kv_heads=4,
            head_dim=128,
            vocab=152064,
            attention_bias=True,
        ),
        _preset(
            "gemma-7b",
            hidden=3072,
            intermediate=24576,
            layers=28,
            heads=16,
            kv_heads=16,
            head_dim=256,
            vocab=256000,
            tie_embeddings=True,
            norm_offset=True,  # Gemma's RMSNorm and embedding scale (no sandwich norms)
            scaled_embeddings=True,
            family="gemma",
        ),
    )
}
PRESETS["llama-3.1-8b"] = replace(PRESETS["llama-3-8b"], name="llama-3.1-8b")
#: The 70B that FSDP-QLoRA shards over a few small GPUs (Llama-3-70B's config.json).
PRESETS["llama-3-70b"] = _preset(
    "llama-3-70b",
    hidden=8192,
    intermediate=28672,
    layers=80,
    heads=64,
    kv_heads=8,
    head_dim=128,
    vocab=128256,
)


def load_arch(spec: str) -> Arch:
    """A preset name, a model directory holding ``config.json``, or a ``config.json`` path."""
    if spec in PRESETS:
        return PRESETS[spec]
    p = Path(spec).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(
            f"{spec!r} is neither a preset ({', '.join(sorted(PRESETS))}) "
            "nor a model directory with config.json"
        )
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}:{e.lineno}: invalid JSON: {e.msg}") from None
    return from_hf_config(cfg, str(p))
