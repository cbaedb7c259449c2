"""Text fine-tuning of a vision-language checkpoint: Gemma 3 from 4B up is published as
one ``Gemma3ForConditionalGeneration`` (a text decoder beside a SigLIP tower), which
``AutoModelForCausalLM`` loads whole. Adapters go on the decoder only, under the
checkpoint's own names; the tower stays as published, quantized base or not."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from conftest import FAST
from shoestring.cli import main
from shoestring.infer.fixtures import build_random_model

pytest.importorskip("bitsandbytes")

TOWER = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
         "num_attention_heads": 1, "image_size": 64, "patch_size": 16, "vision_use_head": False}  # fmt: skip


def _gemma3_vision(d: Path) -> Path:
    return build_random_model(
        d, "gemma3", hidden=128, ffn=256, heads=2, kv_heads=1, head_dim=64,
        query_pre_attn_scalar=64, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], layers=2, vision_config=TOWER,
        init_std=0.02, shard="10MB",
    )  # fmt: skip


def _tensors(d: Path, prefix: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out |= {k: st.get_tensor(k) for k in st.keys() if k.startswith(prefix)}  # noqa: SIM118
    return out


def test_adapters_train_the_text_decoder_and_the_tower_is_kept_as_published(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under QLoRA: every adapter is on a decoder linear (all-linear would otherwise put
    some on SigLIP's attention, which text never runs: the first step would refuse
    them as untrained), the tower is not quantized, and the merged export carries the
    tower bit for bit."""
    monkeypatch.setenv("SHOESTRING_CACHE", str(cache_dir))
    torch.set_num_threads(1)
    model_dir = _gemma3_vision(tmp_path / "gemma3")
    out = tmp_path / "run"
    args = [*FAST, "--model.path", str(model_dir), "--train.max_steps", "2",
            "--lora.quantize", "nf4", "--export.merged", "true", "--data.eval", ""]  # fmt: skip
    assert main(["finetune", "--output_dir", str(out), *args]) == 0

    with safe_open(str(out / "final" / "adapter_model.safetensors"), "pt") as st:
        keys = list(st.keys())
    assert keys and all(".language_model.layers." in k for k in keys)
    assert len(keys) == 2 * 7 * 2  # A and B for each of the 7 linears of both layers
    config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert config["exclude_modules"] == r"(model\.vision_tower)(\..*)?"

    tower = _tensors(model_dir, "vision_tower.")
    merged = _tensors(out / "merged", "vision_tower.")
    assert tower and merged.keys() == tower.keys()
    assert all(torch.equal(merged[k], tower[k]) for k in tower)
    decoder = _tensors(model_dir, "language_model.model.layers.0.self_attn.q_proj")
    moved = _tensors(out / "merged", "language_model.model.layers.0.self_attn.q_proj")
    assert not torch.equal(*[t["language_model.model.layers.0.self_attn.q_proj.weight"]
                             for t in (decoder, moved)])  # fmt: skip


def test_the_tower_is_left_unquantized_and_the_head_as_transformers_leaves_it(
    tmp_path: Path,
) -> None:
    from shoestring.train.config import ModelConfig
    from shoestring.train.model import load_base_model
    from shoestring.train.towers import kept_unquantized

    model_dir = _gemma3_vision(tmp_path / "gemma3")
    assert kept_unquantized(model_dir) == ["lm_head", "model.vision_tower"]
    text = build_random_model(tmp_path / "llama", "llama")
    assert kept_unquantized(text) is None  # transformers' defaults, untouched
    model = load_base_model(model_dir, ModelConfig(path=str(model_dir), dtype="float32"), "nf4")
    kinds = {
        (name.split(".")[1], type(m).__name__)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.startswith("model.")
    }
    assert kinds == {("language_model", "Linear4bit"), ("vision_tower", "Linear")}


