"""Apply a LoRA adapter saved by ``shoestring finetune`` (peft format, OUTPUT/final/).

The base weights stream from disk; the adapter is small and stays in memory.
Each streamed weight is merged on the fly (W + scale * B @ A) in the reader
thread, into the buffer that was just read, so compute sees a plain merged
layer and the original files are never touched. The product is formed a row
block at a time (:data:`MERGE_SCRATCH`), so its temporaries stay a few MB
whatever the weight's size. Adapters peft reads with per-module ranks, or on an MoE's
fused experts, are read through peft's own modules (:mod:`.adapterlayout`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shoestring.config import ConfigError
from shoestring.infer.fused import ExpertMerge

_PREFIX = "base_model.model."
#: Bytes of fp32 product one row block of ``B @ A`` may take (blocks are whole
#: multiples of 64 rows, at least 64).
MERGE_SCRATCH = 4 << 20


class LoraDelta:
    """The adapter's A/B pairs keyed by the base weight's checkpoint key."""

    def __init__(self, adapter_dir: Path) -> None:
        from safetensors.torch import load_file

        cfg_path = adapter_dir / "adapter_config.json"
        weights = adapter_dir / "adapter_model.safetensors"
        if not cfg_path.is_file() or not weights.is_file():
            raise ConfigError(
                f"model.adapter: {adapter_dir} has no adapter_config.json and "
                "adapter_model.safetensors (expected a finetune OUTPUT/final/)"
            )
        cfg = json.loads(cfg_path.read_text())
        if cfg.get("peft_type", "LORA") != "LORA":
            raise ConfigError(
                f"model.adapter: {cfg_path}: peft_type {cfg.get('peft_type')!r} "
                "is not supported (only LORA)"
            )
        r = int(cfg["r"])
        alpha = float(cfg.get("lora_alpha", r))
        self.scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        tensors = load_file(str(weights))
        self.pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # Fused parameters decoded as they stream (MXFP4 experts): a pair per expert,
        # merged into each as it is decoded (:meth:`merge_expert_`).
        self.decoded: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.scales: dict[str, float] = {}  # where peft's differs from ``scale``
        # Per-module ranks, or adapters on parameters: read with peft (:meth:`resolve`).
        self._peft_only = bool(
            cfg.get("target_parameters") or cfg.get("rank_pattern") or cfg.get("alpha_pattern")
        )
        self._dir, self._tensors = adapter_dir, tensors if self._peft_only else {}
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            module = key.split(".lora_A.")[0].removeprefix(_PREFIX)
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            self.pairs[f"{module}.weight"] = (a.float(), b.float())
        self.fingerprint = f"{weights.stat().st_size}-{int(weights.stat().st_mtime_ns)}"

    def resolve(self, model_dir: Path, fused: dict[str, Any], rows: dict[str, int]) -> None:
        """Read what only peft knows of this adapter (:mod:`.adapterlayout`): per-module
        scales, and pairs per stored expert tensor in place of a fused parameter's."""
        if not self._peft_only:
            return
        from shoestring.infer.adapterlayout import peft_layout

        layout = peft_layout(self._dir, model_dir, self._tensors, fused, rows)
        for key in layout.replaced:
            self.pairs.pop(key, None)
        self.pairs.update(layout.experts)
        self.decoded = layout.decoded
        self.scales = {
            k: v
            for k, v in layout.scales.items()
            if (k in self.pairs or k in self.decoded) and v != self.scale
        }
        self._tensors = {}

    def rename(self, name: Callable[[str], str | None]) -> None:
        """The pairs under the names the engine's model gives their weights (a
        vision-language base streamed as its text model); one it has not is refused."""
        if self._peft_only:
            raise ConfigError(
                "model.adapter: an adapter with per-module ranks or adapted parameters on a "
                "vision-language base is not streamed here (its plain LoRA pairs are)"
            )
        renamed = {key: name(key) for key in self.pairs}
        lost = sorted(k for k, v in renamed.items() if v is None)
        if lost:
            raise ConfigError(
                f"model.adapter: the adapter targets {lost[0]!r}, outside the text decoder "
                "this base is streamed as (a vision tower?)"
            )
        self.pairs = {str(renamed[k]): pair for k, pair in self.pairs.items()}

    def check(self, keys: set[str]) -> None:
        missing = sorted(set(self.pairs) - keys)
        if missing:
            raise ConfigError(
                f"model.adapter: the adapter targets {missing[0]!r}, which the "
                "base model does not have (adapter for another model?)"
            )

    @property
    def nbytes(self) -> int:
        pairs = [*self.pairs.values(), *(p for ps in self.decoded.values() for p in ps)]
        return sum(t.numel() * t.element_size() for pair in pairs for t in pair)

    def merge_(self, key: str, w: torch.Tensor) -> torch.Tensor:
        """Add the adapter's delta to ``w`` in place (a no-op for untargeted keys), a
        row block at a time."""
        pair = self.pairs.get(key)
        if pair is None:
            return w
        return _add_product(w, *pair, self.scales.get(key, self.scale))

    def merge_expert_(self, key: str, e: int, w: torch.Tensor) -> torch.Tensor:
        """Add expert ``e``'s delta of the fused parameter ``key`` to ``w`` (that expert's
        decoded values, in the parameter's layout) in place, a row block at a time."""
        return _add_product(w, *self.decoded[key][e], self.scales.get(key, self.scale))

    def expert_merge(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> ExpertMerge:
        """The merge of the fused parameter ``key`` (``shape``: experts first) into each
        expert as it is decoded, and its temporaries."""
        cells = min(shape[1], _block_rows(shape[-1])) * shape[-1]
        temps = cells * 4 + (cells * dtype.itemsize if dtype != torch.float32 else 0)
        return ExpertMerge(lambda e, w: self.merge_expert_(key, e, w), temps)

    def scratch(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Temporary bytes :meth:`merge_` takes for the weight ``key`` (0: untargeted):
        one row block of the fp32 product, and its cast to ``dtype``."""
        if key not in self.pairs:
            return 0
        cells = min(shape[0], _block_rows(shape[-1])) * shape[-1]
        return cells * 4 + (cells * dtype.itemsize if dtype != torch.float32 else 0)


def _add_product(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``w += scale * b @ a``, the product formed in float32 a row block at a time and
    cast to ``w``'s dtype before it is added (as peft's merge adds its delta)."""
    a, b = a.to(w.device), b.to(w.device)
    rows = _block_rows(w.shape[-1])
    for i in range(0, w.shape[0], rows):
        w[i : i + rows].add_((b[i : i + rows] @ a).mul_(scale).to(w.dtype))
    return w


def _block_rows(cols: int) -> int:
    """Rows of ``B @ A`` formed at once: within :data:`MERGE_SCRATCH`, a multiple of 64
    (at that granularity the product's values do not depend on the block: tested)."""
    return max(64, MERGE_SCRATCH // (cols * 4) // 64 * 64)
