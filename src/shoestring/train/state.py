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
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from shoestring.checkpoint import Snapshot, make_snapshot
from shoestring.checkpoint.manifest import CorruptCheckpoint, Manifest
from shoestring.checkpoint.sharded import is_sharded
from shoestring.config import ConfigError
from shoestring.train.learner import Learner

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


def require_complete(manifest: Manifest) -> None:
    """A fine-tuning checkpoint lists every file a resume loads; one that verifies but
    lacks one (a bug, a hand-edited or foreign manifest) is invalid, not a crash loop."""
    if is_sharded(manifest.files):
        needed = [STATE]
    else:
        needed = [ADAPTER, OPTIMIZER, STATE]
    missing = [n for n in needed if n not in manifest.files]
    if missing:
        raise CorruptCheckpoint(
            f"step {manifest.step}: the manifest lacks {', '.join(missing)}, which a resume needs"
        )


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
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    tensors["numpy_keys"] = torch.from_numpy(np.asarray(np_keys, dtype=np.int64))
    doc = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_name, int(np_pos), int(np_has_gauss), float(np_gauss)],
    }
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


def capture(
    progress: Progress,
    learner: Learner,
    *,
    rank: int,
    config: Mapping[str, Any],
    meta: Mapping[str, Any],
) -> Snapshot:
    """Copy the complete training state to host memory (the blocking part of a save)."""
    osd = learner.optimizer.state_dict()
    opt_tensors: dict[str, torch.Tensor] = {}
    opt_scalars: dict[str, Any] = {}
    for idx, st in osd["state"].items():
        # bitsandbytes packs its 8-bit state one level down
        # ("__bnb_optimizer_quant_state__": {state1, absmax1, qmap1, ...}); flatten it
        # as "<key>.<sub key>" and nest it back on restore.
        flat = {
            f"{k}.{k2}" if isinstance(v, dict) else k: v2
            for k, v in st.items()
            for k2, v2 in (v.items() if isinstance(v, dict) else [(None, v)])
        }
        for k, v in flat.items():
            if torch.is_tensor(v):
                opt_tensors[f"state.{idx}.{k}"] = v
            else:
                opt_scalars[f"{idx}.{k}"] = v
    rng_tensors, rng_doc = _rng_capture()
    doc = {
        "progress": asdict(progress),
        "param_names": learner.param_names,
        "optimizer": {"param_groups": osd["param_groups"], "scalars": opt_scalars},
        **_schedule_docs(learner),
        "rng": {str(rank): rng_doc},
        "config": dict(config),
    }
    return make_snapshot(
        progress.step,
        {ADAPTER: dict(learner.params), OPTIMIZER: opt_tensors, rng_file(rank): rng_tensors},
        {STATE: doc},
        {**meta, "step": progress.step, "consumed": progress.consumed},
    )


def restore(
    tensors: Mapping[str, Mapping[str, torch.Tensor]],
    docs: Mapping[str, Any],
    learner: Learner,
    *,
    rank: int,
) -> Progress:
    doc, params = docs[STATE], learner.params
    if list(params) != doc["param_names"]:
        missing = sorted(set(doc["param_names"]) ^ set(params))[:5]
        raise ConfigError(
            f"checkpoint adapter does not match the model's trainable "
            f"parameters (e.g. {missing}); was lora.* or model.path changed?"
        )
    adapter = tensors[ADAPTER]
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(adapter[name])
    state: dict[int, dict[str, Any]] = {}
    for key, v in tensors[OPTIMIZER].items():
        _, idx, k = key.split(".", 2)
        _put(state.setdefault(int(idx), {}), k, v.clone())
    for key, v in doc["optimizer"]["scalars"].items():
        idx, k = key.split(".", 1)
        _put(state.setdefault(int(idx), {}), k, v)
    groups = doc["optimizer"]["param_groups"]
    learner.optimizer.load_state_dict({"state": state, "param_groups": groups})
    _load_schedule(doc, learner)
    if rng_file(rank) in tensors:  # absent for ranks beyond the saved world size
        _rng_restore(tensors[rng_file(rank)], doc["rng"][str(rank)])
    return Progress(**doc["progress"])


