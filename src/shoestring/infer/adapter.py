"""Apply a LoRA adapter saved by ``shoestring finetune`` (peft format, OUTPUT/final/).

The base weights stream from disk; the adapter is small and stays in memory.
Each streamed weight is merged on the fly (W + scale * B @ A) in the reader
thread, into the buffer that was just read, so compute sees a plain merged
layer and the original files are never touched.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from shoestring.config import ConfigError

_PREFIX = "base_model.model."


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
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            module = key.split(".lora_A.")[0].removeprefix(_PREFIX)
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            self.pairs[f"{module}.weight"] = (a.float(), b.float())
        self.fingerprint = f"{weights.stat().st_size}-{int(weights.stat().st_mtime_ns)}"

    def check(self, keys: set[str]) -> None:
        missing = sorted(set(self.pairs) - keys)
        if missing:
            raise ConfigError(
                f"model.adapter: the adapter targets {missing[0]!r}, which the "
                "base model does not have (adapter for another model?)"
            )

    def merge_(self, key: str, w: torch.Tensor) -> torch.Tensor:
        """Add the adapter's delta to ``w`` in place (a no-op for untargeted keys)."""
        pair = self.pairs.get(key)
        if pair is None:
            return w
        a, b = pair
        delta = (b.to(w.device) @ a.to(w.device)) * self.scale
        w.add_(delta.to(w.dtype))
        return w
