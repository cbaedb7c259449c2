"""What llama.cpp expects of a Llama-, Mistral-, Qwen2- or Qwen3-family GGUF (Qwen3-MoE too), as its
``convert_hf_to_gguf.py`` writes one: the architecture's hyperparameter keys, each
tensor's GGUF name (gguf's own ``TensorNameMap``), an MoE layer's experts stacked per
projection (transformers' fused ``gate_up_proj`` split into gate and up), the q/k row
permutation of LLAMA (llama.cpp computes rotary
embeddings on interleaved pairs, Hugging Face's Llama on halves; Qwen2 is NEOX-style in
llama.cpp and is not permuted), and the type each tensor is stored in (1-D tensors, norms
and biases stay F32; the rest f16/bf16/q8_0; q8_0 falls back to f16 for rows that are not
a multiple of its 32-value block). Llama 3.1/3.2's ``llama3`` RoPE goes in as
llama.cpp's converter writes it (``LlamaModel.generate_extra_tensors``): no
``rope.scaling`` keys, and an F32 ``rope_freqs.weight`` of ``head_dim / 2`` factors by
which llama.cpp divides each default rotary frequency.

Everything here is decided from ``config.json`` and tensor names and shapes alone, so a
model llama.cpp would not run as we write it is refused before training starts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shoestring.config import ConfigError
from shoestring.hf import VISION_FAMILIES, vision_language_parts
from shoestring.train.config import GgufType
from shoestring.train.ggufphi3 import add_phi3_hparams, check_phi3, rope_factor_tables

if TYPE_CHECKING:
    import gguf

GGUF_HINT = "needs the gguf package: pip install 'shoestring[gguf]'"

#: config.json ``model_type`` -> gguf's ``MODEL_ARCH`` member name, and whether q/k are
#: permuted (``LlamaModel.modify_tensors`` in convert_hf_to_gguf.py).
ARCHS: dict[str, tuple[str, bool]] = {
    "llama": ("LLAMA", True),
    "mistral": ("LLAMA", True),  # convert registers MistralForCausalLM as a LlamaModel
    "qwen2": ("QWEN2", False),
    "qwen3": ("QWEN3", False),  # Qwen2's, with q/k norms and no biases
    "qwen3_moe": ("QWEN3MOE", False),  # Qwen3's attention, every MLP a mixture of experts
    "gemma3_text": ("GEMMA3", False),  # Gemma 3 270M/1B: NEOX rotary, norms stored + 1
    "phi3": ("PHI3", False),  # Phi-3/3.5-mini, Phi-4-mini: fused projections kept fused
}
#: RoPE variants written as llama.cpp's convert does, per model_type (default: no scaling
#: keys; linear: ``rope.scaling.type``/``factor``; llama3: the ``rope_freqs`` tensor).
ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "llama": ("default", "linear", "llama3"),
    "mistral": ("default", "linear"),
    "qwen2": ("default", "linear"),
    "qwen3": ("default", "linear"),
    "qwen3_moe": ("default", "linear"),
    "gemma3_text": ("default", "linear"),
    "phi3": ("default", "longrope"),
}


def require_gguf(key: str) -> Any:
    """Import gguf lazily; missing is a config error naming ``key``."""
    try:
        import gguf
    except ImportError as e:
        raise ConfigError(f"{key}: {GGUF_HINT}") from e
    return gguf


def read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    try:
        cfg: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read the model's config: {e}") from e
    return text_config(cfg)


def text_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The config of the text model a GGUF holds (llama.cpp's converter writes a
    vision-language model's text model; its tower would go to a separate mmproj file):
    ``cfg`` itself, or the filled ``text_config`` of a :data:`VISION_FAMILIES` one."""
    if cfg.get("model_type") not in VISION_FAMILIES or "text_config" not in cfg:
        return dict(cfg)
    return vision_language_parts(cfg)[0]


