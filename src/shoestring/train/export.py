"""Final outputs: a PEFT adapter dir that ``PeftModel.from_pretrained`` loads, and an
optional merged model. Both are written to a temp dir and renamed into place."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from shoestring.checkpoint.local import replace_dir


def export_adapter(model: Any, tok: Any, out_dir: Path) -> Path:
    """``OUTPUT/final``: adapter_config.json + adapter_model.safetensors (+ tokenizer)."""
    final = out_dir / "final"
    tmp = out_dir / f".tmp-final-{uuid.uuid4().hex[:6]}"
    model.save_pretrained(str(tmp), safe_serialization=True)
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
