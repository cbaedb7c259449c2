"""What only peft knows of an adapter: per-module scales and adapters on parameters.

Most adapters are a LoRA pair per linear weight with one ``lora_alpha / r``. Two kinds
are not, and both are read through peft's own modules, put on the model's skeleton
(the meta device: no weight, no adapter value loaded):

* ``rank_pattern`` / ``alpha_pattern``: each module's ``scaling`` is peft's;
* ``target_parameters`` (an MoE model's fused experts, which peft adapts as parameters
  with its ``ParamWrapper``): each expert's low-rank factors are peft's
  ``get_delta_factors`` of the adapter's stored values. The fused parameter is made of
  the checkpoint's per-expert tensors (:mod:`.fused`), so its factors are split into a
  LoRA pair per stored tensor (the gate rows and the up rows of expert ``e``, its down
  projection); those merge as they stream like any other weight's, compressed copy
  included. Experts stored MXFP4 (gpt-oss) are codes, not weights: their pairs stay
  one per expert in the fused layout, merged into each expert as it is decoded.

A router (a 2-D parameter) is an ordinary pair under its stored name; only its scale
comes from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shoestring.config import ConfigError
from shoestring.infer.fused import Fused

_PREFIX = "base_model.model."
Pair = tuple[torch.Tensor, torch.Tensor]  # (A, B), float32


@dataclass
class PeftLayout:
    """What peft says of an adapter on this model: each weight's scale, a LoRA pair per
    stored expert tensor, the adapter's keys those replace, and per fused parameter
    decoded as it streams (MXFP4 experts) a pair per expert in its fused layout."""

    scales: dict[str, float] = field(default_factory=dict)
    experts: dict[str, Pair] = field(default_factory=dict)
    replaced: set[str] = field(default_factory=set)
    decoded: dict[str, list[Pair]] = field(default_factory=dict)


def peft_layout(
    adapter_dir: Path,
    model_dir: Path,
    tensors: dict[str, torch.Tensor],
    fused: dict[str, Fused],
    rows: dict[str, int],
) -> PeftLayout:
    """The adapter as peft reads it on this model. ``fused``: the engine's fused
    parameters by key; ``rows``: each stored tensor's rows."""
    out = PeftLayout()
    for name, module in _lora_modules(adapter_dir, model_dir):
        scale = float(module.scaling["default"])
        if getattr(module, "num_experts", 1) > 1:
            key = f"{_clean(name)}.{module.parameter_name}"
            if key not in fused:
                raise ConfigError(
                    f"model.adapter: it adapts {key!r}, which this model does not fuse"
                )
            lhs, rhs = _factors(module, tensors, name)
            if fused[key].mxfp4:  # merged into each expert as it is decoded
                out.decoded[key] = [(rhs[e], lhs[e]) for e in range(lhs.shape[0])]
                out.scales[key] = scale
            else:
                for source, pair in _split(lhs, rhs, fused[key], rows).items():
                    out.experts[source] = pair
                    out.scales[source] = scale
            out.replaced.add(f"{name}.weight")  # its pair's key as the adapter file names it
        else:
            out.scales[f"{_clean(name)}.{getattr(module, 'parameter_name', 'weight')}"] = scale
    return out


def _lora_modules(adapter_dir: Path, model_dir: Path) -> list[tuple[str, Any]]:
    """peft's LoRA modules on the model's skeleton, by their names in the adapter file."""
    from peft import PeftModel

    from shoestring.infer.engine import build_skeleton

    _, skeleton = build_skeleton(model_dir, torch.float32)  # factors keep the adapter's fp32
    model = PeftModel.from_pretrained(skeleton, str(adapter_dir), low_cpu_mem_usage=True)
    return [
        (n.removeprefix(_PREFIX), m)
        for n, m in model.named_modules()
        if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {})
    ]


def _clean(name: str) -> str:
    """A LoRA module's name as the base's weight key prefix (nested wrappers unwrapped)."""
    return name.replace(".base_layer", "")


def _factors(module: Any, tensors: dict[str, torch.Tensor], name: str) -> Pair:
    """peft's per-expert factors of the fused parameter (``get_delta_factors``): the
    delta of expert ``e`` is ``lhs[e] @ rhs[e]`` (times the scale), in the parameter's
    own layout, float32."""
    with torch.no_grad():
        for side in ("lora_A", "lora_B"):
            value = tensors[f"{_PREFIX}{name}.{side}.weight"].float()
            getattr(module, side)["default"].weight = torch.nn.Parameter(value, requires_grad=False)
        lhs, rhs, _ = module.get_delta_factors("default")  # (E, out, r), (E, r, in)
    return lhs.float().contiguous(), rhs.float().contiguous()


def _split(lhs: torch.Tensor, rhs: torch.Tensor, f: Fused, rows: dict[str, int]) -> dict[str, Pair]:
    """The fused parameter's per-expert factors as one pair per stored tensor
    (``rows``: each stored tensor's rows)."""
    if f.concat_dim not in (0, 1):
        raise ConfigError(f"model.adapter: cannot split the adapter of {f.key!r} per expert")
    pairs: dict[str, Pair] = {}
    offset = 0
    for group in f.groups():
        size = rows[group[0]] if f.concat_dim == 1 else lhs.shape[1]
        for e, source in enumerate(group):
            pairs[source] = (rhs[e].contiguous(), lhs[e, offset : offset + size].contiguous())
        offset += size if f.concat_dim == 1 else 0
    return pairs
