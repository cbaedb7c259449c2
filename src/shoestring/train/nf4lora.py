"""peft's LoRA on NF4 experts (:mod:`shoestring.train.nf4experts`), computed in factored
form per routed expert.

peft adapts a fused expert parameter with a ``ParamWrapper`` (one per adapted
parameter, nested). Its forward registers a parametrization that forms
``W + s·lhs@rhs`` for the whole stack and lets the experts read it: with the stack
in NF4 that would dequantize every expert, every call, and keep the sum for the
backward. :class:`FactoredExperts` (the outermost wrapper of such a chain, its class
swapped) instead hands the experts' forward each parameter's factors
(``get_delta_factors``, peft's own), so only routed experts are touched and no delta
is formed. The adapters, their names and their files stay peft's.
"""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners.lora.layer import ParamWrapper
from torch import nn

from shoestring.train.nf4experts import Factors, Lora, stacks_of


class FactoredExperts(ParamWrapper):
    """The outermost ``ParamWrapper`` over NF4 experts: calls the experts with the whole
    chain's factors instead of parametrizing their weights."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        experts = self.get_base_layer()
        if self.disable_adapters:
            return experts(x, *args, **kwargs)  # type: ignore[no-any-return]
        return experts(x, *args, lora=chain_factors(self), **kwargs)  # type: ignore[no-any-return]

    def merge(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "the experts are held in NF4 here; the merged export (export.merged) adds "
            "the adapters to the base's stored 16-bit tensors"
        )


def chain_factors(outer: ParamWrapper) -> Lora:
    """Each adapted parameter's factors, for every active adapter, down the chain."""
    lora: dict[str, tuple[Factors, ...]] = {}
    wrapper: Any = outer
    while isinstance(wrapper, ParamWrapper):
        for adapter in wrapper.active_adapters:
            if adapter in wrapper.lora_A:
                lhs, rhs, scaling = wrapper.get_delta_factors(adapter)
                found = Factors(lhs, rhs, float(scaling))
                lora[wrapper.parameter_name] = (*lora.get(wrapper.parameter_name, ()), found)
        wrapper = wrapper.base_layer
    return lora


def factor_expert_lora(model: nn.Module) -> int:
    """Make every outermost ``ParamWrapper`` chain over NF4 experts a
    :class:`FactoredExperts`; the number of chains."""
    n = 0
    for parent in model.modules():
        if isinstance(parent, ParamWrapper):
            continue
        for child in parent.children():
            if isinstance(child, ParamWrapper) and stacks_of(child.get_base_layer()):
                child.__class__ = FactoredExperts
                n += 1
    return n
