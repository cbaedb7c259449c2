"""Loading the frozen base, timed: from the quantized-base cache, or read and quantized
(and then cached). The ``load`` event says which, and where the seconds went."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoestring.checkpoint import RemoteStore
from shoestring.train.config import FinetuneConfig
from shoestring.train.model import (
    empty_base_model,
    load_base_model,
    load_prequantized,
    require_bitsandbytes,
    stored_quantization,
)
from shoestring.train.nf4experts import QuantizedExperts
from shoestring.train.nf4stored import restorable
from shoestring.train.onereader import share_quant_states
from shoestring.train.qbase import QBASE_DIR, QuantizedBaseCache, QuantKey, timing
from shoestring.train.run import Run
from shoestring.train.towers import kept_unquantized

#: The bitsandbytes function each quantization spends its time in (called per weight).
_QUANTIZER = {"nf4": "quantize_4bit", "int8": "int8_vectorwise_quant"}


@dataclass(frozen=True)
class LoadedBase:
    model: Any
    fields: dict[str, Any]  # the ``load`` event


def qbase_cache(cfg: FinetuneConfig, run: Run) -> QuantizedBaseCache | None:
    """The cache for this run, or None (no quantization, or ``lora.cache_quantized`` off)."""
    if cfg.lora.quantize == "none" or not cfg.lora.cache_quantized:
        return None
    storage = cfg.checkpoint.storage
    remote = None
    if run.remote is not None and storage:
        remote = RemoteStore(f"{storage.rstrip('/')}/{QBASE_DIR}")
    return QuantizedBaseCache(run.opts.cache_dir / QBASE_DIR, remote, run.events.emit)


def load_base(cfg: FinetuneConfig, run: Run, model_dir: Path, base_fp: str) -> LoadedBase:
    """The base as this rank starts from: read (and quantized, or from the cache), or,
    where one rank reads for all (FSDP2), built on the meta device to receive its shards
    from the reader when the strategy wraps it."""
    strategy = run.strategy
    if strategy.base_reader is not None and strategy.rank != strategy.base_reader:
        return _receive_base(cfg, run, model_dir)
    read_before = _disk_read_bytes()
    loaded = _load_base(cfg, run, model_dir, base_fp)
    if (experts := QuantizedExperts.of(loaded.model)) is not None:
        loaded.fields.update(experts.fields())
    # Memory-mapped safetensors are read on first touch, inside whatever touches them
    # first (bitsandbytes' quantizer, for a quantized load): the bytes say how much came
    # from the disk rather than the page cache.
    loaded.fields["disk_read_bytes"] = _disk_read_bytes() - read_before
    if strategy.base_reader is not None:
        loaded.fields["quant_state_bytes"] = share_quant_states(loaded.model, strategy.all_agree)
    return loaded


def _receive_base(cfg: FinetuneConfig, run: Run, model_dir: Path) -> LoadedBase:
    """A rank that does not read: the base on the meta device, with the reader's quant
    states (nf4); its weights arrive when the strategy wraps it."""
    model = empty_base_model(model_dir, cfg.model, cfg.lora.quantize)
    moved = share_quant_states(model, run.strategy.all_agree)
    return LoadedBase(model, {"source": "broadcast", "quant_state_bytes": moved})


def _disk_read_bytes() -> int:
    import psutil

    try:
        return int(psutil.Process().io_counters().read_bytes)
    except (psutil.Error, AttributeError, OSError):
        return 0


def _load_base(cfg: FinetuneConfig, run: Run, model_dir: Path, base_fp: str) -> LoadedBase:
    device = run.strategy.load_device()
    if stored_quantization(model_dir) != "none":  # a *-bnb-4bit base: loaded as stored
        t0 = time.perf_counter()
        model = load_prequantized(model_dir, model_dir, cfg.model, device)
        fields = {"source": "model_dir", "stored": cfg.lora.quantize, "quantize_s": 0.0}
        return LoadedBase(model, fields | {"read_s": round(time.perf_counter() - t0, 3)})
    cache = qbase_cache(cfg, run)
    kept = kept_unquantized(model_dir) if cache else None
    key = QuantKey.of(base_fp, cfg.lora.quantize, cfg.model.dtype, device, kept) if cache else None
    found = cache.find(key) if cache and key else None
    t0 = time.perf_counter()
    if found is not None:
        model = load_prequantized(found.path, model_dir, cfg.model, device)
        return LoadedBase(
            model,
            {
                "source": f"qbase-{found.source}",
                "verify_s": round(found.verify_s, 3),
                "read_s": round(time.perf_counter() - t0, 3),
                "quantize_s": 0.0,
            },
        )
    model, quantize_s = _read_and_quantize(cfg, model_dir, device)
    fields = {
        "source": "model_dir",
        "read_s": round(time.perf_counter() - t0 - quantize_s, 3),
        "quantize_s": round(quantize_s, 3),
    }
    if cache is None or key is None or run.strategy.rank != 0:
        return LoadedBase(model, fields)
    if QuantizedExperts.of(model) is not None and not restorable():
        fields["qbase_skipped"] = "NF4 experts (this transformers cannot restore them)"
    else:
        t_save = time.perf_counter()
        cache.store(model, key)
        fields.update(qbase_saved=key.name, save_s=round(time.perf_counter() - t_save, 3))
    return LoadedBase(model, fields)


def _read_and_quantize(cfg: FinetuneConfig, model_dir: Path, device: str) -> tuple[Any, float]:
    quantize = cfg.lora.quantize
    if quantize == "none":
        return load_base_model(model_dir, cfg.model, quantize, device), 0.0
    bnb = require_bitsandbytes("lora.quantize")
    with timing(bnb.functional, _QUANTIZER[quantize]) as quantizer:
        model = load_base_model(model_dir, cfg.model, quantize, device)
    return model, quantizer.seconds
