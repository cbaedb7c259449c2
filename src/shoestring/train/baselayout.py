"""How the frozen base is held, recorded in every checkpoint and checked on resume.

An adapter belongs to the weights it was trained against. The base fingerprint says
which model; this says in what form it computed: its frozen linears 16-bit, NF4, FP4
or int8, and an MoE's fused experts 16-bit or NF4 (:mod:`.nf4experts`). The config
decides most of that, and ``check_compatible`` compares configs, but a version of
shoestring can hold the same config's base differently: before 2026-12-06 an MoE's
experts stayed 16-bit under ``lora.quantize nf4``, since then they are NF4. A
checkpoint written by one, resumed by the other, would continue against other
weights without a word; this record makes that a refusal naming both forms.

A checkpoint written before the record existed cannot be checked; the resume then
says so (a warning and the ``resume`` event's ``base_layout`` field), since refusing
would throw away work that may well be right.

The libraries' versions are recorded beside it. A resume under other versions is not
refused (a spot VM's fresh install may bring a newer patch release), but it may not
continue bit for bit, so the ``resume`` event and a warning name what changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shoestring.config import ConfigError
from shoestring.train.nf4experts import is_fused_experts, stacks_of


def _linear_form(module: nn.Module) -> str | None:
    """A frozen linear's form (``nf4``, ``fp4``, ``int8`` or its dtype); None for a
    trainable one (an adapter's, or a fully fine-tuned base's)."""
    weight = getattr(module, "weight", None)
    if weight is None or weight.requires_grad:
        return None
    state = getattr(module, "quant_state", None) or getattr(weight, "quant_state", None)
    if state is not None:  # bitsandbytes Linear4bit (also sharded: a float view of the bytes)
        return str(state.quant_type)
    if type(weight).__name__ == "Int8Params":  # bitsandbytes Linear8bitLt
        return "int8"
    return str(weight.dtype).removeprefix("torch.")


def _experts_form(module: nn.Module) -> str:
    if stacks_of(module):
        return "nf4"
    frozen = [p for p in module.parameters(recurse=False) if not p.requires_grad]
    return ",".join(sorted({str(p.dtype).removeprefix("torch.") for p in frozen})) or "trained"


def base_layout(model: nn.Module) -> dict[str, str]:
    """``{"linears": ..., "experts": ...}``: each kind's forms, sorted and joined
    (``bfloat16,nf4``: NF4 linears and a 16-bit head); a kind the model lacks is absent."""
    forms: dict[str, set[str]] = {}
    for module in model.modules():
        if is_fused_experts(module):
            forms.setdefault("experts", set()).add(_experts_form(module))
        elif isinstance(module, nn.Linear) and (form := _linear_form(module)) is not None:
            forms.setdefault("linears", set()).add(form)
    return {kind: ",".join(sorted(f)) for kind, f in sorted(forms.items())}


def expected_layout(quantize: str) -> dict[str, str]:
    """The part of :func:`base_layout` the config alone decides, before any weights load:
    under ``lora.quantize nf4`` an MoE's fused experts are NF4 (this version's rule; the
    form of the rest depends on what the loader and peft leave frozen)."""
    return {"experts": "nf4"} if quantize == "nf4" else {}


def check_layout(
    meta: Mapping[str, Any], now: Mapping[str, str], where: str, *, partial: bool = False
) -> None:
    """Refuse a checkpoint whose base was held in another form than this build holds it
    (nothing to check in one written before the record existed). ``partial``: ``now`` is
    :func:`expected_layout`, so only the kinds both name are compared."""
    saved = meta.get("base_layout")
    if saved is None:
        return
    kinds = sorted(set(saved) & set(now) if partial else set(saved) | set(now))
    diff = "; ".join(
        f"{k}: {saved.get(k, 'absent')} -> {now.get(k, 'absent')}"
        for k in kinds
        if saved.get(k) != now.get(k)
    )
    if diff:
        raise ConfigError(
            f"cannot resume from {where}: its base was held in another form than this "
            f"version of shoestring holds it ({diff}), so the adapter would continue "
            "against other weights. Resume it with the version that wrote it, or start "
            "a new output_dir (or --resume never)"
        )


def versions() -> dict[str, str]:
    """The libraries that compute a step, as every checkpoint records them."""
    import peft
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__}
    out["peft"] = peft.__version__
    try:
        import bitsandbytes
    except ImportError:
        return out
    return out | {"bitsandbytes": bitsandbytes.__version__}


def changed_versions(saved: Mapping[str, str] | None, now: Mapping[str, str]) -> dict[str, str]:
    """``{"transformers": "5.25.0 -> 5.26.0"}``: what computes differently since the
    checkpoint (a resume then may not continue bit for bit; it is not refused)."""
    old = dict(saved or {})
    return {k: f"{old[k]} -> {v}" for k, v in sorted(now.items()) if k in old and old[k] != v}
