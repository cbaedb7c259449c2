"""``dpo.precompute_ref``: DPO's reference log-probs, computed once, kept with the data.

Every training example's log-probability under the reference (the base with the
adapter disabled, eval mode, no grad) is computed in fixed batches and committed beside
the tokenized cache, under ``<cache>/data/ref-<key>/`` with the same protocol
(:mod:`shoestring.dircommit`: staging folder, data fsynced, manifest last with the
file's sha256, rename). The key covers what the numbers depend on: the tokenized data's
key, the base model's fingerprint, its dtype, quantization and attention kernel, the
compute precision, the device kind and the batching. A copy whose sha256 does not
verify is removed and computed again; a resume reads the same bytes, so the run stays
bit-exact after a kill.

With several ranks the choice is collective: the copy is used only when every rank
has one that verifies; otherwise the ranks compute the values together, each batch
once (batch ``b`` on rank ``b % world_size``, every rank running as many forwards as the
busiest one: an FSDP2 forward all-gathers from every rank), and one float64 sum
all-reduce gives every rank the same bytes (each slot has one contributor: exact). The
first rank to take the lock commits them; every rank then trains on rank 0's values.

The held-out pairs that evaluation reads (``eval.max_samples``) get theirs the same
way, under a key over their tokens (``data`` = ``eval-<sha256>``) and batched as
evaluation batches them (``eval.batch_size`` pairs, in the key): evaluation then runs no
reference forward and reports what it would have computed with one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from shoestring.data.cache import cache_key
from shoestring.data.records import Example
from shoestring.dircommit import commit_dir, held_lock, staging_dir, uncommit
from shoestring.train.config import FinetuneConfig
from shoestring.train.dataset import TrainData, cache_root
from shoestring.train.device import Precision, to_device
from shoestring.train.objective import held_out_pairs, reference_logps
from shoestring.train.samples import ExampleStore, PairSamples, collate_padded

log = logging.getLogger("shoestring.data")

#: Bumped when what is stored or how it is computed changes; part of the key.
REF_FORMAT = 1
#: Examples per reference forward (fixed: the numbers must not depend on the run's batch).
REF_BATCH = 16
MANIFEST = "manifest.json"
VALUES = "ref_logps.npy"

Values = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Layout:
    """Which examples share a reference forward (padding to the longest row changes the
    last bits). Training: fixed chunks of :data:`REF_BATCH` examples (the numbers must
    not depend on the run's batch). Evaluation (``pairs``): its own batches of that many
    pairs, the chosen rows first, as it collates them, so the values are the ones its
    reference forward would compute, bit for bit on the same device."""

    pairs: int = 0

    @property
    def key(self) -> int | str:
        return f"pairs-{self.pairs}" if self.pairs else REF_BATCH

    def batches(self, count: int) -> list[list[int]]:
        """The example indices of each reference forward over ``count`` examples."""
        if not self.pairs:
            return [list(range(s, min(s + REF_BATCH, count))) for s in range(0, count, REF_BATCH)]
        n = count // 2
        spans = (range(s, min(s + self.pairs, n)) for s in range(0, n, self.pairs))
        return [[2 * p for p in ps] + [2 * p + 1 for p in ps] for ps in spans]


def reference_key(
    cfg: FinetuneConfig, data_key: str, base_fp: str, device: str, layout: Layout = Layout()
) -> str:
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
            "batch": layout.key,
        }
    )


@dataclass(frozen=True)
class Ranks:
    """Who computes which batch: this process's rank among ``world_size``."""

    rank: int = 0
    world_size: int = 1

    def batches(self, count: int) -> list[int | None]:
        """This rank's batches, in rounds that every rank runs together; None: a round
        with nothing left here (the rank repeats a forward and keeps nothing)."""
        rounds = -(-count // self.world_size)
        own = [r * self.world_size + self.rank for r in range(rounds)]
        return [b if b < count else None for b in own]

    def combine(self, values: Values, device: torch.device) -> Values:
        """Every rank's slots into one array, the same bytes on every rank (through
        ``device``: NCCL reduces only CUDA tensors)."""
        if self.world_size == 1:
            return values
        import torch.distributed as dist

        t = torch.from_numpy(values).to(device)
        dist.all_reduce(t)
        combined: Values = t.cpu().numpy()
        return combined


def compute_reference(
    model: Any,
    store: ExampleStore,
    pad_id: int,
    device: torch.device,
    precision: Precision,
    ranks: Ranks = Ranks(),
    layout: Layout = Layout(),
) -> Values:
    """Every example's summed answer log-prob under the reference, in store order
    (this rank's batches; with ``ranks``, combined over the ranks)."""
    out = np.zeros(len(store), dtype=np.float64)
    batches = layout.batches(len(store))
    for b in ranks.batches(len(batches)):
        rows = batches[-1 if b is None else b]
        batch = to_device(collate_padded([store[i] for i in rows], pad_id), device)
        with precision.autocast():
            logps = reference_logps(model, batch)
        if b is not None:
            out[rows] = logps.double().cpu().numpy()
    return ranks.combine(out, device)


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


def cached_reference(
    path: Path,
    count: int,
    compute: Callable[[], Values],
    all_agree: Callable[[bool], bool] = bool,
) -> Values:
    """The values committed at ``path`` when every rank (``all_agree``) has a copy that
    verifies, else ``compute()`` (every rank calls it) committed there first."""
    found = _open(path, count) if (path / MANIFEST).is_file() else None
    if all_agree(found is not None) and found is not None:
        return found
    values = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    with held_lock(path.parent / f"{path.name}.lock"):
        if (path / MANIFEST).is_file() and _open(path, count) is not None:
            return values  # another rank committed the same numbers meanwhile
        if path.exists():
            uncommit(path, MANIFEST)
        _commit(path, values)
    return values


def examples_digest(examples: Sequence[Example]) -> str:
    """sha256 over the examples' token ids and labels: what their log-probs depend on."""
    h = hashlib.sha256()
    for ex in examples:
        h.update(json.dumps([ex.input_ids, ex.labels]).encode() + b"\n")
    return h.hexdigest()


@dataclass(frozen=True)
class ReferenceJob:
    """What every reference computation of a run shares: where, on what, with what."""

    cfg: FinetuneConfig
    run: Any
    model: Any
    base_fp: str
    precision: Precision
    pad_id: int

    def values(
        self, store: ExampleStore, data_key: str, layout: Layout = Layout()
    ) -> tuple[Values, str]:
        """``store``'s reference log-probs (committed or computed) and their folder name."""
        strategy = self.run.strategy
        device, ranks = strategy.device, Ranks(strategy.rank, strategy.world_size)
        key = reference_key(self.cfg, data_key, self.base_fp, device.type, layout)
        path = cache_root(self.run.opts.cache_dir) / key

        def compute() -> Values:
            return compute_reference(
                self.model, store, self.pad_id, device, self.precision, ranks, layout
            )

        values = cached_reference(path, len(store), compute, strategy.all_agree)
        return strategy.share(values), path.name  # rank 0's bytes on every rank


def with_reference(job: ReferenceJob, data: TrainData, data_key: str) -> TrainData:
    """``data`` whose training pairs, and the held-out pairs evaluation reads, carry
    their precomputed reference log-probs."""
    assert isinstance(data.samples, PairSamples), "dpo.precompute_ref needs pairs"
    store = data.samples.store
    values, name = job.values(store, data_key)
    summary = {**data.summary, "reference_logps": name}
    held_out = held_out_pairs(data.eval_examples, job.cfg.eval.max_samples)
    eval_ref = None
    if held_out:
        eval_ref, summary["eval_reference_logps"] = job.values(
            held_out, "eval-" + examples_digest(held_out), Layout(pairs=job.cfg.eval.batch_size)
        )
    return replace(
        data,
        samples=PairSamples(store, values),
        eval_examples=held_out,
        eval_ref=eval_ref,
        summary=summary,
    )
