"""``dpo.precompute_ref``: DPO's reference log-probs, computed once, kept with the data.

Every training example's log-probability under the reference (the base with the
adapter disabled, eval mode, no grad) is computed in fixed batches and committed beside
the tokenized cache, under ``<cache>/data/ref-<key>/`` with the same protocol
(:mod:`shoestring.dircommit`: staging folder, data fsynced, manifest last with the
file's sha256, rename). The key covers what the numbers depend on: the tokenized data's
key, the base model's fingerprint, its dtype, quantization and attention kernel, the
compute precision, the device kind and the batching. A copy whose sha256 does not
verify is removed and computed again; a resume reads the same bytes, so the run stays
bit-exact after a kill. Ranks that find no copy each compute it (an FSDP forward needs
every rank) and the first to take the lock commits it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from shoestring.data.cache import cache_key
from shoestring.dircommit import commit_dir, held_lock, staging_dir, uncommit
from shoestring.train.config import FinetuneConfig
from shoestring.train.dataset import TrainData, cache_root
from shoestring.train.device import Precision, to_device
from shoestring.train.objective import reference_logps
from shoestring.train.samples import ExampleStore, PairSamples, collate_padded

log = logging.getLogger("shoestring.data")

#: Bumped when what is stored or how it is computed changes; part of the key.
REF_FORMAT = 1
#: Examples per reference forward (fixed: the numbers must not depend on the run's batch).
REF_BATCH = 16
MANIFEST = "manifest.json"
VALUES = "ref_logps.npy"

Values = npt.NDArray[np.float64]


def reference_key(cfg: FinetuneConfig, data_key: str, base_fp: str, device: str) -> str:
    return "ref-" + cache_key(
        {
            "ref_format": REF_FORMAT,
            "data": data_key,
            "base": base_fp,
            "dtype": cfg.model.dtype,
            "quantize": cfg.lora.quantize,
            "attn": cfg.model.attn_implementation,
            "precision": cfg.train.precision,
            "device": device,
            "batch": REF_BATCH,
        }
    )


def compute_reference(
    model: Any, store: ExampleStore, pad_id: int, device: torch.device, precision: Precision
) -> Values:
    """Every example's summed answer log-prob under the reference, in store order."""
    out = np.zeros(len(store), dtype=np.float64)
    for start in range(0, len(store), REF_BATCH):
        rows = range(start, min(start + REF_BATCH, len(store)))
        batch = to_device(collate_padded([store[i] for i in rows], pad_id), device)
        with precision.autocast():
            logps = reference_logps(model, batch)
        out[start : start + len(rows)] = logps.double().cpu().numpy()
    return out


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _open(path: Path, count: int) -> Values | None:
    """The committed values at ``path`` if they verify (sha256, count), else None."""
    try:
        doc = json.loads((path / MANIFEST).read_text())
        if doc["count"] != count or _sha256(path / VALUES) != doc["sha256"]:
            raise ValueError("does not match its manifest")
        values: Values = np.load(path / VALUES)
        return values
    except (OSError, ValueError, KeyError) as e:
        log.warning("reference log-probs at %s not usable, computing again: %s", path, e)
        return None


def _commit(path: Path, values: Values) -> None:
    with staging_dir(path.parent, path.name) as tmp:
        with open(tmp / VALUES, "wb") as f:
            np.save(f, values)
            f.flush()
            os.fsync(f.fileno())
        manifest = {"count": len(values), "sha256": _sha256(tmp / VALUES), "format": REF_FORMAT}
        commit_dir(tmp, path, MANIFEST, (json.dumps(manifest, sort_keys=True) + "\n").encode())


def cached_reference(path: Path, count: int, compute: Callable[[], Values]) -> Values:
    """The values committed at ``path``, or ``compute()`` committed there first."""
    if (path / MANIFEST).is_file():
        values = _open(path, count)
        if values is not None:
            return values
    values = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    with held_lock(path.parent / f"{path.name}.lock"):
        if (path / MANIFEST).is_file() and _open(path, count) is not None:
            return values  # another rank committed the same numbers meanwhile
        if path.exists():
            uncommit(path, MANIFEST)
        _commit(path, values)
    return values


def with_reference(
    cfg: FinetuneConfig,
    run: Any,
    data: TrainData,
    model: Any,
    base_fp: str,
    precision: Precision,
    data_key: str,
    pad_id: int,
) -> TrainData:
    """``data`` whose pairs carry their precomputed reference log-probs."""
    assert isinstance(data.samples, PairSamples), "dpo.precompute_ref needs pairs"
    store, device = data.samples.store, run.strategy.device
    path = cache_root(run.opts.cache_dir) / reference_key(cfg, data_key, base_fp, device.type)
    values = cached_reference(
        path, len(store), lambda: compute_reference(model, store, pad_id, device, precision)
    )
    summary = {**data.summary, "reference_logps": path.name}
    return replace(data, samples=PairSamples(store, values), summary=summary)
