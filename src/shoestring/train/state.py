"""What a fine-tuning checkpoint holds, and how it is captured and restored.

Files (all written by the generic commit protocol, none pickled):

``adapter.safetensors``     trainable (LoRA) parameters by name
``optimizer.safetensors``   optimizer state tensors, ``state.<param index>.<key>``
``rng_rank<R>.safetensors`` torch CPU/CUDA generator states, numpy key array
``trainer_state.json``      step, data cursor, tokens, scheduler, scaler, optimizer
                            param groups, python/numpy RNG scalars, resolved config
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import numpy as np
import torch

from shoestring.checkpoint import Snapshot, make_snapshot

ADAPTER = "adapter.safetensors"
OPTIMIZER = "optimizer.safetensors"
STATE = "trainer_state.json"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.safetensors"


@dataclass
class Progress:
    """Counters that define where training is. ``consumed`` is the data cursor."""

    step: int = 0
    consumed: int = 0
    tokens: int = 0


def seed_everything(seed: int) -> None:
    """Seed every generator a checkpoint captures, so fresh runs are reproducible too."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _rng_capture() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()  # type: ignore[misc]
    tensors["numpy_keys"] = torch.from_numpy(np.asarray(np_keys, dtype=np.int64))
    doc = {"python": [py_version, list(py_state), py_gauss],
           "numpy": [np_name, int(np_pos), int(np_has_gauss), float(np_gauss)]}
    return tensors, doc


def _rng_restore(tensors: Mapping[str, torch.Tensor], doc: Mapping[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda_")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    v, state, gauss = doc["python"]
    random.setstate((v, tuple(state), gauss))
    name, pos, has_gauss, cached = doc["numpy"]
    keys = tensors["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state((name, keys, pos, has_gauss, cached))


def capture(progress: Progress, params: Mapping[str, torch.nn.Parameter],
            optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any, *, rank: int,
            config: Mapping[str, Any], meta: Mapping[str, Any]) -> Snapshot:
    """Copy the complete training state to host memory (the blocking part of a save)."""
    osd = optimizer.state_dict()
    opt_tensors: dict[str, torch.Tensor] = {}
    opt_scalars: dict[str, Any] = {}
    for idx, st in osd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                opt_tensors[f"state.{idx}.{k}"] = v
            else:
                opt_scalars[f"{idx}.{k}"] = v
    rng_tensors, rng_doc = _rng_capture()
    sched = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    doc = {
        "progress": asdict(progress),
        "param_names": list(params),
        "optimizer": {"param_groups": osd["param_groups"], "scalars": opt_scalars},
        "scheduler": sched,
        "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
        "rng": {str(rank): rng_doc},
        "config": dict(config),
    }
    return make_snapshot(progress.step,
                         {ADAPTER: dict(params), OPTIMIZER: opt_tensors, rng_file(rank): rng_tensors},
                         {STATE: doc},
                         {**meta, "step": progress.step, "consumed": progress.consumed})


def restore(tensors: Mapping[str, Mapping[str, torch.Tensor]], docs: Mapping[str, Any],
            params: Mapping[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer,
            scheduler: Any, scaler: Any, *, rank: int) -> Progress:
    doc = docs[STATE]
    if list(params) != doc["param_names"]:
        missing = sorted(set(doc["param_names"]) ^ set(params))[:5]
        raise ValueError(f"checkpoint adapter does not match the model's trainable "
                         f"parameters (e.g. {missing}); was lora.* or model.path changed?")
    adapter = tensors[ADAPTER]
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(adapter[name])
    state: dict[int, dict[str, Any]] = {}
    for key, v in tensors[OPTIMIZER].items():
        _, idx, k = key.split(".", 2)
        state.setdefault(int(idx), {})[k] = v.clone()
    for key, v in doc["optimizer"]["scalars"].items():
        idx, k = key.split(".", 1)
        state.setdefault(int(idx), {})[k] = v
    optimizer.load_state_dict({"state": state, "param_groups": doc["optimizer"]["param_groups"]})
    sched = dict(doc["scheduler"])
    sched["lr_lambdas"] = [None] * len(optimizer.param_groups)
    scheduler.load_state_dict(sched)
    if scaler is not None and doc.get("scaler"):
        scaler.load_state_dict(doc["scaler"])
    _rng_restore(tensors[rng_file(rank)], doc["rng"][str(rank)])
    return Progress(**doc["progress"])
