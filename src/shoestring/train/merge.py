"""The merged export's tensors, formed one at a time from the trained model in memory.

An adapted linear's merged weight is ``dense(base) + delta``. ``dense(base)`` is the
base weight the adapter was trained against: for a 4/8-bit base the bitsandbytes
dequantization of the very bytes in memory (no reload, no re-quantization), cast to
the export dtype (the base's compute dtype); never the original 16-bit weights, which
would add the quantization error back (unsloth-zoo #810). ``delta`` is peft's own
``LoraLayer.get_delta_weight`` (on CPU, bf16/fp16 adapters multiply in fp32 and cast
back), added in place into the dense weight exactly as peft's ``Linear.merge`` does
on a dense base. So the result is bitwise what ``merge_and_unload`` gives on the
dequantized base. A parameter peft adapts directly (its ``ParamWrapper``: an MoE
layer's fused experts, its router) gets ``get_delta_weight`` added as
``ParamWrapper.merge`` adds it (to the dequantized stack where the experts are held in
NF4, :mod:`.nf4experts`). A quantized linear or expert stack without an adapter is
dequantized; every other tensor passes through unchanged. Tensors transformers fused or renamed as
it loaded them are written back under their stored names (:mod:`.storednames`).

Tensors are listed by their plain checkpoint names (a LoRA layer stands for its base
linear; no ``.base_layer``, no quant-state tensors), in checkpoint order, a tied tensor
once (as ``save_pretrained`` drops tied keys). Each is formed only when the writer
asks for it and dropped once written: the extra memory is one weight at a time (plus
peft's fp32 delta and, while it scales, its copy), never the model.
:func:`formed_forwards` runs the in-memory model on the same formed weights, so the
drift measured is that of the weights written.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from shoestring.stwriter import TensorSpec
from shoestring.train.nf4experts import stacks_of
from shoestring.train.storednames import FormTensor, in_stored_names

#: A ``torch.nn.Linear`` or a bitsandbytes ``Linear4bit``/``Linear8bitLt`` (untyped).
Linear = Any
#: Rows per block handed to the writer: it copies each block to bytes.
BLOCK_BYTES = 64 << 20


def _dequantize_4bit(linear: Linear) -> torch.Tensor:
    import bitsandbytes.functional as bnbf

    weight = linear.weight
    return bnbf.dequantize_4bit(weight.data, weight.quant_state)


def _dequantize_8bit(linear: Linear) -> torch.Tensor:
    import bitsandbytes.functional as bnbf

    weight = linear.weight
    scb = linear.state.SCB if linear.state.SCB is not None else weight.SCB
    dense: torch.Tensor = bnbf.int8_vectorwise_dequant(weight.data, scb.to(weight.device))
    return dense


#: How a quantized base weight's bytes become dense values (as peft and transformers
#: do it), by the parameter's class. Any other weight is dense already.
DEQUANTIZERS: dict[str, Callable[[Linear], torch.Tensor]] = {
    "Params4bit": _dequantize_4bit,
    "Int8Params": _dequantize_8bit,
}


def is_quantized(weight: Any) -> bool:
    return type(weight).__name__ in DEQUANTIZERS


def dense_shape(weight: Any) -> tuple[int, ...]:
    """A weight's logical shape (a 4-bit weight is stored packed, its shape in its quant state)."""
    quant_state = getattr(weight, "quant_state", None)
    return tuple(quant_state.shape if quant_state is not None else weight.shape)


class LargestTensor:
    """The merge's own accounting of its memory: the bytes of the largest tensor it
    formed (a dequantized or merged weight, a delta). Tensors passed through are not
    copied, except by the writer, a block of at most :data:`BLOCK_BYTES` at a time."""

    def __init__(self) -> None:
        self.nbytes = 0

    def note(self, t: torch.Tensor) -> torch.Tensor:
        self.nbytes = max(self.nbytes, t.numel() * t.element_size())
        return t


