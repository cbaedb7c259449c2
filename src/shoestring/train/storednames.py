"""The merged export's tensors under the names a checkpoint stores them by.

transformers 5 converts some stored tensors as it loads them: an MoE layer's experts,
stored one Linear per expert (``experts.3.gate_proj.weight``), become fused parameters
(``experts.gate_up_proj``, all experts stacked, gate and up concatenated). Its
``save_pretrained`` writes them back in the stored layout with
``revert_weight_conversion``, which llama.cpp, vLLM and older loaders expect. The
merged export forms one tensor at a time, so here each formed tensor is reverted on its
own by that same function: first on an empty (meta) tensor of its shape, for the names
and shapes the writer lays out before any byte, then on its values when the writer
asks for the first of them, the rest kept until written (one fused parameter, never
the model).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shoestring.stwriter import TensorSpec

FormTensor = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class _Conversions:
    """What ``revert_weight_conversion`` reads of a model: its load-time conversions
    (these only: not bitsandbytes' own, the merge writes dense weights) and config."""

    _weight_conversions: list[Any]
    config: Any


def _reverted(model: _Conversions, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    from transformers.core_model_loading import revert_weight_conversion

    try:
        out = revert_weight_conversion(model, {name: t})  # type: ignore[arg-type]
    except Exception as e:  # a stored tensor made of several of the model's
        raise NotImplementedError(
            f"streamed merge: {name} is not stored as itself or as parts of itself "
            f"({type(e).__name__}: {e})"
        ) from e
    return {k: v.contiguous() for k, v in out.items()}


@dataclass
class _Group:
    """The stored tensors one formed tensor reverts to, formed on the first ask."""

    model: _Conversions
    name: str
    form: FormTensor
    left: dict[str, torch.Tensor] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)

    def take(self, key: str) -> torch.Tensor:
        if key in self.done:
            raise RuntimeError(f"streamed merge: {key} asked for twice")
        if not self.left:
            self.left = _reverted(self.model, self.name, self.form())
        self.done.add(key)
        return self.left.pop(key)


def in_stored_names(
    specs: list[TensorSpec], forms: dict[str, FormTensor], conversions: list[Any], config: Any
) -> tuple[list[TensorSpec], dict[str, FormTensor]]:
    """``specs``/``forms`` (the model's names) renamed and split as ``save_pretrained``
    writes them, by reverting ``conversions`` (the model's load-time ones)."""
    if not conversions:
        return specs, forms
    model = _Conversions(conversions, config)
    out_specs: list[TensorSpec] = []
    out_forms: dict[str, FormTensor] = {}
    for spec in specs:
        meta = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
        stored = _reverted(model, spec.name, meta)
        if list(stored) == [spec.name] and tuple(stored[spec.name].shape) == spec.shape:
            out_specs.append(spec)
            out_forms[spec.name] = forms[spec.name]
            continue
        group = _Group(model, spec.name, forms[spec.name])
        for key, t in stored.items():
            out_specs.append(TensorSpec(key, tuple(t.shape), t.dtype))
            out_forms[key] = _taker(group, key)
    return out_specs, out_forms


def _taker(group: _Group, key: str) -> FormTensor:
    return lambda: group.take(key)