def test_infer_streams_the_text_model_with_an_adapter_as_peft_merges_it(tmp_path: Path) -> None:
    """``infer --adapter`` on a vision-language base: the adapter (trained on the whole
    model, its names ``model.language_model...``) is merged into the text model the
    engine streams; greedy answers equal peft's merged whole model's, not the base's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from shoestring.train.towers import exclude_pattern, outside_decoder
    from test_moe import _streams_as

    torch.set_num_threads(1)
    model_dir = build_random_model(
        tmp_path / "gemma3", "gemma3", hidden=128, ffn=256, heads=2, kv_heads=1, head_dim=64,
        query_pre_attn_scalar=64, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], layers=2, vision_config=TOWER,
    )  # fmt: skip
    base = AutoModelForCausalLM.from_pretrained(str(model_dir))
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                      exclude_modules=exclude_pattern(outside_decoder(base)))  # fmt: skip
    peft_model = get_peft_model(base, lora)
    peft_model.save_pretrained(str(tmp_path / "final"))
    _streams_as(model_dir, tmp_path / "final", peft_model.merge_and_unload().eval(), tmp_path)


def test_the_quantized_base_cache_keeps_the_tower_as_loaded(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart reads the cached NF4 base (keyed by the modules kept unquantized, so a
    copy quantized under another rule is not taken) with the tower still as published."""
    from conftest import read_events
    from shoestring.train.qbase import QuantKey

    monkeypatch.setenv("SHOESTRING_CACHE", str(cache_dir))
    torch.set_num_threads(1)
    model_dir = _gemma3_vision(tmp_path / "gemma3")
    args = [*FAST, "--model.path", str(model_dir), "--train.max_steps", "1",
            "--lora.quantize", "nf4", "--export.merged", "true", "--data.eval", ""]  # fmt: skip
    for run in ("first", "second"):
        assert main(["finetune", "--output_dir", str(tmp_path / run), *args]) == 0
    (load,) = [e for e in read_events(tmp_path / "second") if e.get("phase") == "model"]
    assert load["source"] == "qbase-local"
    tower = _tensors(model_dir, "vision_tower.")
    merged = _tensors(tmp_path / "second" / "merged", "vision_tower.")
    assert all(torch.equal(merged[k], tower[k]) for k in tower)

    plain = QuantKey.of("fp", "nf4", "float32", "cpu")
    kept = QuantKey.of("fp", "nf4", "float32", "cpu", ["lm_head", "model.vision_tower"])
    assert "kept" not in plain.meta() and kept.meta()["kept"] == ["lm_head", "model.vision_tower"]
    assert plain.name != kept.name


def test_another_vision_language_family_is_refused_by_name(tmp_path: Path) -> None:
    """Only Gemma 3 is streamed as its text model here (tested for exactness); a Llava's
    config is refused by name when the engine builds its skeleton, before any weight is
    read."""
    from transformers import LlavaConfig

    from shoestring.infer.engine import build_skeleton
    from shoestring.infer.shards import ShardError

    LlavaConfig().save_pretrained(tmp_path)
    with pytest.raises(ShardError, match=r"a vision-language model \(llava\).*gemma3 only"):
        build_skeleton(tmp_path)


def test_fsdp2_qlora_shards_a_vision_language_base_and_keeps_its_tower(
    cli: Any, tmp_path: Path
) -> None:
    """Two ranks, FSDP2 + QLoRA (one reader: rank 0 loads, rank 1 builds the skeleton and
    receives): the adapters are the decoder's only, and the merged export's tower is the
    checkpoint's bit for bit."""
    from conftest import run_job

    model_dir = _gemma3_vision(tmp_path / "gemma3")
    out = tmp_path / "run"
    args = [*FAST, "--model.path", str(model_dir), "--train.max_steps", "2",
            "--train.batch_size", "4", "--train.micro_batch_size", "2", "--lora.quantize",
            "nf4", "--distributed.strategy", "fsdp", "--export.merged", "true",
            "--data.eval", ""]  # fmt: skip
    r = run_job(cli, out, 2, *args)
    assert r.returncode == 0, r.stderr[-3000:]
    with safe_open(str(out / "final" / "adapter_model.safetensors"), "pt") as st:
        keys = list(st.keys())
    assert len(keys) == 2 * 7 * 2 and all(".language_model.layers." in k for k in keys)
    tower = _tensors(model_dir, "vision_tower.")
    merged = _tensors(out / "merged", "vision_tower.")
    assert tower and all(torch.equal(merged[k], tower[k]) for k in tower)
