"""Hugging Face helpers every pillar uses: the tokenizer, quiet library logging, and a
cheap content fingerprint of a model directory (train, infer and plan import these)."""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


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


StoredQuantization = Literal["none", "nf4", "int8"]


def quant_method(config: Mapping[str, Any]) -> str:
    """The ``quantization_config.quant_method`` of a model's config.json ("" for none):
    ``bitsandbytes``, ``fp8``, ``gptq``, ``awq``, ``compressed-tensors``, ..."""
    q = config.get("quantization_config")
    return str(q.get("quant_method", "")) if isinstance(q, Mapping) else ""


def bnb_stored(config: Mapping[str, Any]) -> StoredQuantization:
    """How a model's linears are stored, from its config.json: ``nf4``/``int8`` when a
    bitsandbytes ``quantization_config`` is there (the ``*-bnb-4bit`` repos, or a
    ``save_pretrained`` of a quantized model), else ``none``."""
    q = config.get("quantization_config")
    if not isinstance(q, Mapping) or q.get("quant_method") != "bitsandbytes":
        return "none"
    if q.get("load_in_4bit") or q.get("_load_in_4bit"):
        return "nf4"  # (an fp4 checkpoint too: 4 bits a weight, loaded as stored)
    return "int8" if q.get("load_in_8bit") or q.get("_load_in_8bit") else "none"


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
    warnings.filterwarnings(
        "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
    )


#: bitsandbytes' notice, at import on CPUs with AVX512-BF16, that it could not fetch its
#: CPU 4-bit GEMM from the Hub (``kernels-community``, refused unless trusted). Hub
#: kernels are never fetched here (``use_kernels=False``: a download at run time, and
#: kernels that differ between machines), so it is expected, and its "Failed ... please
#: pip install kernels" would send users after a problem they do not have.
HUB_KERNEL_NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community"


class HubKernelNotice(logging.Filter):
    """Drops :data:`HUB_KERNEL_NOTICE`; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(HUB_KERNEL_NOTICE)


def quiet_hub_kernel_notice() -> None:
    """Install :class:`HubKernelNotice` on the logger bitsandbytes says it through."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(HubKernelNotice())


#: Vision-language families trained and run here on text (Gemma 3 from 4B up): a text
#: decoder beside a tower, which plan, infer and the GGUF export take apart the same way.
VISION_FAMILIES = frozenset({"gemma3"})


def vision_language_parts(cfg: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``text_config``, ``vision_config``) of a :data:`VISION_FAMILIES` config, every key
    filled by transformers' own config class: the Hub's name few (google/gemma-3-4b-it's
    ``text_config`` names 6) and leave the rest to its defaults."""
    from transformers import AutoConfig

    given = {k: v for k, v in cfg.items() if k != "model_type"}
    full = AutoConfig.for_model(str(cfg["model_type"]), **given).to_dict()
    return dict(full["text_config"]), dict(full["vision_config"])
