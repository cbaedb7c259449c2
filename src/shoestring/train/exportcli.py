"""``shoestring export RUN_DIR --gguf f16|bf16|q8_0 [--out DIR]``: a GGUF (+ Ollama
Modelfile) of a run's fine-tuned model, after the fact.

The adapter is the run's ``final/`` when it finished, else the newest committed
single-process checkpoint that verifies (sha256) — a preempted run exports what it last
saved. Sharded (multi-process DCP) checkpoints are refused: export their run's
``final/``. The base is loaded as the run loaded it (``config.yaml``: ``model.path``,
``model.dtype``, ``lora.quantize``), so the merge is onto the same weights it trained
against. The run directory is held (its lock) while the export writes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoestring.config import ConfigError, Invocation, knob
from shoestring.train.config import FinetuneConfig, GgufType

log = logging.getLogger("shoestring.export")


@dataclass
class ExportVerbConfig:
    """``shoestring export RUN_DIR``."""

    run_dir: str = knob("", "The run's output_dir (the positional RUN_DIR).")
    gguf: GgufType = knob("f16", "GGUF tensor type of the big weights: f16, bf16 or q8_0.")
    out: str = knob("", "Directory for the .gguf and its Modelfile (empty: RUN_DIR/gguf).")


@dataclass(frozen=True)
class AdapterSource:
    """Where the trained adapter is: ``final/`` (peft format) or a checkpoint's tensors."""

    path: Path
    final: bool

    def describe(self) -> str:
        return str(self.path) if self.final else f"checkpoint {self.path.name}"


def run_config(run_dir: Path) -> FinetuneConfig:
    from shoestring.config import load
    from shoestring.rundir import RunDir

    path = RunDir(run_dir).config_yaml
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no config.yaml here (is it a finetune's output_dir?)")
    return load(FinetuneConfig, str(path), [])


def _latest_checkpoint(root: Path) -> Path | None:
    from shoestring.checkpoint.local import committed_steps, step_dirname
    from shoestring.checkpoint.manifest import CorruptCheckpoint, verify_dir
    from shoestring.checkpoint.sharded import is_sharded
    from shoestring.train.state import ADAPTER

    for step in committed_steps(root):
        path = root / step_dirname(step)
        try:
            manifest = verify_dir(path, deep=True)
        except CorruptCheckpoint as e:
            log.warning("skipping %s: %s", path.name, e)
            continue
        if is_sharded(manifest.files) or ADAPTER not in manifest.files:
            raise ConfigError(
                f"{path}: a sharded (multi-process) checkpoint; export the run's final/ "
                "once it has finished"
            )
        return path
    return None


def adapter_source(run_dir: Path) -> AdapterSource:
    final = run_dir / "final"
    if (final / "adapter_config.json").is_file():
        return AdapterSource(final, final=True)
    ckpt = _latest_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        raise ConfigError(f"{run_dir}: neither final/ nor a committed checkpoint to export")
    return AdapterSource(ckpt, final=False)


def _from_checkpoint(cfg: FinetuneConfig, model_dir: Path, ckpt: Path) -> Any:
    """The base with fresh LoRA layers, their weights the checkpoint's (every one of them)."""
    from safetensors.torch import load_file

    from shoestring.train.model import apply_lora, load_base_model, trainable_parameters
    from shoestring.train.state import ADAPTER

    base = load_base_model(model_dir, cfg.model, quantize=cfg.lora.quantize)
    model = apply_lora(base, cfg.lora, cfg.train.seed, gradient_checkpointing=False)
    saved = load_file(str(ckpt / ADAPTER))
    params = trainable_parameters(model)
    if set(saved) != set(params):
        raise ConfigError(f"{ckpt}: its adapter tensors do not match lora.* of config.yaml")
    for name, p in params.items():
        p.data.copy_(saved[name])
    return model


def export_run(run_dir: Path, kind: GgufType, out: Path, cache_dir: Path) -> Path:
    from shoestring.hf import load_tokenizer
    from shoestring.rundir import hold
    from shoestring.train.ggufexport import check_model_dir, export_gguf, export_gguf_from
    from shoestring.train.ggufspm import sentencepiece_model
    from shoestring.train.model import resolve_model_dir

    cfg = run_config(run_dir)
    with hold(run_dir, "wait for the run to end"):
        source = adapter_source(run_dir)
        model_dir = resolve_model_dir(cfg.model, cache_dir)
        check_model_dir(model_dir, "--gguf")  # before any weights load
        log.info("exporting %s of %s onto %s", source.describe(), run_dir, model_dir)
        if source.final:
            tok = load_tokenizer(source.path)
            return export_gguf_from(
                model_dir, source.path, cfg.model, cfg.lora.quantize, tok, out, kind
            )
        model = _from_checkpoint(cfg, model_dir, source.path)
        tok = load_tokenizer(model_dir)
        return export_gguf(model, tok, out, kind, model_dir.name, sentencepiece_model(model_dir))


def run_export(cfg: ExportVerbConfig, call: Invocation) -> int:
    from shoestring.train.ggufarch import require_gguf
    from shoestring.train.ggufexport import GGUF_DIR

    if not cfg.run_dir:
        raise ConfigError("export: RUN_DIR is required (the finetune's output_dir)")
    require_gguf("--gguf")
    run_dir = Path(cfg.run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"export: {run_dir} is not a directory")
    out = Path(cfg.out) if cfg.out else run_dir / GGUF_DIR
    cache = Path(call.env.get("SHOESTRING_CACHE") or Path.home() / ".cache" / "shoestring")
    path = export_run(run_dir, cfg.gguf, out, cache)
    print(f"export: {path} (Ollama: ollama create NAME -f {path.parent / 'Modelfile'})")
    return 0
