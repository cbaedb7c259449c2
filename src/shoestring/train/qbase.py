"""The quantized base, kept: a QLoRA restart reads 4-bit weights instead of re-quantizing.

Loading a 7B base and quantizing it to nf4 takes minutes on a small machine, and
every restart after a preemption paid it again. The first load saves the
quantized model with bitsandbytes' own 4-bit serialization (``save_pretrained``
of the quantized model: packed weights plus quant states; an MoE's NF4 experts in
one more file, :mod:`.nf4stored`), committed with the
checkpoint protocol (files durable, ``manifest.json`` with every file's size and
sha256 written last, then a rename), under ``<cache>/qbase/<key>`` and, when
``checkpoint.storage`` is set, beside the checkpoints in ``<storage>/qbase/<key>``
so a fresh spot machine fetches it rather than quantizing.

The key covers everything the quantized bytes depend on: the base's fingerprint,
the quantization, the compute dtype, the device kind that quantized it (CPU and
CUDA kernels need not agree bit for bit) and the bitsandbytes, transformers and
torch versions. A cached copy is used only if its manifest names that same key
and every file's sha256 matches; anything else is quarantined (locally) or
ignored (remote) and the base is quantized again — never used.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from shoestring.checkpoint import CorruptCheckpoint, RemoteStore, verify_dir
from shoestring.checkpoint.local import prune_quarantined, quarantine, seal
from shoestring.checkpoint.manifest import MANIFEST, Manifest
from shoestring.dircommit import staging_dir
from shoestring.train.nf4stored import save_quantized

QBASE_DIR = "qbase"
KIND = "quantized-base"

Emit = Callable[..., Any]


@dataclass(frozen=True)
class QuantKey:
    """What the quantized bytes depend on."""

    base_fingerprint: str
    quantize: str
    dtype: str
    device: str  # "cpu" | "cuda": who ran the quantization kernels
    bitsandbytes: str
    transformers: str
    torch: str
    # modules left unquantized besides transformers' default (a vision tower,
    # :mod:`.towers`); empty for a text model, whose keys stay as they were
    kept: tuple[str, ...] = ()

    @classmethod
    def of(
        cls,
        base_fingerprint: str,
        quantize: str,
        dtype: str,
        device: str,
        kept: Iterable[str] | None = None,
    ) -> QuantKey:
        import bitsandbytes
        import torch
        import transformers

        return cls(
            base_fingerprint,
            quantize,
            dtype,
            device.split(":")[0],
            bitsandbytes.__version__,
            transformers.__version__,
            torch.__version__,
            tuple(kept or ()),
        )

    def _fields(self) -> dict[str, Any]:
        fields = asdict(self)
        fields["kept"] = list(self.kept)  # as the manifest's JSON reads back
        if not self.kept:
            del fields["kept"]
        return fields

    @property
    def name(self) -> str:
        blob = json.dumps(self._fields(), sort_keys=True).encode()
        return f"{self.quantize}-{hashlib.sha256(blob).hexdigest()[:20]}"

    def meta(self) -> dict[str, Any]:
        return {"kind": KIND, **self._fields()}


@dataclass
class Found:
    path: Path
    source: str  # "local" | "remote"
    verify_s: float


@dataclass
class QuantizedBaseCache:
    """``root``: the local cache (``<cache_dir>/qbase``); ``remote``: ``<storage>/qbase``."""

    root: Path
    remote: RemoteStore | None = None
    emit: Emit = field(default=lambda *a, **k: None)

    def find(self, key: QuantKey) -> Found | None:
        """A verified copy for ``key``: local first, else fetched from the remote."""
        t0 = time.perf_counter()
        self._clean()
        local = self.root / key.name
        if (local / MANIFEST).is_file() and self._verified(local, key, "local"):
            return Found(local, "local", time.perf_counter() - t0)
        if self.remote is None or not self.remote.has(key.name):
            return None
        try:
            path = self.remote.fetch_as(key.name, self.root, deep=True)
        except (CorruptCheckpoint, OSError) as e:
            self._rejected(key, "remote", str(e))
            return None
        if not self._verified(path, key, "remote"):
            return None
        return Found(path, "remote", time.perf_counter() - t0)

    def _clean(self) -> None:
        """Drop what killed saves left (``.tmp-<key>-<pid>-*`` of dead processes) and all
        but the newest quarantined copy: each is a whole quantized model."""
        if not self.root.is_dir():
            return
        for child in self.root.iterdir():
            parts = child.name.split("-")
            if child.name.startswith(".tmp-") and len(parts) >= 4 and parts[-2].isdigit():
                if not psutil.pid_exists(int(parts[-2])):
                    shutil.rmtree(child, ignore_errors=True)
        prune_quarantined(self.root, 1)

    def _verified(self, path: Path, key: QuantKey, source: str) -> bool:
        try:
            manifest = verify_dir(path, deep=True)
            if manifest.meta != key.meta():
                raise CorruptCheckpoint(f"{path}: made for {manifest.meta}, not {key.meta()}")
        except CorruptCheckpoint as e:
            moved = quarantine(path)
            self._rejected(key, source, str(e), quarantined=str(moved))
            return False
        return True

    def _rejected(self, key: QuantKey, source: str, why: str, **extra: Any) -> None:
        self.emit("qbase_rejected", key=key.name, source=source, reason=why, **extra)

    def store(self, model: Any, key: QuantKey) -> Path | None:
        """Save ``model`` (quantized) under ``key``: committed locally, then published.

        A cache is an optimization: a full disk or an unreachable bucket is a
        ``qbase_save_failed`` event, never the job's failure. Another process that
        committed the same key first wins (same bytes)."""
        final = self.root / key.name
        if (final / MANIFEST).is_file():
            return final
        try:
            final, manifest = self._commit(model, key)
            if self.remote is not None:
                self.remote.publish_as(key.name, final, manifest)
        except OSError as e:
            if (final / MANIFEST).is_file() and self.remote is None:
                return final
            self.emit("qbase_save_failed", key=key.name, reason=str(e))
            return None
        return final

    def _commit(self, model: Any, key: QuantKey) -> tuple[Path, Manifest]:
        with staging_dir(self.root, key.name) as tmp:
            save_quantized(model, tmp)
            for p in tmp.iterdir():  # data files durable before the manifest
                with open(p, "rb+") as f:
                    os.fsync(f.fileno())
            return seal(tmp, self.root, 0, key.meta(), name=key.name)


@dataclass
class CallTimer:
    """Seconds spent inside one library function while a load runs."""

    seconds: float = 0.0
    calls: int = 0


@contextmanager
def timing(owner: Any, attr: str) -> Iterator[CallTimer]:
    """Time every call of ``owner.attr`` (looked up at call time by its callers) for the
    duration of the block, then put the original back."""
    timer = CallTimer()
    original = getattr(owner, attr)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            timer.seconds += time.perf_counter() - t0
            timer.calls += 1

    setattr(owner, attr, timed)
    try:
        yield timer
    finally:
        setattr(owner, attr, original)
