"""The quantized-base cache: a QLoRA start that reads the cached 4-bit base trains
byte-identically to one that quantizes; a corrupt, mismatched or foreign copy is
detected and rebuilt, never used; a fresh machine fetches it from checkpoint.storage;
and the load is visible as events."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import read_events, sha256, state_digest

pytest.importorskip("bitsandbytes")

STEPS = 2
ARGS = [
    "--train.max_steps",
    str(STEPS),
    "--train.batch_size",
    "4",
    "--train.warmup_steps",
    "1",
    "--checkpoint.every_steps",
    str(STEPS),
    "--data.max_length",
    "24",
    "--data.eval",
    "",
    "--lora.quantize",
    "nf4",
    "--train.optimizer",
    "adamw8bit",
    "--watch.enabled",
    "false",
]


@pytest.fixture()
def fresh_cache(tmp_path: Path, cache_dir: Path) -> Path:
    """A model cache with the built-in model but no quantized base yet."""
    d = tmp_path / "cache"
    d.mkdir()
    for child in cache_dir.iterdir():
        if child.name.startswith("tiny-"):
            shutil.copytree(child, d / child.name)
    return d


def _finetune(out: Path, cache: Path, *extra: str) -> list[dict[str, object]]:
    from shoestring.config import load
    from shoestring.train.config import FinetuneConfig
    from shoestring.train.loop import RunOptions, finetune

    torch.set_num_threads(1)
    cfg = load(FinetuneConfig, None, ["--output_dir", str(out), *ARGS, *extra])
    assert finetune(cfg, RunOptions(resume="never", cache_dir=cache, tty=False)) == 0
    return read_events(out)


def _model_load(events: list[dict[str, object]]) -> dict[str, object]:
    (rec,) = [e for e in events if e["event"] == "load" and e["phase"] == "model"]
    return rec


def _entry(cache: Path) -> Path:
    (entry,) = [p for p in (cache / "qbase").iterdir() if not p.name.startswith(".")]
    return entry


def test_cached_base_is_reused_and_trains_byte_identically(
    fresh_cache: Path, tmp_path: Path
) -> None:
    merged = ["--export.merged", "true"]
    first = _finetune(tmp_path / "a", fresh_cache, *merged)
    load = _model_load(first)
    assert load["source"] == "model_dir" and float(load["quantize_s"]) > 0  # type: ignore[arg-type]
    assert isinstance(load["disk_read_bytes"], int) and load["disk_read_bytes"] >= 0
    entry = _entry(fresh_cache)
    assert load["qbase_saved"] == entry.name
    meta = json.loads((entry / "manifest.json").read_text())["meta"]
    assert meta["kind"] == "quantized-base" and meta["quantize"] == "nf4"
    assert meta["base_fingerprint"] == next(
        e["base_fingerprint"] for e in first if e["event"] == "run_start"
    )

    second = _finetune(tmp_path / "b", fresh_cache, *merged)
    assert _model_load(second)["source"] == "qbase-local"
    assert _model_load(second)["quantize_s"] == 0.0
    assert state_digest(tmp_path / "b", STEPS) == state_digest(tmp_path / "a", STEPS)
    # The adapter names the base model folder, not the cache it was read from.
    cfg_b = json.loads((tmp_path / "b" / "final" / "adapter_config.json").read_text())
    cfg_a = json.loads((tmp_path / "a" / "final" / "adapter_config.json").read_text())
    assert cfg_b == cfg_a and "qbase" not in cfg_b["base_model_name_or_path"]
    # The 16-bit merge streamed from a base read pre-quantized is the same model.
    for f in (tmp_path / "a" / "merged").glob("*.safetensors"):
        assert sha256(f) == sha256(tmp_path / "b" / "merged" / f.name), f.name

    off = _finetune(tmp_path / "c", fresh_cache, "--lora.cache_quantized", "false")
    assert _model_load(off)["source"] == "model_dir" and "qbase_saved" not in _model_load(off)


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _other_bnb_version(entry: Path) -> None:
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest["meta"]["bitsandbytes"] = "0.49.0"
    (entry / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("spoil", "why"),
    [
        (lambda e: _flip_a_byte(e / "model.safetensors"), "sha256 mismatch"),
        (_other_bnb_version, "made for"),
        (lambda e: (e / "model.safetensors").write_bytes(b"torn"), "truncated"),
    ],
    ids=["corrupt", "other-bitsandbytes", "torn"],
)
def test_a_bad_copy_is_rebuilt_never_used(
    fresh_cache: Path, tmp_path: Path, spoil: object, why: str
) -> None:
    _finetune(tmp_path / "a", fresh_cache)
    entry = _entry(fresh_cache)
    spoil(entry)  # type: ignore[operator]
    events = _finetune(tmp_path / "b", fresh_cache)
    (rejected,) = [e for e in events if e["event"] == "qbase_rejected"]
    assert why in str(rejected["reason"]) and rejected["source"] == "local"
    assert Path(str(rejected["quarantined"])).name.startswith(".corrupt-")
    assert _model_load(events)["source"] == "model_dir"  # quantized again
    assert state_digest(tmp_path / "b", STEPS) == state_digest(tmp_path / "a", STEPS)
    rebuilt = _finetune(tmp_path / "c", fresh_cache)  # and the rebuilt copy is good
    assert _model_load(rebuilt)["source"] == "qbase-local"


def test_a_fresh_machine_fetches_the_quantized_base_from_storage(
    fresh_cache: Path, tmp_path: Path
) -> None:
    bucket = tmp_path / "bucket"
    store = ["--checkpoint.storage", str(bucket)]
    _finetune(tmp_path / "a", fresh_cache, *store)
    (published,) = [p for p in (bucket / "qbase").iterdir() if not p.name.startswith(".")]
    assert (published / "manifest.json").is_file()

    elsewhere = tmp_path / "new-machine"
    elsewhere.mkdir()
    for child in fresh_cache.iterdir():
        if child.name.startswith("tiny-"):
            shutil.copytree(child, elsewhere / child.name)
    events = _finetune(tmp_path / "b", elsewhere, *store)
    assert _model_load(events)["source"] == "qbase-remote"
    assert (elsewhere / "qbase" / published.name / "manifest.json").is_file()
    assert state_digest(tmp_path / "b", STEPS) == state_digest(tmp_path / "a", STEPS)


def test_load_phases_are_events_from_the_process_start(fresh_cache: Path, tmp_path: Path) -> None:
    from shoestring.report.ledger import compute
    from shoestring.report.timeline import load

    out = tmp_path / "a"
    events = _finetune(out, fresh_cache)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start"
    phases = [e["phase"] for e in events if e["event"] == "load"]
    assert phases == ["data", "model"]
    assert kinds.index("start") < kinds.index("load") < kinds.index("run_start")
    model = _model_load(events)
    assert float(model["seconds"]) >= float(model["read_s"]) + float(model["quantize_s"])  # type: ignore[arg-type]
    tl = load(out)
    assert len(tl.attempts) == 1 and compute(tl).restart_hours == 0.0


def test_a_base_stored_quantized_trains_as_stored_without_requantizing(
    fresh_cache: Path, tmp_path: Path
) -> None:
    # A *-bnb-4bit checkpoint: a bitsandbytes save_pretrained of the quantized base (here
    # the cache's own entry) with the tokenizer beside it.
    cached = _finetune(tmp_path / "a", fresh_cache)
    stored = tmp_path / "llama-bnb-4bit"
    shutil.copytree(_entry(fresh_cache), stored)
    (stored / "manifest.json").unlink()
    builtin = Path(str(next(e["model"] for e in cached if e["event"] == "run_start")))
    for f in builtin.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, stored / f.name)
    assert json.loads((stored / "config.json").read_text())["quantization_config"]

    events = _finetune(tmp_path / "b", fresh_cache, "--model.path", str(stored))
    load = _model_load(events)
    assert load["source"] == "model_dir" and load["stored"] == "nf4"
    assert load["quantize_s"] == 0.0 and "qbase_saved" not in load
    assert len(list((fresh_cache / "qbase").iterdir())) == 1  # nothing cached again
    # The same 4-bit weights as the run that quantized them: the same training.
    assert state_digest(tmp_path / "b", STEPS) == state_digest(tmp_path / "a", STEPS)

    from shoestring.config import ConfigError

    with pytest.raises(ConfigError, match=r"lora.quantize: .* is stored nf4 by bitsandbytes"):
        _finetune(
            tmp_path / "c", fresh_cache, "--model.path", str(stored), "--lora.quantize", "none"
        )
    assert not (tmp_path / "c").exists()  # refused before the run directory was written
