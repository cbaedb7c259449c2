"""What llama.cpp's PHI3 reads beyond the common keys (Phi-3-mini, Phi-3.5-mini,
Phi-4-mini), as ``convert_hf_to_gguf.py``'s ``Phi3MiniModel`` writes it: the rotated
features per head (``rope.dimension_count``: ``partial_rotary_factor`` of them), the
pretraining context LongRoPE scales from, the sliding window (0: none, which is how
llama.cpp tells Phi-4 apart), and for LongRoPE its attention factor and the long and
short factor tables as F32 tensors. The fused ``qkv_proj`` and ``gate_up_proj`` are
stored as they are (``attn_qkv``, ``ffn_up``), and the rotation is NEOX-style: nothing
is permuted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from shoestring.config import ConfigError

if TYPE_CHECKING:
    import gguf


def _rope(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """transformers 5's ``rope_parameters``, or an older file's ``rope_scaling``."""
    return dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})


def rope_dims(cfg: Mapping[str, Any]) -> int:
    share = float(cfg.get("partial_rotary_factor") or _rope(cfg).get("partial_rotary_factor", 1.0))
    return int(share * int(cfg["hidden_size"])) // int(cfg["num_attention_heads"])


def _original_context(cfg: Mapping[str, Any]) -> int:
    found = cfg.get("original_max_position_embeddings") or _rope(cfg).get(
        "original_max_position_embeddings"
    )
    return int(found or cfg["max_position_embeddings"])


def _longrope(cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    rope = _rope(cfg)
    kind = str(rope.get("rope_type", rope.get("type", "default"))).lower()
    return rope if kind in ("longrope", "su") else None


def check_phi3(cfg: Mapping[str, Any], key: str) -> None:
    """LongRoPE's tables must cover each rotated pair, as the converter requires."""
    rope = _longrope(cfg)
    if rope is None:
        return
    want = rope_dims(cfg) // 2
    long, short = rope.get("long_factor") or [], rope.get("short_factor") or []
    if len(long) != want or len(short) != want:
        raise ConfigError(
            f"{key}: this phi3's LongRoPE factors ({len(long)} long, {len(short)} short) do "
            f"not cover its {want} rotated pairs; not exported to GGUF"
        )


def add_phi3_hparams(writer: gguf.GGUFWriter, cfg: Mapping[str, Any]) -> None:
    """``Phi3MiniModel.set_gguf_parameters`` beyond the common keys."""
    writer.add_rope_dimension_count(rope_dims(cfg))
    writer.add_rope_scaling_orig_ctx_len(_original_context(cfg))
    writer.add_sliding_window(int(cfg.get("sliding_window") or 0))
    if _longrope(cfg) is not None:
        scale = int(cfg["max_position_embeddings"]) / _original_context(cfg)
        attn = math.sqrt(1 + math.log(scale) / math.log(_original_context(cfg)))
        writer.add_rope_scaling_attn_factors(attn if scale > 1.0 else 1.0)


def rope_factor_tables(cfg: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """``rope_factors_long`` and ``rope_factors_short`` (F32), for LongRoPE."""
    import gguf

    rope = _longrope(cfg)
    if rope is None:
        return []
    names = gguf.TENSOR_NAMES
    return [
        (names[gguf.MODEL_TENSOR.ROPE_FACTORS_LONG] + ".weight",
         torch.tensor(rope["long_factor"], dtype=torch.float32)),
        (names[gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT] + ".weight",
         torch.tensor(rope["short_factor"], dtype=torch.float32)),
    ]  # fmt: skip
