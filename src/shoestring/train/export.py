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
from typing import TYPE_CHECKING, Any

from shoestring.dircommit import replace_dir
from shoestring.fsio import fsync_tree

if TYPE_CHECKING:
    from shoestring.train.merge import MergePlan

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
#: Shard size of the merged export (the Hub's usual; a 7B in bf16 is 7 shards).
MERGED_SHARD_BYTES = 2 << 30


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


def merged_config(base: Any, dtype: Any) -> Any:
    """The base's config for the merged model: no quantization_config, the export dtype,
    the KV cache back on (training turned it off)."""
    import copy

    config = copy.deepcopy(base.config)
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = str(dtype).removeprefix("torch.")
    config.use_cache = True
    config.architectures = [type(base).__name__]
    return config


def _merge_report(model: Any, plan: MergePlan, ids: Any) -> dict[str, Any]:
    """Logit drift of the merged weights (formed layer by layer in the in-memory model,
    by the same functions that write them) against the adapter on its base."""
    from shoestring.train.merge import formed_forwards

    ref = _logits(model, ids)
    with formed_forwards(plan):
        merged = _logits(model, ids)
    quantized = getattr(model.get_base_model().config, "quantization_config", None) is not None
    return {
        "base": "dequantized 4/8-bit" if quantized else "16/32-bit",
        "dtype": str(plan.dtype).removeprefix("torch."),
        "probe_tokens": ids.shape[1],
        **logit_drift(ref, merged),
    }


def export_merged(
    model: Any, tok: Any, out_dir: Path, max_shard_bytes: int = MERGED_SHARD_BYTES
) -> Path:
    """``OUTPUT/merged``: a 16/32-bit model with the adapter folded in (loads with
    ``AutoModelForCausalLM.from_pretrained``, no peft, no bitsandbytes), plus
    ``merge_report.json`` with the measured logit drift against the adapter on its
    (possibly quantized) base. Streamed from ``model`` itself, a tensor at a time
    (:mod:`shoestring.train.merge`): the model is left as it was, and the extra memory
    is about one layer's weight, never the whole model."""
    import json

    from shoestring.stwriter import write_sharded
    from shoestring.train.merge import plan_merge

    final = out_dir / "merged"
    tmp = out_dir / f".tmp-merged-{uuid.uuid4().hex[:6]}"
    base = model.get_base_model()
    plan = plan_merge(model)
    ids = tok(DRIFT_PROBE, return_tensors="pt")["input_ids"].to(model.device)
    report = _merge_report(model, plan, ids)
    shards = write_sharded(tmp, plan.specs, plan.source, max_shard_bytes)
    merged_config(base, plan.dtype).save_pretrained(str(tmp))
    if base.can_generate() and base.generation_config is not None:
        base.generation_config.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    report |= {
        "shards": len(shards),
        "merged_bytes": plan.merged_bytes,
        "largest_tensor_bytes": plan.largest.nbytes,
    }
    (tmp / MERGE_REPORT).write_text(json.dumps(report, indent=2, sort_keys=True))
    fsync_tree(tmp)
    _log_report(report)
    replace_dir(tmp, final)
    return final


def _log_report(report: dict[str, Any]) -> None:
    log.info(
        "merged onto the %s base: logit drift max %.3g, mean %.3g (logit std %.3g), "
        "top-1 agreement %.1f%%; largest tensor formed %.1f MB of %.1f MB written",
        report["base"],
        report["max_abs"],
        report["mean_abs"],
        report["ref_std"],
        100 * report["top1_agreement"],
        report["largest_tensor_bytes"] / 1e6,
        report["merged_bytes"] / 1e6,
    )


def export_merged_from(
    model_dir: Path,
    adapter_dir: Path,
    model_cfg: Any,
    tok: Any,
    out_dir: Path,
    quantize: str = "none",
) -> Path:
    """Merge an exported adapter onto a freshly loaded base (for sharded runs, whose
    in-memory model holds only shards), streamed like :func:`export_merged`: the loaded
    base is the only whole model in memory. ``quantize``: the base trained on (nf4 under
    FSDP-QLoRA), loaded quantized on the CPU so the merge uses its dequantized weights."""
    from peft import PeftModel

    from shoestring.train.model import load_base_model

    base = load_base_model(model_dir, model_cfg, quantize)
    model = PeftModel.from_pretrained(base, str(adapter_dir))
    return export_merged(model, tok, out_dir)
