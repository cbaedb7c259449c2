"""Model shapes the planner needs, from a ``config.json`` or a built-in preset.

Only decoder-only Llama-style models (Llama, Mistral, Qwen2, Gemma-like shapes)
are described: RMSNorm, rotary attention with grouped KV heads, a gated (SwiGLU)
MLP. That covers the popular 7B-8B models people fine-tune on small GPUs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shoestring.hf import bnb_stored

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

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``{name: (in_features, out_features)}`` for one decoder layer."""
        h, f, q, kv = (
            self.hidden,
            self.intermediate,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
        )
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, f),
            "up_proj": (h, f),
            "down_proj": (f, h),
        }

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
            + 2 * self.hidden
        )
        emb = self.vocab * self.hidden
        return self.layers * per_layer + self.hidden + emb * (1 if self.tie_embeddings else 2)


#: The keys a mixture-of-experts config counts its routed experts by (Qwen2/3-MoE and
#: OLMoE; Mixtral and gpt-oss; DeepSeek).
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def experts_of(cfg: Mapping[str, Any]) -> int:
    """How many routed experts an MoE layer of this config has (0: a dense model)."""
    counts = [int(cfg.get(k) or 0) for k in EXPERT_KEYS]
    return max(counts) if max(counts) > 1 else 0


class MixtureOfExperts(ValueError):
    """A config the planner does not model: its experts are in none of its figures."""


def from_hf_config(cfg: Mapping[str, Any], name: str = "config.json") -> Arch:
    """An :class:`Arch` from a Hugging Face ``config.json`` dict; a mixture-of-experts
    config is refused (:class:`MixtureOfExperts`): counting it as the dense model its
    attention describes would leave out nearly all its weights."""
    experts = experts_of(cfg)
    if experts:
        raise MixtureOfExperts(
            f"{name}: a mixture-of-experts model ({experts} experts a layer); the planner "
            "models dense decoders only, and would leave its experts (nearly all its "
            "weights) out of every figure; measured MoE runs: benchmarks/README.md"
        )
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return Arch(
            name=name,
            hidden=hidden,
            intermediate=int(cfg["intermediate_size"]),
            layers=int(cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab=int(cfg["vocab_size"]),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            checkpoint_itemsize=4
            if str(cfg.get("torch_dtype") or cfg.get("dtype") or "") == "float32"
            else 2,
            prequantized=bnb_stored(cfg),
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
