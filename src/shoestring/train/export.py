"""Final outputs: a PEFT adapter dir that ``PeftModel.from_pretrained`` loads, and an
optional merged model. Both are written to a temp dir (``.tmp-final-*``,
``.tmp-merged-*``), every file and directory fsynced, then renamed into place — as
durable as a checkpoint. A temp dir left by a kill is removed at the next start
(:func:`prune_exports`)."""

from __future__ import annotations

import logging
import shutil
import uuid
from pathlib import Path
from typing import Any

from shoestring.checkpoint.local import replace_dir
from shoestring.fsio import fsync_tree

log = logging.getLogger("shoestring.export")

STALE_EXPORTS = (".tmp-final-", ".tmp-merged-", ".replaced-final-", ".replaced-merged-")


def export_adapter(
    model: Any, tok: Any, out_dir: Path, state_dict: dict[str, Any] | None = None
) -> Path:
    """``OUTPUT/final``: adapter_config.json + adapter_model.safetensors (+ tokenizer).

    ``state_dict``: the gathered full adapter weights when the model is sharded.
    """
    final = out_dir / "final"
    tmp = out_dir / f".tmp-final-{uuid.uuid4().hex[:6]}"
    model.save_pretrained(str(tmp), safe_serialization=True, state_dict=state_dict)
    tok.save_pretrained(str(tmp))
    fsync_tree(tmp)
    replace_dir(tmp, final)
    return final


def prune_exports(out_dir: Path) -> list[str]:
    """Remove temp dirs of exports a killed run left (``.tmp-final-*``,
    ``.tmp-merged-*``, ``.replaced-final-*``, ``.replaced-merged-*``). Called at start by
    the one process that holds the run directory's lock, so none is being written."""
    removed: list[str] = []
    if not out_dir.is_dir():
        return removed
    for child in out_dir.iterdir():
        if child.name.startswith(STALE_EXPORTS) and child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child.name)
    return sorted(removed)


#: Fixed text whose logits are compared before and after a merge.
DRIFT_PROBE = (
    "reverse: abcde = edcba\nThe quick brown fox jumps over the lazy dog. "
    "Fine-tuning on a shoestring: 4-bit base, 16-bit export."
)
MERGE_REPORT = "merge_report.json"


def _logits(model: Any, ids: Any) -> Any:
    import torch

    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids).logits.float()
    model.train(was_training)
    return out


def logit_drift(ref: Any, new: Any) -> dict[str, float]:
    """How far merged logits moved from the adapter-on-base logits they replace."""
    diff = (new - ref).abs()
    return {
        "max_abs": float(diff.max()),
        "mean_abs": float(diff.mean()),
        "ref_std": float(ref.std()),
        "top1_agreement": float((new.argmax(-1) == ref.argmax(-1)).float().mean()),
    }


def _dequantized_merge(model: Any) -> Any:
    """Merge the adapter onto dequant(W4) in the compute dtype, not onto the original
    16-bit weights: the adapter was trained against the quantized weights, and
    merging it onto W16 silently adds the quantization error back (unsloth-zoo #810).
    Reloads the base quantized (deterministic: the same bytes as in training),
    dequantizes it, and merges a copy of the trained adapter."""
    import tempfile

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = model.get_base_model()
    qcfg = base.config.quantization_config
    dtype = base.dtype if base.dtype.is_floating_point else None
    with tempfile.TemporaryDirectory() as adapter_dir:
        model.save_pretrained(adapter_dir, safe_serialization=True)
        fresh = AutoModelForCausalLM.from_pretrained(
            base.config._name_or_path,
            quantization_config=qcfg,
            dtype=dtype,
            device_map={"": str(base.device)},
        )
        dq = fresh.dequantize()
        merged = PeftModel.from_pretrained(dq, adapter_dir).merge_and_unload()
    merged.config.use_cache = True
    return merged


def export_merged(model: Any, tok: Any, out_dir: Path) -> Path:
    """``OUTPUT/merged``: a 16-bit model with the adapter folded in, plus
    ``merge_report.json`` with the measured logit drift against the adapter on its
    (possibly quantized) base. Consumes ``model`` when the base is not quantized."""
    import json

    final = out_dir / "merged"
    tmp = out_dir / f".tmp-merged-{uuid.uuid4().hex[:6]}"
    ids = tok(DRIFT_PROBE, return_tensors="pt")["input_ids"].to(model.device)
    ref = _logits(model, ids)
    quantized = getattr(model.get_base_model().config, "quantization_config", None) is not None
    merged = _dequantized_merge(model) if quantized else model.merge_and_unload()
    report = {
        "base": "dequantized 4/8-bit" if quantized else "16/32-bit",
        "dtype": str(merged.dtype).replace("torch.", ""),
        "probe_tokens": ids.shape[1],
        **logit_drift(ref, _logits(merged, ids)),
    }
    merged.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    (tmp / MERGE_REPORT).write_text(json.dumps(report, indent=2, sort_keys=True))
    fsync_tree(tmp)
    log.info(
        "merged onto the %s base: logit drift max %.3g, mean %.3g (logit std %.3g), "
        "top-1 agreement %.1f%%",
        report["base"],
        report["max_abs"],
        report["mean_abs"],
        report["ref_std"],
        100 * report["top1_agreement"],
    )
    replace_dir(tmp, final)
    return final


def export_merged_from(
    model_dir: Path, adapter_dir: Path, model_cfg: Any, tok: Any, out_dir: Path
) -> Path:
    """Merge an exported adapter onto a freshly loaded base (for sharded runs, whose
    in-memory model holds only shards)."""
    from peft import PeftModel

    from shoestring.train.model import load_base_model

    model = PeftModel.from_pretrained(load_base_model(model_dir, model_cfg), str(adapter_dir))
    return export_merged(model, tok, out_dir)
