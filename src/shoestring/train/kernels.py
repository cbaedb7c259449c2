"""``train.kernels``: fused training kernels patched into the base model.

``liger`` applies liger-kernel's RMSNorm, SwiGLU, RoPE and fused linear cross-entropy
through its model patching (``apply_liger_kernel_to_<family>(model=...)``) to the
already-built base model, before LoRA wraps it. Its kernels are Triton: CUDA only. Every
refusal comes before anything is loaded: the device and the knob combination when the
config is resolved (:func:`check_kernels`, no import of liger_kernel), the model family
from ``config.json`` before the weights load (:func:`check_family`).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path
from typing import Any

from shoestring.config import ConfigError
from shoestring.train.config import Kernels, TrainConfig

#: ``config.json`` model_type -> liger-kernel's patch function for that family.
LIGER_FAMILIES: dict[str, str] = {
    "llama": "apply_liger_kernel_to_llama",
    "qwen2": "apply_liger_kernel_to_qwen2",
    "mistral": "apply_liger_kernel_to_mistral",
}
INSTALL_HINT = "pip install 'shoestring[kernels]' (liger-kernel; needs a CUDA build of torch)"


def check_kernels(train: TrainConfig, on_gpu: bool) -> None:
    """Refuse ``train.kernels`` where it cannot run, before any work (exit 2)."""
    if train.kernels == "none":
        return
    if not on_gpu:
        raise ConfigError(
            f"train.kernels: {train.kernels} runs on CUDA only (liger-kernel's kernels are "
            f"Triton GPU kernels; train.device is {train.device}); use train.kernels none on CPU"
        )
    if train.loss_chunk_tokens:
        raise ConfigError(
            "train.kernels: liger's fused linear cross-entropy already computes the head and "
            "the loss in chunks; set train.loss_chunk_tokens 0 (or train.kernels none)"
        )
    if importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError(f"train.kernels: liger needs liger-kernel: {INSTALL_HINT}")


def model_type(model_dir: Path) -> str:
    """``model_type`` of the model's ``config.json`` ('' when it has none)."""
    try:
        return str(json.loads((model_dir / "config.json").read_text()).get("model_type", ""))
    except (OSError, ValueError):
        return ""


def check_family(kernels: Kernels, model_dir: Path) -> None:
    """Refuse a model family liger-kernel does not patch, before its weights load."""
    if kernels == "none":
        return
    kind = model_type(model_dir)
    if kind not in LIGER_FAMILIES:
        raise ConfigError(
            f"train.kernels: liger patches {', '.join(sorted(LIGER_FAMILIES))} models; "
            f"{model_dir}/config.json has model_type {kind or '(none)'!r}: use train.kernels none"
        )


def apply_kernels(kernels: Kernels, model: Any) -> dict[str, Any]:
    """Patch ``model`` (the transformers base, before LoRA) in place; what was applied."""
    if kernels == "none":
        return {}
    kind = str(getattr(model.config, "model_type", ""))
    try:
        patches = importlib.import_module("liger_kernel.transformers")
    except ImportError as e:
        raise ConfigError(
            f"train.kernels: liger: cannot import liger-kernel ({e}); {INSTALL_HINT}"
        ) from e
    getattr(patches, LIGER_FAMILIES[kind])(
        rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True, model=model
    )
    return {"kernels": kernels, "family": kind, "fused": ["rms_norm", "swiglu", "rope", "flce"]}
