"""What a fine-tune on text leaves alone in a model that also sees images.

Gemma 3 from 4B up, like most vision-language checkpoints, is published as one model:
a text decoder beside a vision tower and a projector (``Gemma3ForConditionalGeneration``:
``model.language_model``, ``model.vision_tower``, ``model.multi_modal_projector``), and
``AutoModelForCausalLM`` loads it whole. Text batches never run the tower, so adapters
there get no gradient (the first step's check refuses them) and cost memory for
nothing; ``all-linear``, or a name like ``q_proj`` that SigLIP's attention shares,
would put them there. The adapters go on the text decoder only, the model is kept
whole, and they carry the checkpoint's own module names
(``model.language_model.layers.0.self_attn.q_proj``), so peft, vLLM and the merge read
them against the published model. Under ``lora.quantize`` the tower stays in the model's
dtype (bitsandbytes would quantize it as it does the decoder): it computes nothing here,
quantizing it would save 0.6 GB at Gemma 3's size, and the merged export would then carry
a tower dequantized from NF4 instead of the published one.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn


def _path_to(model: nn.Module, target: nn.Module) -> str | None:
    return next((name for name, m in model.named_modules() if m is target), None)


def _has_linear(module: nn.Module) -> bool:
    return any(isinstance(m, nn.Linear) for m in module.modules())


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def outside_decoder(model: Any, linears_only: bool = True) -> list[str]:
    """Qualified names of the modules beside the text decoder (a vision tower, a
    projector) that hold linear layers (``linears_only``) or any parameter, the output
    head excepted; empty for a text model."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    path = _path_to(model, decoder) if isinstance(decoder, nn.Module) else None
    if not path:
        return []
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    holds = _has_linear if linears_only else _has_params
    names: list[str] = []
    parent, prefix = model, ""
    for part in path.split("."):
        for name, child in parent.named_children():
            if name != part and child is not head and holds(child):
                names.append(prefix + name)
        parent, prefix = getattr(parent, part), f"{prefix}{part}."
    return names


def text_names(model: Any) -> Callable[[str], str | None]:
    """A tensor name of ``model`` as its text model (``*ForCausalLM`` of its text config)
    names it: ``model.language_model.layers.0...`` -> ``model.layers.0...``; None for the
    tower's (a GGUF holds the text model); unchanged for a text model."""
    beside = outside_decoder(model, linears_only=False)
    if not beside:
        return lambda name: name
    decoder = _path_to(model, model.get_decoder())

    def rename(name: str) -> str | None:
        if any(name == b or name.startswith(b + ".") for b in beside):
            return None
        if decoder and name.startswith(decoder + "."):
            return "model." + name[len(decoder) + 1 :]
        return name

    return rename


def exclude_pattern(names: list[str]) -> str | None:
    """peft's ``exclude_modules`` regex for ``names`` and everything under them."""
    if not names:
        return None
    return "(" + "|".join(re.escape(n) for n in names) + r")(\..*)?"


def kept_unquantized(model_dir: Path) -> list[str] | None:
    """bitsandbytes' ``llm_int8_skip_modules`` for the model in ``model_dir``: what
    transformers keeps unquantized by default (the head) and, beside it, the modules
    outside the text decoder; None for a text model (transformers' defaults apply)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.quantizers.base import get_keys_to_not_convert

    config = AutoConfig.from_pretrained(str(model_dir))
    if getattr(config, "vision_config", None) is None:
        return None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sorted(set(get_keys_to_not_convert(model)) | set(outside_decoder(model)))
