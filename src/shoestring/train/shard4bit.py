"""A bitsandbytes nf4 base made shardable by FSDP2 (FSDP-QLoRA).

FSDP2's ``fully_shard`` replaces every parameter with a plain ``nn.Parameter``
around a DTensor shard: bitsandbytes' ``Params4bit`` subclass and the
``quant_state`` it carries (block scales, nested scales, code, logical shape)
are gone, and a ``uint8`` packed weight cannot even become a parameter
(``nn.Parameter`` asks for a gradient, which integer tensors cannot have).

Two ways around it were weighed:

* **A tensor subclass with FSDP2's extension hooks** (``fsdp_pre_all_gather`` /
  ``fsdp_post_all_gather``), as torchao's ``NF4Tensor`` does for torchtune. It is
  the principled route, but ``NF4Tensor`` is a ``__torch_dispatch__`` wrapper that
  implements every op FSDP2 runs on a shard (chunk, split, view, copy_, new_zeros,
  ...) and shards the scales along with the codes. ``Params4bit`` is not such a
  wrapper; wrapping its packed bytes and quant state the same way would mean
  reimplementing torchao's subclass against bitsandbytes' layout.
* **Plain float storage, quant state kept on the module** (chosen). The packed
  bytes are reinterpreted, without a copy, as a float tensor of the model's dtype
  — exactly what ``bnb_4bit_quant_storage=<dtype>`` would have produced (bnb views
  any storage dtype back as ``uint8`` before its kernels). FSDP2 shards,
  all-gathers and frees that tensor like any frozen weight. Each ``Linear4bit``
  keeps its ``quant_state`` as a module attribute (bitsandbytes sets it when it
  quantizes; we check it), and bitsandbytes' own ``Linear4bit.forward`` re-wraps
  the unsharded weight FSDP2 hands it with that state before ``matmul_4bit``
  (``fix_4bit_weight_quant_state_from_module``: bitsandbytes' recovery path for
  exactly this loss). The backward reads the same storage, which FSDP2 refills
  in its pre-backward all-gather. This is the Answer.AI FSDP-QLoRA design, needs
  no code inside the forward, and leaves the quant state (a few percent of the
  bytes) replicated on every rank.

Why the bytes survive: with no ``MixedPrecisionPolicy`` (the fsdp strategy sets
none; autocast does the mixed precision), FSDP2 never casts a parameter. Its
copy-in and copy-out are same-dtype copies (or, when a layer's parameters have
several dtypes, ``uint8`` views of them) and the all-gather moves bytes, so a
packed byte pattern that reads as a NaN in the float view stays that exact
pattern. A cast (bf16 -> fp32 -> bf16 canonicalizes NaNs) would corrupt it —
bitsandbytes issue #1945. ``tests/test_fsdp_qlora.py`` compares the gathered bytes
with the originals.

The reinterpretation happens at wrap time, after loading: the quantized-base
cache (``train/qbase.py``) keeps storing bitsandbytes' ``uint8`` serialization, so
one cached base serves single-process, DDP and FSDP runs alike and its key does not
change. LLM.int8 (``Int8Params``) keeps row scales on the parameter and has no such
recovery path in bitsandbytes: it stays refused under FSDP.
"""

from __future__ import annotations

from typing import Any

import torch

from shoestring.config import ConfigError


def linear4bit_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every bitsandbytes ``Linear4bit`` of ``model``, by name."""
    from bitsandbytes.nn.modules import Linear4bit

    return [(n, m) for n, m in model.named_modules() if isinstance(m, Linear4bit)]


def make_shardable(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Prepare every ``Linear4bit`` of ``model`` for ``fully_shard``: its packed weight
    becomes a frozen ``dtype`` view of the same bytes, its quant state stays on the
    module (moved to ``device``, where FSDP2 will compute). Returns how many."""
    modules = linear4bit_modules(model)
    for name, module in modules:
        _as_float_storage(name, module, dtype)
        module.quant_state.to(device)
    return len(modules)


def _as_float_storage(name: str, module: Any, dtype: torch.dtype) -> None:
    from bitsandbytes.nn.modules import Params4bit

    weight = module.weight
    state = getattr(weight, "quant_state", None) or getattr(module, "quant_state", None)
    if state is None or getattr(state, "packing_format_for_cpu", False):
        raise ConfigError(
            f"distributed.strategy fsdp: {name} is not a quantized nf4 weight in "
            "bitsandbytes' standard packing; cannot shard it"
        )
    packed = weight.data.reshape(-1).view(torch.uint8)
    width = torch.empty((), dtype=dtype).element_size()
    if packed.numel() % width:
        raise ConfigError(
            f"distributed.strategy fsdp: {name} holds {packed.numel()} packed bytes, "
            f"not a multiple of {width} ({dtype}); cannot view them as {dtype} for sharding"
        )
    module.weight = Params4bit(
        packed.view(dtype).reshape(-1, 1),
        requires_grad=False,
        quant_state=state,
        blocksize=weight.blocksize,
        compress_statistics=weight.compress_statistics,
        quant_type=weight.quant_type,
        quant_storage=dtype,
        module=module,
        bnb_quantized=True,
    )
    module.quant_state = state
    module.quant_storage = dtype


def packed_bytes(module: Any) -> torch.Tensor:
    """A ``Linear4bit``'s packed weight as ``uint8`` (a view; the full tensor once FSDP2
    has unsharded it)."""
    weight = module.weight
    local: torch.Tensor = weight.to_local() if hasattr(weight, "to_local") else weight
    return local.detach().reshape(-1).view(torch.uint8)