def _put(st: dict[str, Any], key: str, v: Any) -> None:
    """Set ``st[key]``, or ``st[a][b]`` for a flattened nested key ``"a.b"``."""
    if "." in key:
        outer, inner = key.split(".", 1)
        st.setdefault(outer, {})[inner] = v
    else:
        st[key] = v


# --------------------------------------------------------------------------- distributed
# At world size > 1 the adapter and optimizer go through torch.distributed.checkpoint
# (FQN-keyed, resharded on load); each rank adds its RNG files, rank 0 the trainer state.


def _dcp_options(**kw: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, **kw)


def dcp_state(learner: Learner) -> dict[str, Any]:
    """The sharded state of the wrapped model (plain, DDP or FSDP2) and its optimizer,
    by FQN."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model, optimizer = learner.wrapped, learner.optimizer
    return {
        "model": _trainable_only(model, get_model_state_dict(model, options=_dcp_options())),
        "optim": get_optimizer_state_dict(model, optimizer, options=_dcp_options()),
    }


def _trainable_only(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """The trainable parameters of a model state dict. ``ignore_frozen_params`` drops
    frozen parameters but not the extra tensors a frozen module adds (bitsandbytes'
    4-bit quant states: ``weight.absmax``, ...), which a layer sharded by FSDP2 does not
    add: a checkpoint carrying them or not would then depend on the strategy, and one
    process could not load an FSDP2 checkpoint. DDP's ``module.`` is not in DCP names."""
    names = {n.removeprefix("module.") for n, p in model.named_parameters() if p.requires_grad}
    missing = names - state.keys()
    if missing:
        raise RuntimeError(f"trainable parameters not in the state dict: {sorted(missing)[:3]}")
    return {k: v for k, v in state.items() if k in names}


def rank_files(
    progress: Progress,
    learner: Learner,
    *,
    rank: int,
    world_size: int,
    config: Mapping[str, Any],
) -> dict[str, bytes]:
    """This rank's own small files of a sharded checkpoint (rank 0 adds the trainer state)."""
    import json

    from safetensors.torch import save

    rng_tensors, rng_doc = _rng_capture()
    files = {rng_file(rank): save(rng_tensors), rng_doc_file(rank): json.dumps(rng_doc).encode()}
    if rank == 0:
        doc = {
            "progress": asdict(progress),
            "param_names": learner.param_names,
            **_schedule_docs(learner),
            "world_size": world_size,
            "config": dict(config),
        }
        files[STATE] = json.dumps(doc, indent=1, sort_keys=True).encode()
    return files


def rng_doc_file(rank: int) -> str:
    return f"rng_rank{rank}.json"


def restore_sharded(path: Any, learner: Learner, *, rank: int, group: Any) -> tuple[Progress, bool]:
    """Load a DCP checkpoint into ``model`` at any world size (also a single process).

    Returns the progress and whether this rank found its own RNG streams (it
    does not after a change of world size to more ranks than were saved).
    """
    import json
    from pathlib import Path

    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    path, model, optimizer = Path(path), learner.wrapped, learner.optimizer
    state = dcp_state(learner)
    dcp_load(state, checkpoint_id=str(path), process_group=group, no_dist=not dist.is_initialized())
    set_model_state_dict(model, state["model"], options=_dcp_options(strict=False))
    set_optimizer_state_dict(model, optimizer, state["optim"], options=_dcp_options())
    doc = json.loads((path / STATE).read_text())
    _load_schedule(doc, learner)
    own = (path / rng_file(rank)).is_file()
    if own:
        _rng_restore(
            load_file(str(path / rng_file(rank))),
            json.loads((path / rng_doc_file(rank)).read_text()),
        )
    return Progress(**doc["progress"]), own


