"""The resume checks that need no weights, made before any are loaded.

A resume is refused — exit 2, one line naming the checkpoint — when ``--resume PATH``
is not a valid checkpoint of a fine-tune, when the checkpoint was trained on another
base model, when the config changed in a way that breaks an exact continuation, or
when its MoE experts were held in another form than this version holds them.
The checkpoint's ``manifest.json`` (base-model fingerprint, kind) and
``trainer_state.json`` (the config it was saved with) say all of that: reading them
takes milliseconds, loading a 7B model minutes. The same checks run again when the
chosen checkpoint is loaded (:mod:`shoestring.train.resume`): in ``auto`` mode the
checkpoint seen here may still fail verification there and give way to an older one.
Nothing here writes, quarantines or fetches.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoestring.checkpoint import CorruptCheckpoint, Manifest, RemoteStore, verify_dir
from shoestring.checkpoint.local import committed_steps, step_dirname
from shoestring.config import ConfigError
from shoestring.hf import fingerprint
from shoestring.hub import ModelRef
from shoestring.rundir import RunDir
from shoestring.train import state as S
from shoestring.train.baselayout import check_layout, expected_layout
from shoestring.train.config import FinetuneConfig, ResolvedConfig
from shoestring.train.model import resolve_model_dir
from shoestring.train.resume import check_base, check_compatible


@dataclass(frozen=True)
class Candidate:
    """The checkpoint a resume would start from, seen through its JSON files only."""

    where: str  # its local path, or its URL in checkpoint.storage
    manifest: Manifest
    config: Mapping[str, Any]  # the (resume-relevant) config it was saved with


def _saved_config(text: str, where: str) -> Mapping[str, Any]:
    try:
        config = json.loads(text)["config"]
        if not isinstance(config, dict):
            raise TypeError(f"'config' is a {type(config).__name__}")
        return config
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpoint(f"{where}: unreadable trainer state ({e})") from e


def _local(path: Path, *, deep: bool) -> Candidate:
    """A local checkpoint as the late load would take it; :class:`CorruptCheckpoint`
    when it is not one."""
    manifest = verify_dir(path, deep=deep)
    S.require_complete(manifest)
    state = path / S.STATE
    try:
        text = state.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CorruptCheckpoint(f"{state}: unreadable ({e})") from e
    return Candidate(str(path), manifest, _saved_config(text, str(state)))


def _remote(remote: RemoteStore, step: int) -> Candidate | None:
    """Checkpoint ``step`` in ``checkpoint.storage`` through its two JSON files; None when
    they cannot be read (the load that fetches it says why, and falls back)."""
    where = f"{remote.url.rstrip('/')}/{step_dirname(step)}"
    try:
        manifest = remote.read_manifest(step)
        S.require_complete(manifest)
        text = remote.read_bytes(step, S.STATE).decode("utf-8")
        return Candidate(where, manifest, _saved_config(text, f"{where}/{S.STATE}"))
    except Exception:  # noqa: BLE001 - any storage error: the load decides, and says
        return None


def _newest(root: Path, remote: RemoteStore | None) -> Candidate | None:
    """What ``--resume auto`` would load: the newest committed checkpoint whose manifest
    and trainer state read (the local copy of a step first), or None."""
    local = committed_steps(root)
    try:
        remote_steps = remote.committed_steps() if remote is not None else []
    except Exception:  # noqa: BLE001 - unreachable storage: the load reports it
        remote_steps = []
    for step in sorted(set(local) | set(remote_steps), reverse=True):
        found: Candidate | None = None
        if step in local:
            try:
                found = _local(root / step_dirname(step), deep=False)
            except CorruptCheckpoint:
                found = None  # the load quarantines it and falls back
        if found is None and remote is not None and step in remote_steps:
            found = _remote(remote, step)
        if found is not None:
            return found
    return None


def resume_candidate(
    mode: str, cfg: FinetuneConfig, remote: RemoteStore | None, *, deep: bool
) -> Candidate | None:
    """The checkpoint ``--resume MODE`` would start from (None: a fresh start). A named
    one (``--resume PATH``) that is not a valid checkpoint is a :class:`ConfigError`;
    ``deep`` also checks its files' sha256."""
    if mode == "never":
        return None
    if mode == "auto":
        return _newest(RunDir(Path(cfg.output_dir)).checkpoints, remote)
    try:
        return _local(Path(mode), deep=deep)
    except CorruptCheckpoint as e:
        raise ConfigError(f"--resume {mode}: not a valid checkpoint: {e}") from None


def check_resume(
    cfg: ResolvedConfig,
    mode: str,
    remote: RemoteStore | None,
    cache_dir: Path,
    *,
    deep: bool = False,
    model: ModelRef | None = None,
) -> None:
    """Refuse, before any weights load, a resume that the load would refuse: the
    checkpoint is not a fine-tune's, its base model is not ``model.path``, the
    config changed in a way that breaks an exact continuation, or its base was held in
    a form the config says this version will not hold it in (the messages are the
    load's; the config is resolved, as the load compares it). ``model`` is
    ``model.path`` resolved (None: the built-in model)."""
    found = resume_candidate(mode, cfg, remote, deep=deep)
    if found is None:
        return
    kind = found.manifest.meta.get("kind", "finetune")
    if kind != "finetune":
        raise ConfigError(f"cannot resume from {found.where}: a {kind} checkpoint, not a finetune")
    model_dir = model.path if model is not None else resolve_model_dir(cfg.model, cache_dir)
    source = model.record() if model is not None else {}
    check_base(found.manifest.meta, fingerprint(model_dir), source, found.where, model_dir)
    check_compatible(found.config, cfg, found.where)
    check_layout(found.manifest.meta, expected_layout(cfg.lora.quantize), found.where, partial=True)
