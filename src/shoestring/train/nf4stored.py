"""NF4 experts (:mod:`.nf4experts`) saved beside a quantized base and read back, so the
quantized-base cache (:mod:`.qbase`) keeps a mixture of experts too.

``save_pretrained`` writes bitsandbytes' 4-bit linears, but the NF4 expert stacks are
not parameters: the model holds stride-0 placeholders where the fused experts were,
which it must not write (a placeholder made contiguous is the whole 16-bit stack).
:func:`save_quantized` leaves them out of the state dict and writes every stack to one
more file, :data:`EXPERTS_FILE`: each expert's packed bytes and its QuantState in
bitsandbytes' own serialization (``QuantState.as_dict(packed=True)``, read back by
``QuantState.from_dict``, as bitsandbytes' ``Linear4bit`` saves and loads its own).

Reading it back, transformers' loader finds the experts missing; it would materialize
each as an empty 16-bit stack and initialize it (a whole 16-bit model's worth of
experts). :func:`stacks_restored`, around ``from_pretrained``, installs each stack and
its placeholder as the load finalizes, before that happens, and takes those keys off
the loader's missing keys.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shoestring.train.nf4experts import ExpertStack, install_stack, is_placeholder, stacks_of

#: Beside the quantized base's ``model.safetensors``: the NF4 expert stacks.
EXPERTS_FILE = "nf4_experts.safetensors"


def save_quantized(model: Any, directory: Path) -> None:
    """``save_pretrained`` of a quantized base, its NF4 experts (if any) in
    :data:`EXPERTS_FILE` and not as their placeholders."""
    stacks = {f"{m}.{p}": s for m, mod in model.named_modules() for p, s in stacks_of(mod).items()}
    with placeholders_detached(model):
        model.save_pretrained(str(directory), safe_serialization=True)
    if stacks:
        _save_stacks(stacks, directory / EXPERTS_FILE)


@contextmanager
def placeholders_detached(model: nn.Module) -> Iterator[None]:
    """Within: the modules hold no placeholder parameters, so neither the bitsandbytes
    quantizer's state dict nor transformers' conversion back to the stored per-expert
    layout sees them (``save_pretrained`` takes no state dict from a caller when the
    model is quantized)."""
    taken = []
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and is_placeholder(p):
                taken.append((module, name, module._parameters.pop(name)))
    try:
        yield
    finally:
        for module, name, p in taken:
            module._parameters[name] = p


def _save_stacks(stacks: dict[str, ExpertStack], path: Path) -> None:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    layout: dict[str, dict[str, Any]] = {}
    for key, stack in stacks.items():
        tensors[f"{key}.packed"] = stack.packed.contiguous()
        for e, state in enumerate(stack.states):
            for name, t in state.as_dict(packed=True).items():
                tensors[f"{key}.{e}.{name}"] = t.contiguous()
        layout[key] = {
            "shape": list(stack.shape),
            "dtype": str(stack.dtype).removeprefix("torch."),
            "transposed": stack.transposed,
        }
    save_file(tensors, str(path), metadata={"stacks": json.dumps(layout)})


def read_stacks(path: Path, device: torch.device) -> dict[str, ExpertStack]:
    """Every stack :func:`save_quantized` wrote to ``path``, on ``device``."""
    from bitsandbytes.functional import QuantState
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device=str(device)) as f:
        layout = json.loads(f.metadata()["stacks"])
        names = list(f.keys())
        stacks = {}
        for key, spec in layout.items():
            per_expert: dict[str, dict[str, torch.Tensor]] = {}
            for n in names:  # <key>.<expert>.<bitsandbytes' name>
                expert, sep, _ = n.removeprefix(f"{key}.").partition(".")
                if n.startswith(f"{key}.") and sep and expert.isdigit():
                    per_expert.setdefault(expert, {})[n] = f.get_tensor(n)
            states = tuple(
                QuantState.from_dict(per_expert[str(e)], device) for e in range(spec["shape"][0])
            )
            stacks[key] = ExpertStack(
                packed=f.get_tensor(f"{key}.packed"),
                states=states,
                shape=torch.Size(spec["shape"]),
                dtype=getattr(torch, spec["dtype"]),
                transposed=bool(spec["transposed"]),
            )
    return stacks


#: The loader's step :func:`stacks_restored` hooks (transformers 5's ``PreTrainedModel``).
_FINALIZE = "_finalize_model_loading"


def restorable() -> bool:
    """Whether this transformers has the loading step the stacks are installed at: the
    quantized-base cache keeps NF4 experts only then (else a restart quantizes again)."""
    from transformers import PreTrainedModel

    return isinstance(PreTrainedModel.__dict__.get(_FINALIZE), staticmethod)


@contextmanager
def stacks_restored(saved_dir: Path) -> Iterator[None]:
    """Within (around ``from_pretrained(saved_dir)``): the NF4 stacks in ``saved_dir``'s
    :data:`EXPERTS_FILE` take their parameters' places as the load finalizes, on the
    device the rest was loaded to; nothing happens where there is no such file."""
    path = saved_dir / EXPERTS_FILE
    if not path.is_file():
        yield
        return
    from transformers import PreTrainedModel

    original = PreTrainedModel.__dict__[_FINALIZE]

    def finalize(model: Any, load_config: Any, loading_info: Any) -> Any:
        restored = _install(model, read_stacks(path, _loaded_device(model)))
        loading_info.missing_keys = type(loading_info.missing_keys)(
            k for k in loading_info.missing_keys if k not in restored
        )
        return original.__func__(model, load_config, loading_info)

    setattr(PreTrainedModel, _FINALIZE, staticmethod(finalize))
    try:
        yield
    finally:
        setattr(PreTrainedModel, _FINALIZE, original)


def _install(model: nn.Module, stacks: dict[str, ExpertStack]) -> set[str]:
    for key, stack in stacks.items():
        path, _, name = key.rpartition(".")
        install_stack(model.get_submodule(path), name, stack)
    return set(stacks)


def _loaded_device(model: nn.Module) -> torch.device:
    """Where the loader put the weights it read (the experts are still on meta)."""
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")