def rope_parameters(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """transformers 5 writes ``rope_parameters`` (per layer type where they differ: the
    full-attention layers' are the model's); older files ``rope_theta``/``rope_scaling``."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if isinstance(params.get("full_attention"), Mapping):
        params = dict(params["full_attention"])
    params.setdefault("rope_type", params.get("type", "default"))
    if "rope_theta" not in params and "rope_theta" in cfg:
        params["rope_theta"] = cfg["rope_theta"]
    return params


def check_arch(cfg: Mapping[str, Any], key: str) -> str:
    """The model's ``model_type`` if llama.cpp's LLAMA (Llama, Mistral)/QWEN2/QWEN3/QWEN3MOE
    export of it is ours to write."""
    model_type = str(cfg.get("model_type"))
    if model_type not in ARCHS:
        raise ConfigError(
            f"{key}: model_type {model_type!r} has no GGUF export here "
            f"(supported: {', '.join(sorted(ARCHS))})"
        )
    dense = cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) != 1
    if model_type == "qwen3_moe" and dense:
        raise ConfigError(
            f"{key}: this qwen3_moe has dense MLP layers among its expert layers "
            "(mlp_only_layers / decoder_sparse_step), which llama.cpp's QWEN3MOE does not "
            "read; not exported to GGUF"
        )
    _check_window(cfg, model_type, key)
    if model_type == "gemma3_text":
        check_gemma3(cfg, key)
    if model_type == "phi3":
        check_phi3(cfg, key)
    rope = rope_parameters(cfg)["rope_type"]
    if rope not in ROPE_TYPES[model_type]:
        raise ConfigError(
            f"{key}: {model_type} with RoPE type {rope!r} is not exported to GGUF yet "
            f"(supported: {', '.join(ROPE_TYPES[model_type])})"
        )
    return model_type


def _check_window(cfg: Mapping[str, Any], model_type: str, key: str) -> None:
    """llama.cpp's LLAMA attends over the whole context: a Mistral whose attention is
    windowed (7B v0.1: 4096 tokens) would compute another model past the window."""
    window = cfg.get("sliding_window")
    if model_type == "mistral" and window and int(window) < int(cfg["max_position_embeddings"]):
        raise ConfigError(
            f"{key}: this mistral attends through a sliding window of {window} tokens "
            "(config.json sliding_window), which llama.cpp's LLAMA architecture does not "
            f"apply: past {window} tokens the GGUF would compute another model; not exported "
            "(Mistral 7B v0.2 and later have no window)"
        )


def gemma3_pattern(layers: int) -> list[str]:
    """llama.cpp's Gemma 3 layers: every sixth attends to all, the rest through the
    window (``set_swa_pattern(6)``, fixed in its loader, not read from the file)."""
    return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]


def _local_theta(cfg: Mapping[str, Any]) -> float:
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention")
    if isinstance(local, Mapping):
        return float(local.get("rope_theta", 10000.0))
    return float(cfg.get("rope_local_base_freq", 10000.0))


def check_gemma3(cfg: Mapping[str, Any], key: str) -> None:
    """What llama.cpp's GEMMA3 fixes rather than reads: the layer pattern, the local
    layers' rotary base (10000) and the attention scale (1/sqrt(head_dim)); a config
    that differs would run as another model."""
    layers, types = int(cfg["num_hidden_layers"]), cfg.get("layer_types")
    wrong = []
    every = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
    if (types and list(types) != gemma3_pattern(layers)) or int(every) != 6:
        wrong.append("layer_types (llama.cpp: every sixth layer full, the rest sliding)")
    if _local_theta(cfg) != 10000.0:
        wrong.append(f"the sliding layers' rope_theta {_local_theta(cfg)} (llama.cpp: 10000)")
    if int(cfg.get("query_pre_attn_scalar") or head_dim(cfg)) != head_dim(cfg):
        wrong.append("query_pre_attn_scalar (llama.cpp scales by 1/sqrt(head_dim))")
    if any(cfg.get(k) for k in ("attn_logit_softcapping", "final_logit_softcapping")):
        wrong.append("logit soft-capping")
    if wrong:
        raise ConfigError(
            f"{key}: this gemma3_text differs from what llama.cpp's GEMMA3 assumes: "
            f"{'; '.join(wrong)}; not exported to GGUF"
        )


def head_dim(cfg: Mapping[str, Any]) -> int:
    hd = cfg.get("head_dim")
    return int(hd) if hd else int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])


def add_hparams(writer: gguf.GGUFWriter, cfg: Mapping[str, Any]) -> None:
    """``TextModel.set_gguf_parameters`` (+ ``LlamaModel``'s vocab and rope keys)."""
    import gguf

    writer.add_block_count(int(cfg["num_hidden_layers"]))
    writer.add_context_length(int(cfg["max_position_embeddings"]))
    writer.add_embedding_length(int(cfg["hidden_size"]))
    writer.add_feed_forward_length(int(cfg["intermediate_size"]))
    writer.add_head_count(int(cfg["num_attention_heads"]))
    writer.add_head_count_kv(int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    rope = rope_parameters(cfg)
    if "rope_theta" in rope:
        writer.add_rope_freq_base(float(rope["rope_theta"]))
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    # llama3: no rope.scaling keys (convert writes none); its factors are rope_freqs.
    if cfg.get("head_dim"):
        writer.add_key_length(int(cfg["head_dim"]))
        writer.add_value_length(int(cfg["head_dim"]))
    if cfg["model_type"] == "gemma3_text":  # Gemma3Model.set_gguf_parameters
        writer.add_sliding_window(int(cfg["sliding_window"]))
    if cfg["model_type"] == "phi3":
        add_phi3_hparams(writer, cfg)
    if ARCHS[cfg["model_type"]][0] == "LLAMA":
        writer.add_vocab_size(int(cfg["vocab_size"]))
        writer.add_rope_dimension_count(head_dim(cfg))
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")  # as transformers 5 / Hub
    if experts:  # Qwen2MoeModel.set_gguf_parameters
        writer.add_expert_count(int(experts))
        writer.add_expert_used_count(int(cfg["num_experts_per_tok"]))
        writer.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """``LlamaModel.permute``: each head's rows from halves to interleaved pairs."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def row_transform(
    name: str, cfg: Mapping[str, Any]
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What a tensor goes through on its way into the file: a LLAMA q/k projection's
    row permutation; a Gemma 3 norm weight plus one (llama.cpp multiplies by the stored
    weight, transformers by ``1 + weight``, in fp32); None for the rest."""
    if cfg["model_type"] == "gemma3_text" and name.endswith("norm.weight"):
        return lambda w: w.float() + 1.0
    if not ARCHS[cfg["model_type"]][1]:
        return None
    n_head = int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_head)
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return lambda w: permute_qk(w, n_head)
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return lambda w: permute_qk(w, n_kv)
    return None


@dataclass(frozen=True)
class TensorPlan:
    """One tensor as it goes into the file: the merge plan's ``hf_name``, or (a tensor
    the converter adds, e.g. ``rope_freqs``) its own ``form``."""

    hf_name: str
    name: str
    shape: tuple[int, ...]
    qtype: gguf.GGMLQuantizationType
    transform: Callable[[torch.Tensor], torch.Tensor] | None
    form: Callable[[], torch.Tensor] | None = None
    part: Callable[[torch.Tensor], torch.Tensor] | None = None  # of the formed tensor

    @property
    def nbytes(self) -> int:
        import gguf

        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        n = 1
        for d in self.shape:
            n *= d
        return n // block * size


#: ``export.gguf`` -> (the ggml type of the big tensors, llama.cpp's file type).
FILE_TYPES: dict[GgufType, tuple[str, str]] = {
    "f16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
}


def tensor_type(
    gguf_name: str, shape: tuple[int, ...], kind: GgufType
) -> gguf.GGMLQuantizationType:
    """convert_hf_to_gguf's ``prepare_tensors`` rule for these three file types."""
    import gguf

    q = gguf.GGMLQuantizationType
    if len(shape) <= 1 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight"):
        return q.F32
    qtype = q[FILE_TYPES[kind][0]]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    return qtype if shape[-1] % block == 0 else q.F16


#: Makes one of the file's tensors from a formed (merged) one: a slice of it.
Part = Callable[[torch.Tensor], torch.Tensor]


def plan_tensors(
    names: gguf.TensorNameMap,
    cfg: Mapping[str, Any],
    hf_name: str,
    shape: tuple[int, ...],
    kind: GgufType,
    text_name: str | None = None,
) -> list[TensorPlan]:
    """The file's tensors made of the merge plan's ``hf_name`` (named as the text model
    names it, ``text_name``, where the model is a vision-language one): itself, or an
    MoE layer's fused experts as llama.cpp stacks them (:func:`expert_parts`)."""
    out = []
    for part_name, part_shape, part in expert_parts(text_name or hf_name, shape):
        name = names.get_name(part_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise NotImplementedError(f"GGUF export: no llama.cpp name for tensor {hf_name!r}")
        qtype = tensor_type(name, part_shape, kind)
        transform = row_transform(hf_name, cfg)
        out.append(TensorPlan(hf_name, name, part_shape, qtype, transform, part=part))
    return out


def expert_parts(
    hf_name: str, shape: tuple[int, ...]
) -> list[tuple[str, tuple[int, ...], Part | None]]:
    """transformers 5's fused experts as convert_hf_to_gguf.py writes the per-expert
    tensors it stacks: ``experts.gate_up_proj`` (experts, 2 x ffn, hidden; gate first)
    as ``ffn_gate_exps`` and ``ffn_up_exps`` (experts, ffn, hidden) each, ``experts.
    down_proj`` (experts, hidden, ffn) as ``ffn_down_exps``; any other tensor as itself."""
    prefix, _, last = hf_name.rpartition("mlp.experts.")
    if not prefix or last not in ("gate_up_proj", "down_proj"):
        return [(hf_name, shape, None)]
    base = f"{prefix}mlp.experts."
    if last == "down_proj":
        return [(f"{base}down_proj.weight", shape, None)]
    ffn = shape[1] // 2
    half = (shape[0], ffn, *shape[2:])
    return [
        (f"{base}gate_proj.weight", half, lambda t: t[:, :ffn]),
        (f"{base}up_proj.weight", half, lambda t: t[:, ffn:]),
    ]


def name_map(cfg: Mapping[str, Any]) -> gguf.TensorNameMap:
    import gguf

    arch = gguf.MODEL_ARCH[ARCHS[cfg["model_type"]][0]]
    return gguf.get_tensor_name_map(arch, int(cfg["num_hidden_layers"]))


def arch_name(cfg: Mapping[str, Any]) -> str:
    import gguf

    return gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[ARCHS[cfg["model_type"]][0]]]


def original_context(cfg: Mapping[str, Any], rope: Mapping[str, Any]) -> int:
    """The pretraining context llama3 RoPE scales from, by transformers' rule
    (``standardize_rope_params``): top-level, else in the RoPE dict, else
    ``max_position_embeddings``. Llama 3.1/3.2 give 8192 in the RoPE dict, which is also
    llama.cpp's default."""
    for found in (
        cfg.get("original_max_position_embeddings"),
        rope.get("original_max_position_embeddings"),
    ):
        if found:
            return int(found)
    return int(cfg["max_position_embeddings"])


def llama3_rope_factors(cfg: Mapping[str, Any]) -> torch.Tensor:
    """``LlamaModel.generate_extra_tensors``: per rotary frequency, the factor llama.cpp
    divides it by (1 for wavelengths under ``old_context / high_freq_factor``, ``factor``
    over ``old_context / low_freq_factor``, smoothly in between): transformers'
    ``default_inv_freq / llama3_inv_freq``."""
    rope = rope_parameters(cfg)
    dim = head_dim(cfg)
    base = float(rope.get("rope_theta", 10000.0))
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old_context = original_context(cfg, rope)
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def _constant(name: str, t: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> TensorPlan:
    return TensorPlan("", name, tuple(t.shape), qtype, None, lambda: t)


def extra_tensors(cfg: Mapping[str, Any]) -> list[TensorPlan]:
    """Tensors llama.cpp's converter adds ahead of the model's own (``rope_freqs`` for
    llama3 RoPE, LongRoPE's factor tables), F32 as it stores them."""
    import gguf

    f32 = gguf.GGMLQuantizationType.F32
    if cfg["model_type"] == "phi3":
        return [_constant(n, t, f32) for n, t in rope_factor_tables(cfg)]
    if rope_parameters(cfg)["rope_type"] != "llama3":
        return []
    factors = llama3_rope_factors(cfg)
    name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
    return [TensorPlan("", name, tuple(factors.shape), f32, None, lambda: factors)]
