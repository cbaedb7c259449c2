"""Final outputs: a PEFT adapter dir that ``PeftModel.from_pretrained`` loads, and an
optional merged model. Both are written to a temp dir and renamed into place."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from shoestring.checkpoint.local import replace_dir


def export_adapter(model: Any, tok: Any, out_dir: Path,
                   state_dict: dict[str, Any] | None = None) -> Path:
    """``OUTPUT/final``: adapter_config.json + adapter_model.safetensors (+ tokenizer).

    ``state_dict``: the gathered full adapter weights when the model is sharded.
    """
    final = out_dir / "final"
    tmp = out_dir / f".tmp-final-{uuid.uuid4().hex[:6]}"
    model.save_pretrained(str(tmp), safe_serialization=True, state_dict=state_dict)
    tok.save_pretrained(str(tmp))
    replace_dir(tmp, final)
    return final


def export_merged(model: Any, tok: Any, out_dir: Path) -> Path:
    """``OUTPUT/merged``: base weights with the adapter folded in. Consumes ``model``."""
    final = out_dir / "merged"
    tmp = out_dir / f".tmp-merged-{uuid.uuid4().hex[:6]}"
    merged = model.merge_and_unload()
    merged.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    replace_dir(tmp, final)
    return final


def export_merged_from(model_dir: Path, adapter_dir: Path, model_cfg: Any, tok: Any,
                       out_dir: Path) -> Path:
    """Merge an exported adapter onto a freshly loaded base (for sharded runs, whose
    in-memory model holds only shards)."""
    from peft import PeftModel

    from shoestring.train.model import load_base_model

    model = PeftModel.from_pretrained(load_base_model(model_dir, model_cfg), str(adapter_dir))
    return export_merged(model, tok, out_dir)