def restore_full(
    tensors: Mapping[str, Mapping[str, torch.Tensor]], docs: Mapping[str, Any], learner: Learner
) -> Progress:
    """Load a single-process checkpoint into a sharded (FSDP2) model: full tensors in,
    each rank keeps its shard."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    doc = docs[STATE]
    names: list[str] = doc["param_names"]
    ostate: dict[str, dict[str, Any]] = {}
    for key, v in tensors[OPTIMIZER].items():
        _, idx, k = key.split(".", 2)
        ostate.setdefault(names[int(idx)], {})[k] = v
    for key, v in doc["optimizer"]["scalars"].items():
        idx, k = key.split(".", 1)
        ostate.setdefault(names[int(idx)], {})[k] = v
    groups = [
        dict(g, params=[names[i] for i in g["params"]]) for g in doc["optimizer"]["param_groups"]
    ]
    full = _dcp_options(full_state_dict=True, strict=False)
    model = learner.wrapped
    set_model_state_dict(model, dict(tensors[ADAPTER]), options=full)
    osd: Any = {"state": ostate, "param_groups": groups}  # keyed by FQN, as DCP expects
    options = _dcp_options(full_state_dict=True)
    set_optimizer_state_dict(model, learner.optimizer, osd, options=options)
    _load_schedule(doc, learner)
    return Progress(**doc["progress"])


def _schedule_docs(learner: Learner) -> dict[str, Any]:
    """The scheduler's and the gradient scaler's state, as the trainer state holds them."""
    scheduler, scaler = learner.scheduler, learner.scaler
    return {
        "scheduler": {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"},
        "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
    }


def _load_schedule(doc: Mapping[str, Any], learner: Learner) -> None:
    scheduler, scaler = learner.scheduler, learner.scaler
    sched = dict(doc["scheduler"])
    sched["lr_lambdas"] = [None] * len(learner.optimizer.param_groups)
    scheduler.load_state_dict(sched)
    # The loaded param-group lr came from the old schedule; if train.max_steps changed
    # (a resume-safe key) the new schedule decides the next step's lr. Unchanged: same value.
    for group, base, fn in zip(
        scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas
    ):
        group["lr"] = base * fn(scheduler.last_epoch)
    if scaler is not None and doc.get("scaler"):
        scaler.load_state_dict(doc["scaler"])


def seed_micro_batch(seed: int, step: int, chunk: int) -> None:
    """Seed dropout for micro-batch ``chunk`` of optimizer step ``step``.

    The chunk index counts micro-batches across the whole global batch, so the
    masks depend on (seed, step, chunk) only — not on which rank computes the
    chunk, nor on the world size. That is what lets a run resume at another
    world size and draw the same masks (given the same micro-batch size).

    The seed is a hash, not an arithmetic mix: nearby seeds (step, step + 1) gave
    visibly correlated dropout streams and a default run that learned far worse.
    """
    import hashlib

    h = hashlib.blake2b(f"{seed}:{step}:{chunk}".encode(), digest_size=8).digest()
    torch.manual_seed(int.from_bytes(h, "little") >> 1)


def digest(flat: Mapping[str, Any]) -> str:
    """sha256 over sorted keys and tensor bytes: equal digests mean equal state."""
    import hashlib

    h = hashlib.sha256()
    for k in sorted(flat):
        v = flat[k]
        h.update(k.encode())
        if torch.is_tensor(v):
            t = v.detach().cpu().contiguous()
            h.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(v).encode())
    return h.hexdigest()[:16]


def flat_optimizer_state(state: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``{fqn: {key: value}}`` → ``{"fqn.key": value}``."""
    return {f"{fqn}.{k}": v for fqn, st in state.items() for k, v in st.items()}


def state_digests(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """Digests of the complete adapter and optimizer state, whatever the sharding
    (a collective under FSDP2: call on every rank). Logged at resume so a run can prove
    what it continued from."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    full = _dcp_options(full_state_dict=True)  # (cpu_offload would leave ranks > 0 empty)
    msd = get_model_state_dict(model, options=full)
    osd: Any = get_optimizer_state_dict(model, optimizer, options=full)
    return {"adapter_sha": digest(msd), "optimizer_sha": digest(flat_optimizer_state(osd["state"]))}
