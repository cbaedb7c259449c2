"""A mixture-of-experts base's fused experts in NF4, computed only for the experts a
token is routed to.

transformers 5 holds an MoE layer's experts as 3-D parameters (``gate_up_proj``
``[experts, 2*inter, hidden]``, ``down_proj`` ``[experts, hidden, inter]``), which
bitsandbytes' quantizer leaves in 16 bits: it swaps ``nn.Linear`` modules only. So a
"QLoRA" of an OLMoE or Qwen3-MoE base kept ~90 % of its bytes in bf16 (an
OLMoE-1B-7B shape needed 18.4 GB on 24 GB; ``benchmarks/README.md``).

Here each expert's matrix is quantized on its own by bitsandbytes (``quantize_4bit``:
NF4, blocks of 64, double-quantized scales, as ``lora.quantize nf4`` does for the
linears) and the layer's forward, registered with transformers' own experts seam
(``ExpertsInterface``), loops over the experts that received tokens: each one's
matmul is bitsandbytes' ``matmul_4bit``, which dequantizes inside the kernel and again
in the backward, so no dequantized weight is kept for the backward.

LoRA on the experts stays peft's (``ParamWrapper``, its adapter files unchanged), but
computed in factored form per routed expert: with peft's factors (delta
``s·lhs@rhs``), ``x @ W_e^T + s·((x @ rhs_e^T) @ lhs_e^T)``, where peft's own forward
would form ``W + s·lhs@rhs`` for the whole stack, dequantized, every call
(:class:`shoestring.train.nf4lora.FactoredExperts`).

The experts' placeholders and the forward's registration are the only state outside
the stacks: a stride-0 parameter where each 16-bit stack was, and the name
:data:`IMPLEMENTATION` in transformers' registry of experts forwards (its documented
extension point, registered once per process, used by the models that select it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

#: The name our forward is registered under in transformers' ``ExpertsInterface``.
IMPLEMENTATION = "shoestring_nf4"
_BLOCKSIZE = 64
_PROJECTIONS = ("gate_up_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ExpertStack:
    """One fused expert parameter as E NF4 matrices ``[out, in]`` (bitsandbytes'
    layout for ``matmul_4bit``), whatever the parameter's own layout."""

    packed: torch.Tensor  # [experts, out*in/2] uint8
    states: tuple[Any, ...]  # a bitsandbytes QuantState per expert
    shape: torch.Size  # the parameter's
    dtype: torch.dtype  # the parameter's
    transposed: bool  # the parameter is [experts, in, out]

    @classmethod
    def quantize(cls, param: torch.Tensor, transposed: bool) -> ExpertStack:
        import bitsandbytes.functional as F

        experts, size = param.shape[0], param[0].numel()
        packed = torch.empty((experts, (size + 1) // 2), dtype=torch.uint8, device=param.device)
        states = []
        for e in range(experts):  # each straight into its row: no per-expert copy to free
            w = param[e].t() if transposed else param[e]
            _, state = F.quantize_4bit(
                w.contiguous(), out=packed[e].view(-1, 1), blocksize=_BLOCKSIZE,
                compress_statistics=True, quant_type="nf4",
            )  # fmt: skip
            states.append(state)
        return cls(packed, tuple(states), param.shape, param.dtype, transposed)

    def matmul(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """``x`` through expert ``e``'s matrix, as the model's own forward would."""
        import bitsandbytes as bnb

        out: torch.Tensor = bnb.matmul_4bit(  # type: ignore[attr-defined]
            x, self.packed[e].view(-1, 1), self.states[e]
        )
        return out

    def dequantized(self, e: int) -> torch.Tensor:
        """Expert ``e``'s matrix in the parameter's layout and dtype."""
        import bitsandbytes.functional as F

        w = F.dequantize_4bit(self.packed[e].view(-1, 1), self.states[e]).to(self.dtype)
        return w.t() if self.transposed else w

    def dense(self) -> torch.Tensor:
        """The whole parameter, dequantized (the merged export's base: the very NF4
        values trained against)."""
        return torch.stack([self.dequantized(e) for e in range(self.shape[0])])

    @property
    def nbytes(self) -> int:
        states = sum(_state_bytes(s) for s in self.states)
        return self.packed.numel() * self.packed.element_size() + states


def _state_bytes(state: Any) -> int:
    tensors = [state.absmax, getattr(state, "offset", None)]
    if state.state2 is not None:
        tensors += [state.state2.absmax, state.state2.code]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


@dataclass(frozen=True)
class Factors:
    """One adapter on one expert parameter: its delta is ``scaling * lhs @ rhs`` in the
    parameter's layout (peft's ``ParamWrapper.get_delta_factors``)."""

    lhs: torch.Tensor  # [experts, a, r]
    rhs: torch.Tensor  # [experts, r, b]
    scaling: float

    def per_expert(self, dtype: torch.dtype) -> ExpertFactors:
        """The factors in ``dtype``, split per expert once: one cast, and in backward one
        gradient for the whole stack (indexing the stack per expert would give every
        expert a full-size gradient of zeros but its slice)."""
        lhs, rhs = self.lhs.to(dtype).unbind(0), self.rhs.to(dtype).unbind(0)
        return ExpertFactors(lhs, rhs, self.scaling)


@dataclass(frozen=True)
class ExpertFactors:
    """:class:`Factors` cast to the activations' dtype, one pair per expert."""

    lhs: tuple[torch.Tensor, ...]  # [a, r] each
    rhs: tuple[torch.Tensor, ...]  # [r, b] each
    scaling: float

    def matmul(self, x: torch.Tensor, e: int, transposed: bool) -> torch.Tensor:
        """``x`` through expert ``e``'s delta, never formed: ``x @ Δ_e^T`` (``x @ Δ_e``
        where the parameter is ``[experts, in, out]``)."""
        lhs, rhs = self.lhs[e], self.rhs[e]
        if transposed:
            return (x @ lhs) @ rhs * self.scaling
        return (x @ rhs.t()) @ lhs.t() * self.scaling


Lora = dict[str, tuple[Factors, ...]]
_Cast = dict[str, tuple[ExpertFactors, ...]]


def stacks_of(module: nn.Module) -> dict[str, ExpertStack]:
    """The NF4 stacks :func:`quantize_experts` gave ``module`` ({} if none)."""
    return getattr(module, "nf4_stacks", {})


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers 5 experts module (``@use_experts_implementation``) with 3-D weights."""
    flags = ("is_transposed", "has_gate", "has_bias")
    if not all(hasattr(module, f) for f in flags):
        return False
    return any(getattr(module, p, None) is not None for p in _PROJECTIONS)


@dataclass(frozen=True)
class QuantizedExperts:
    """A model's NF4 experts, for the ``load`` event."""

    modules: int
    params: int
    bytes_16bit: int
    bytes_nf4: int

    @classmethod
    def of(cls, model: nn.Module) -> QuantizedExperts | None:
        stacks = [s for m in model.modules() for s in stacks_of(m).values()]
        if not stacks:
            return None
        modules = sum(1 for m in model.modules() if stacks_of(m))
        params = sum(s.shape.numel() for s in stacks)
        wide = sum(s.shape.numel() * torch.empty((), dtype=s.dtype).element_size() for s in stacks)
        return cls(modules, params, wide, sum(s.nbytes for s in stacks))

    def fields(self) -> dict[str, Any]:
        return {
            "nf4_experts": self.modules,
            "nf4_expert_params": self.params,
            "nf4_expert_bytes": self.bytes_nf4,
            "nf4_expert_bytes_16bit": self.bytes_16bit,
        }


def quantize_experts(model: nn.Module) -> int:
    """Quantize every fused expert parameter of ``model`` still in 16/32 bits to NF4, a
    module at a time (its wide weights freed before the next), and route the experts'
    forward through :func:`routed_forward`. The number of parameters quantized here
    (those :func:`quantized_as_loaded` caught are already done)."""
    n = 0
    for module in model.modules():
        if is_fused_experts(module):
            for name in _PROJECTIONS:
                n += _quantize_param(module, name)
    if any(stacks_of(m) for m in model.modules()):
        _route(model)
    return n


def _quantize_param(module: nn.Module, name: str) -> int:
    param = getattr(module, name, None)
    if not isinstance(param, torch.Tensor) or param.ndim != 3 or is_placeholder(param):
        return 0
    stack = ExpertStack.quantize(param.detach(), bool(getattr(module, "is_transposed", False)))
    install_stack(module, name, stack)
    return 1


def install_stack(module: nn.Module, name: str, stack: ExpertStack) -> None:
    """``stack`` as ``module``'s parameter ``name``: kept in the module's ``__dict__`` (not
    a buffer: not in ``state_dict``), its placeholder where the parameter was."""
    module.__dict__.setdefault("nf4_stacks", {})[name] = stack
    setattr(module, name, _placeholder(stack.shape, stack.dtype, stack.packed.device))


@contextmanager
def quantized_as_loaded() -> Iterator[None]:
    """Within (around ``from_pretrained``): each fused expert parameter is quantized as
    transformers' loader sets it, so the 16-bit experts never all exist at once (the
    load peaks at the NF4 model plus a layer, not at the 16-bit model). The loader's
    own ``set_param_for_module`` does the setting and its bookkeeping first; whatever
    it does not pass this way is quantized after the load by :func:`quantize_experts`."""
    import transformers.core_model_loading as loading

    original = loading.set_param_for_module

    def set_then_quantize(model: Any, target_name: str, value: Any, *args: Any) -> None:
        original(model, target_name, value, *args)
        path, _, name = target_name.rpartition(".")
        module = model.get_submodule(path) if path else model
        if name in _PROJECTIONS and is_fused_experts(module):
            _quantize_param(module, name)

    loading.set_param_for_module = set_then_quantize  # type: ignore[assignment]
    try:
        yield
    finally:
        loading.set_param_for_module = original


def _placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """Where the 16-bit stack was: its shape, dtype and device, for peft to size adapters
    by, in one element of memory (a stride-0 view; never read: the forward reads the
    NF4 stack)."""
    one = torch.zeros((), dtype=dtype, device=device)
    held = nn.Parameter(one.expand(shape), requires_grad=False)
    held._is_hf_initialized = True  # type: ignore[attr-defined]  # transformers: loaded
    return held


def is_placeholder(t: torch.Tensor) -> bool:
    """Whether ``t`` is what :func:`_placeholder` left (every stride 0)."""
    return t.numel() > 1 and not any(t.stride())


def _route(model: nn.Module) -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:  # the library's registry, by name
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, routed_forward)
    model.set_experts_implementation(IMPLEMENTATION)  # type: ignore[operator]


def routed_forward(
    self: Any,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    lora: Lora | None = None,
) -> torch.Tensor:
    """transformers' eager experts loop (expert by expert, ascending, ``index_add_``)
    on the NF4 stacks, with LoRA deltas added in factored form."""
    out = torch.zeros_like(hidden_states)
    dtype = hidden_states.dtype
    cast = {p: tuple(f.per_expert(dtype) for f in fs) for p, fs in (lora or {}).items()}
    for e, tokens, slot in _routed(top_k_index, int(self.num_experts)):
        y = _expert(self, hidden_states[tokens], e, cast)
        y = y * top_k_weights[tokens, slot, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def _routed(top_k_index: torch.Tensor, num_experts: int) -> Iterator[tuple[int, Any, Any]]:
    """(expert, its tokens, their top-k slot) for each expert that received a token."""
    with torch.no_grad():
        hit = torch.unique(top_k_index).tolist()
    for e in hit:
        if e >= num_experts:  # expert-parallel sentinels
            continue
        tokens, slot = torch.where(top_k_index == e)
        yield e, tokens, slot


def _expert(self: Any, x: torch.Tensor, e: int, lora: _Cast) -> torch.Tensor:
    first = "gate_up_proj" if self.has_gate else "up_proj"
    h = _project(self, first, x, e, lora)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    y = _project(self, "down_proj", h, e, lora)
    if getattr(self, "has_post_expert_norm", False):
        y = self.post_expert_norm(y)
    return y


def _project(self: Any, name: str, x: torch.Tensor, e: int, lora: _Cast) -> torch.Tensor:
    stack = stacks_of(self)[name]
    given = getattr(self, name)
    if is_placeholder(given):
        y = stack.matmul(x, e)
    else:  # a dense weight given in its place (torch.func.functional_call): it wins
        y = x @ given[e] if stack.transposed else torch.nn.functional.linear(x, given[e])
    for factors in lora.get(name, ()):
        y = y + factors.matmul(x, e, stack.transposed)
    if self.has_bias:
        y = y + getattr(self, f"{name}_bias")[e]
    return y