def dense_weight(linear: Linear, dtype: torch.dtype, tally: LargestTensor) -> torch.Tensor:
    """The base linear's weight as dense values in ``dtype`` (the stored tensor itself
    when it is dense in ``dtype`` already)."""
    dequantize = DEQUANTIZERS.get(type(linear.weight).__name__)
    if dequantize is None:
        stored: torch.Tensor = linear.weight.detach().to(dtype)
        return stored
    return tally.note(tally.note(dequantize(linear)).to(dtype))


def merged_weight(
    layer: Any, adapters: list[str], dtype: torch.dtype, tally: LargestTensor
) -> torch.Tensor:
    """dense(base) + each adapter's delta, as peft's ``Linear.merge`` computes it on a
    dense base (``weight.data += get_delta_weight(adapter)``), in a new tensor."""
    base = layer.get_base_layer()
    weight = dense_weight(base, dtype, tally)
    if weight.data_ptr() == base.weight.data_ptr():  # never merge into the live model
        weight = weight.clone()
    tally.note(weight)
    for adapter in adapters:
        weight += tally.note(layer.get_delta_weight(adapter))
    return weight


def check_mergeable(layer: Any, adapters: list[str]) -> None:
    """Only what peft's plain ``Linear.merge`` does: vanilla LoRA on a linear, unmerged."""
    for adapter in adapters:
        if adapter not in getattr(layer, "lora_A", {}):
            raise NotImplementedError(
                f"streamed merge: {type(layer).__name__} is not a LoRA linear ({adapter!r})"
            )
        if adapter in layer.lora_variant or layer.lora_bias.get(adapter, False):
            raise NotImplementedError(
                f"streamed merge: adapter {adapter!r} is not vanilla LoRA (DoRA or lora_bias)"
            )
    if layer.merged:
        raise ValueError("streamed merge: the adapter is already merged into the base")


def merged_parameter(
    wrapper: Any, adapters: list[str], dtype: torch.dtype, tally: LargestTensor
) -> torch.Tensor:
    """A fused parameter (an MoE layer's experts) with each adapter's delta added, as
    peft's ``ParamWrapper.merge`` does it (``param += get_delta_weight``), in a new tensor."""
    weight = dense_param(wrapper.get_base_layer(), wrapper.parameter_name, dtype, tally)
    for adapter in adapters:
        weight += tally.note(wrapper.get_delta_weight(adapter))
    return weight


def dense_param(
    module: torch.nn.Module, name: str, dtype: torch.dtype, tally: LargestTensor
) -> torch.Tensor:
    """A parameter as dense values in ``dtype``, in a new tensor: NF4 experts
    (:mod:`.nf4experts`) dequantized, the very values trained against."""
    stack = stacks_of(module).get(name)
    if stack is None:
        return tally.note(getattr(module, name).detach().to(dtype, copy=True))
    return tally.note(tally.note(stack.dense()).to(dtype))


@dataclass(frozen=True)
class FormedLinear:
    """A linear whose exported weight is formed, not stored (merged or dequantized)."""

    module: torch.nn.Module
    form_weight: FormTensor
    bias: torch.Tensor | None


@dataclass(frozen=True)
class FormedParams:
    """A module whose adapted parameters are formed (merged), ``wrapper`` the peft
    module that stands for it in the model, ``base`` the module itself."""

    wrapper: torch.nn.Module
    base: torch.nn.Module
    forms: dict[str, FormTensor]


