"""Loading the base model and tokenizer, wrapping it with LoRA, fingerprinting it."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

from shoestring.config import ConfigError, LoraSection, ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def resolve_model_dir(cfg: ModelConfig, cache_dir: Path) -> Path:
    """The local model directory, building the embedded tiny model if asked."""
    from shoestring.train.builtin import BUILTIN_MODEL, materialize_tiny_model

    if cfg.path == BUILTIN_MODEL:
        return materialize_tiny_model(cache_dir)
    p = Path(cfg.path).expanduser()
    if not p.is_dir():
        raise ConfigError(f"model.path: {p} is not a directory (expected a local Hugging Face "
                          "model dir; downloads are not done at run time)")
    if not (p / "config.json").is_file():
        raise ConfigError(f"model.path: {p} has no config.json")
    return p


def fingerprint(model_dir: Path, sample: int = 1 << 20) -> str:
    """A cheap, content-based id of the base model.

    Hashes config.json and, for each weight file, its name, size, safetensors
    header (names, dtypes, shapes, offsets) and the first and last MiB. Any
    re-download of different weights, a re-quantization or a swapped shard
    changes it; hashing every byte of a 14 GB model at each start would not be
    cheap enough.
    """
    h = hashlib.sha256()
    h.update((model_dir / "config.json").read_bytes())
    for p in sorted(model_dir.iterdir()):
        if not p.name.endswith(_WEIGHT_SUFFIXES):
            continue
        size = p.stat().st_size
        h.update(f"{p.name}:{size}".encode())
        with open(p, "rb") as f:
            if p.suffix == ".safetensors" and size >= 8:
                (n,) = struct.unpack("<Q", f.read(8))
                h.update(f.read(min(n, size - 8)))
            f.seek(0)
            h.update(f.read(sample))
            if size > sample:
                f.seek(max(size - sample, 0))
                h.update(f.read(sample))
    return h.hexdigest()[:32]


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if tok.pad_token_id is None:
        # Padding is masked out of attention and loss, so EOS is a safe pad.
        tok.pad_token = tok.eos_token
    return tok


def quiet_hf() -> None:
    """Our own progress display is the one users read; silence the library's bars."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                            category=FutureWarning)


def load_base_model(model_dir: Path, cfg: ModelConfig) -> Any:
    from transformers import AutoModelForCausalLM

    quiet_hf()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=_DTYPES[cfg.dtype])
    model.config.use_cache = False
    return model


def apply_lora(model: Any, cfg: LoraSection, seed: int, gradient_checkpointing: bool) -> Any:
    """Wrap ``model`` with fresh LoRA adapters; their init depends only on ``seed``."""
    from peft import LoraConfig, get_peft_model

    targets: Any = cfg.target_modules
    if targets == ["all-linear"]:
        targets = "all-linear"
    lcfg = LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                      target_modules=targets, task_type="CAUSAL_LM", bias="none")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            peft_model = get_peft_model(model, lcfg)
        except ValueError as e:
            raise ConfigError(f"lora.target_modules: {e}") from e
    if gradient_checkpointing:
        peft_model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
        peft_model.enable_input_require_grads()
    return peft_model


def trainable_parameters(model: Any) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def model_summary(model: Any) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"params": total, "trainable_params": trainable}


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True))
    os.replace(tmp, path)