@dataclass
class MergePlan:
    """The exported tensors in checkpoint order, each formed on demand."""

    dtype: torch.dtype
    adapters: list[str]
    specs: list[TensorSpec] = field(default_factory=list)
    forms: dict[str, FormTensor] = field(default_factory=dict)
    linears: list[FormedLinear] = field(default_factory=list)
    params: list[FormedParams] = field(default_factory=list)
    largest: LargestTensor = field(default_factory=LargestTensor)
    seen: set[int] = field(default_factory=set)

    def add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, form: FormTensor) -> None:
        self.specs.append(TensorSpec(name, shape, dtype))
        self.forms[name] = form

    def add_stored(self, name: str, t: torch.Tensor) -> None:
        if id(t) not in self.seen:  # a tied tensor is written once, under its first name
            self.seen.add(id(t))
            self.add(name, tuple(t.shape), t.dtype, lambda: t.detach())

    def source(self, spec: TensorSpec) -> Iterator[torch.Tensor]:
        """The writer's block source: forms the tensor, hands it over in row blocks."""
        t = self.forms[spec.name]()
        if t.dim() == 0:
            yield t
            return
        row_bytes = max(1, t[0].numel() * t.element_size())
        yield from t.split(max(1, BLOCK_BYTES // row_bytes))

    @property
    def merged_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


def _add_adapted(plan: MergePlan, name: str, layer: Any) -> None:
    check_mergeable(layer, plan.adapters)
    base = layer.get_base_layer()
    if id(base.weight) in plan.seen:
        raise NotImplementedError(f"streamed merge: {name} adapts a tied weight")
    plan.seen.add(id(base.weight))

    def form() -> torch.Tensor:
        return merged_weight(layer, plan.adapters, plan.dtype, plan.largest)

    plan.add(f"{name}weight", dense_shape(base.weight), plan.dtype, form)
    _add_linear_rest(plan, name, layer, base, form)


def _add_quantized(plan: MergePlan, name: str, linear: Linear) -> None:
    plan.seen.add(id(linear.weight))

    def form() -> torch.Tensor:
        return dense_weight(linear, plan.dtype, plan.largest)

    plan.add(f"{name}weight", dense_shape(linear.weight), plan.dtype, form)
    _add_linear_rest(plan, name, linear, linear, form)


def _add_linear_rest(
    plan: MergePlan, name: str, module: torch.nn.Module, base: Linear, form: FormTensor
) -> None:
    bias = getattr(base, "bias", None)
    if bias is not None:
        plan.add_stored(f"{name}bias", bias)
    plan.linears.append(FormedLinear(module, form, bias))


def _param_wrappers(wrapper: Any) -> tuple[dict[str, Any], torch.nn.Module]:
    """peft's ``ParamWrapper``s around one module (one per adapted parameter, nested),
    by parameter name, and the module."""
    from peft.tuners.lora.layer import ParamWrapper

    wrappers, module = {}, wrapper
    while isinstance(module, ParamWrapper):
        wrappers[module.parameter_name] = module
        module = module.base_layer
    return wrappers, module


def _add_adapted_params(plan: MergePlan, name: str, wrapper: Any) -> None:
    """A module with LoRA on its parameters (an MoE layer's fused experts), or with NF4
    experts: each adapted parameter merged (:func:`merged_parameter`), each other NF4
    one dequantized, the rest as stored."""
    wrappers, base = _param_wrappers(wrapper)
    forms: dict[str, FormTensor] = {}
    for pname, p in base.named_parameters(recurse=False):
        if pname in wrappers:
            check_mergeable(wrappers[pname], plan.adapters)
            forms[pname] = _merged_form(wrappers[pname], plan)
        elif pname in stacks_of(base):
            forms[pname] = _dequantized_form(base, pname, plan)
        else:
            plan.add_stored(f"{name}{pname}", p)
            continue
        plan.seen.add(id(p))
        plan.add(f"{name}{pname}", tuple(p.shape), plan.dtype, forms[pname])
    _add_buffers(plan, name, base)
    plan.params.append(FormedParams(wrapper, base, forms))


def _merged_form(wrapper: Any, plan: MergePlan) -> FormTensor:
    return lambda: merged_parameter(wrapper, plan.adapters, plan.dtype, plan.largest)


def _dequantized_form(module: torch.nn.Module, pname: str, plan: MergePlan) -> FormTensor:
    return lambda: dense_param(module, pname, plan.dtype, plan.largest)


def _add_plain(plan: MergePlan, name: str, module: torch.nn.Module) -> None:
    """Own parameters and persistent buffers, as ``state_dict`` lists them."""
    for pname, p in module.named_parameters(recurse=False):
        plan.add_stored(f"{name}{pname}", p)
    _add_buffers(plan, name, module)


def _add_buffers(plan: MergePlan, name: str, module: torch.nn.Module) -> None:
    non_persistent: set[str] = getattr(module, "_non_persistent_buffers_set", set())
    for bname, b in module.named_buffers(recurse=False):
        if bname not in non_persistent:
            plan.add_stored(f"{name}{bname}", b)


def _refuse(plan: MergePlan, name: str, module: torch.nn.Module) -> None:
    raise NotImplementedError(
        f"streamed merge: {name or 'the model'} is a peft {type(module).__name__}, "
        "not a LoRA layer (modules_to_save, trainable tokens ...): not merged"
    )


#: What a module contributes to the export, by kind (see :func:`_kind`).
_HANDLERS: dict[str, Callable[[MergePlan, str, Any], None]] = {
    "adapted": _add_adapted,
    "adapted parameters": _add_adapted_params,
    "nf4 experts": _add_adapted_params,
    "quantized": _add_quantized,
    "plain": _add_plain,
    "other peft": _refuse,
}


def _kind(module: torch.nn.Module) -> str:
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import ParamWrapper

    if isinstance(module, ParamWrapper):
        return "adapted parameters"
    if stacks_of(module):
        return "nf4 experts"
    if isinstance(module, LoraLayer):
        return "adapted"
    if type(module).__module__.startswith("peft."):
        return "other peft"
    own = dict(module.named_parameters(recurse=False))
    return "quantized" if is_quantized(own.get("weight")) else "plain"


def _checkpoint_modules(
    module: torch.nn.Module, prefix: str = ""
) -> Iterator[tuple[str, str, Any]]:
    """Modules in registration order (the checkpoint's); a LoRA layer stands for its base."""
    kind = _kind(module)
    yield prefix, kind, module
    if kind == "plain":
        for name, child in module.named_children():
            yield from _checkpoint_modules(child, f"{prefix}{name}.")


def export_dtype(base: Any) -> torch.dtype:
    dtype: torch.dtype = base.dtype
    if not dtype.is_floating_point:
        raise ValueError(f"streamed merge: the base's dtype {dtype} is not a float dtype")
    return dtype


def _renames(base: Any) -> list[Any]:
    """The load-time weight conversions other than bitsandbytes' own: a base loaded
    pre-quantized (the quantized-base cache) gathers each ``weight.absmax``,
    ``weight.quant_map``, ... back into its ``weight`` — no name of the model changes."""
    return [
        c
        for c in getattr(base, "_weight_conversions", None) or []
        if not (
            list(getattr(c, "target_patterns", None) or []) == ["weight"]
            and all(
                p == "weight" or p.startswith("weight.")
                for p in getattr(c, "source_patterns", None) or ["?"]
            )
        )
    ]


def plan_merge(model: Any, stored_names: bool = True) -> MergePlan:
    """The merged export of a peft model (the base's names, the adapters folded in);
    ``stored_names``: the tensors transformers fused or renamed at load as the checkpoint
    stores them (else as the model holds them: an MoE layer's experts fused)."""
    base = model.get_base_model()
    plan = MergePlan(export_dtype(base), list(model.active_adapters))
    for name, kind, module in _checkpoint_modules(base):
        _HANDLERS[kind](plan, name, module)
    if stored_names:  # as save_pretrained writes them
        plan.specs, plan.forms = in_stored_names(
            plan.specs, plan.forms, _renames(base), base.config
        )
    return plan


def _formed_forward(linear: FormedLinear) -> Callable[..., torch.Tensor]:
    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.nn.functional.linear(x, linear.form_weight(), linear.bias)

    return forward


def _formed_params_forward(formed: FormedParams) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        merged = {p: form() for p, form in formed.forms.items()}
        return torch.func.functional_call(formed.base, merged, args, kwargs)

    return forward


@contextlib.contextmanager
def formed_forwards(plan: MergePlan) -> Iterator[None]:
    """Within: every merged or dequantized linear of the in-memory model computes with
    its exported weight, formed for each call and dropped after (the model is the
    merged model, one layer's weight at a time). Restored on exit."""
    formed: list[tuple[torch.nn.Module, Callable[..., Any]]]
    formed = [(lin.module, _formed_forward(lin)) for lin in plan.linears]
    formed += [(p.wrapper, _formed_params_forward(p)) for p in plan.params]
    saved = [(module, module.__dict__.get("forward")) for module, _ in formed]
    try:
        for module, forward in formed:
            module.forward = forward
        yield
    finally:
        for module, kept in saved:
            if kept is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = kept
