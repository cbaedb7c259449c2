"""The merged export is streamed from the trained model in memory, a tensor at a time:
bitwise what peft's ``merge_and_unload`` gives (on the dequantized base for a 4/8-bit
one), loadable as a plain model, with a drift report that is the merged model's, and
a peak memory of a few layers, not the model."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from shoestring.train.config import LoraSection, ModelConfig
from shoestring.train.export import DRIFT_PROBE, MERGE_REPORT, export_merged, logit_drift

pytest.importorskip("bitsandbytes")

#: (quantize, dtype, lora targets, tied embeddings): the 4-bit case adapts only some
#: linears, so the others are exported dequantized; the fp32 case ties the embeddings.
CASES = {
    "nf4-bf16": ("nf4", "bfloat16", ["q_proj", "v_proj"], False),
    "int8-fp32": ("int8", "float32", ["o_proj", "down_proj"], False),
    "bf16": ("none", "bfloat16", ["all-linear"], False),
    "fp32-tied": ("none", "float32", ["all-linear"], True),
}


def _model_dir(cache_dir: Path, tmp_path: Path, tied: bool) -> Path:
    from shoestring.infer.fixtures import build_random_model
    from shoestring.train.builtin import materialize_tiny_model

    if tied:
        return build_random_model(tmp_path / "tied", hidden=128, ffn=256, tie=True)
    return materialize_tiny_model(cache_dir)


def _load(model_dir: Path, quantize: str, dtype: str) -> Any:
    from shoestring.train.model import load_base_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_base_model(model_dir, ModelConfig(path=str(model_dir), dtype=dtype), quantize)


def _trained(model_dir: Path, quantize: str, dtype: str, targets: list[str]) -> Any:
    """The base with a LoRA adapter whose A and B are random (B starts at zero)."""
    from shoestring.train.model import apply_lora, trainable_parameters

    lora = LoraSection(r=8, target_modules=targets)
    model = apply_lora(
        _load(model_dir, quantize, dtype), lora, seed=0, gradient_checkpointing=False
    )
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(1)
        for p in trainable_parameters(model).values():
            p.normal_(0.0, 0.05)
    return model


def _peft_merged(model: Any, model_dir: Path, quantize: str, dtype: str, tmp: Path) -> Any:
    """The reference: peft's in-memory merge_and_unload of the saved adapter onto the
    base reloaded (and, if quantized, dequantized by transformers) — the old export."""
    from peft import PeftModel

    model.save_pretrained(str(tmp / "adapter"))
    base = _load(model_dir, quantize, dtype)
    if quantize != "none":
        base = base.dequantize()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PeftModel.from_pretrained(base, str(tmp / "adapter")).merge_and_unload()


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_merge_is_peft_merge_bitwise_and_its_report_is_the_merged_model(
    case: str, cache_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from shoestring.hf import load_tokenizer

    torch.set_num_threads(1)
    quantize, dtype, targets, tied = CASES[case]
    model_dir = _model_dir(cache_dir, tmp_path, tied)
    tok = load_tokenizer(model_dir)
    ids = tok(DRIFT_PROBE, return_tensors="pt")["input_ids"]
    model = _trained(model_dir, quantize, dtype, targets)
    adapter_logits = _logits(model, ids)

    # 1 MB shards: several files and an index, as a 7B gets at 2 GB.
    final = export_merged(model, tok, tmp_path, max_shard_bytes=1 << 20)
    assert torch.equal(_logits(model, ids), adapter_logits)  # the model is left as it was

    ref = _peft_merged(model, model_dir, quantize, dtype, tmp_path)
    ref.save_pretrained(str(tmp_path / "ref"))
    want, got = _tensors(tmp_path / "ref"), _tensors(final)
    assert sorted(got) == sorted(want)  # plain names, tied weights once, no quant state
    assert (final / "model.safetensors.index.json").is_file()
    for name, t in want.items():
        assert got[name].dtype == t.dtype == getattr(torch, dtype), name
        assert torch.equal(got[name], t), name

    cfg = json.loads((final / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["dtype"] == dtype
    assert cfg["tie_word_embeddings"] is tied and ("lm_head.weight" in got) is not tied
    loaded = AutoModelForCausalLM.from_pretrained(str(final), attn_implementation="sdpa")
    merged_logits = _logits(loaded, ids)
    assert torch.equal(merged_logits, _logits(ref, ids))
    report = json.loads((final / MERGE_REPORT).read_text())
    assert {k: report[k] for k in logit_drift(adapter_logits, merged_logits)} == logit_drift(
        adapter_logits, merged_logits
    )
    assert report["base"] == ("16/32-bit" if quantize == "none" else "dequantized 4/8-bit")
    assert report["merged_bytes"] == sum(t.numel() * t.element_size() for t in got.values())


def test_sharded_runs_merge_the_exported_adapter_onto_a_fresh_base_the_same_way(
    cache_dir: Path, tmp_path: Path
) -> None:
    from shoestring.hf import load_tokenizer
    from shoestring.train.export import export_adapter, export_merged_from

    torch.set_num_threads(1)
    model_dir = _model_dir(cache_dir, tmp_path, tied=False)
    tok = load_tokenizer(model_dir)
    model = _trained(model_dir, "none", "float32", ["all-linear"])
    in_memory = export_merged(model, tok, tmp_path / "a")
    final = export_adapter(model, tok, tmp_path / "b")
    mcfg = ModelConfig(path=str(model_dir), dtype="float32")
    reloaded = export_merged_from(model_dir, final, mcfg, tok, tmp_path / "b")
    want, got = _tensors(in_memory), _tensors(reloaded)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


#: Runs in a fresh process, so that its peak resident set is the export's alone.
_MEASURE = r"""
import gc, json, sys, warnings
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shoestring.hf import load_tokenizer
from shoestring.stwriter import TensorSpec, write_sharded
from shoestring.train.builtin import build_tokenizer
from shoestring.train.config import LoraSection, ModelConfig
from shoestring.train.export import export_merged
from shoestring.train.model import apply_lora, load_base_model

warnings.simplefilter("ignore")
torch.set_num_threads(1)
model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
config = LlamaConfig(**json.loads(sys.argv[3]))
with torch.device("meta"):
    names = {n: tuple(p.shape) for n, p in LlamaForCausalLM(config).named_parameters()}
gen = torch.Generator().manual_seed(0)
random = lambda s: [(torch.randn(s.shape, generator=gen) * 0.02).to(s.dtype)]
write_sharded(model_dir, [TensorSpec(n, s, torch.bfloat16) for n, s in names.items()], random)
config.save_pretrained(model_dir)
build_tokenizer().save_pretrained(model_dir)

base = load_base_model(model_dir, ModelConfig(path=str(model_dir), dtype="float32"), "nf4")
model = apply_lora(base, LoraSection(r=8), seed=0, gradient_checkpointing=False)
tok = load_tokenizer(model_dir)
gc.collect()

def status(key):
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current resident set
before = status("VmRSS")
final = export_merged(model, tok, out)
report = json.loads((final / "merge_report.json").read_text())
print(json.dumps({"extra": status("VmHWM") - before, **report}))
"""


def test_streamed_merge_of_a_4bit_model_peaks_at_a_few_layers_not_the_model(
    tmp_path: Path,
) -> None:
    """Eight fp32 decoder layers of 28 MB (228 MB merged), quantized to nf4. Run in this
    harness, the old export (reload, ``dequantize()``, merge, save) peaked 321 MB over
    the trained model's resident set; the streamed one 49 MB (largest tensor formed:
    6.3 MB). The bound, three layers (85 MB), fails the old export."""
    shape = {
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 8,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
        "vocab_size": 320,
        "head_dim": 64,
        "pad_token_id": 256,
        "bos_token_id": 257,
        "eos_token_id": 258,
    }
    args = [str(tmp_path / "model"), str(tmp_path), json.dumps(shape)]
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    h, f = shape["hidden_size"], shape["intermediate_size"]
    layer_bytes = (4 * h * h + 3 * h * f) * 4
    assert got["merged_bytes"] > 8 * layer_bytes  # the model: ~228 MB in fp32
    assert got["largest_tensor_bytes"] == h * f * 4  # one MLP weight (or its delta) in fp32
    assert 0 < got["extra"] < 3 * layer_bytes, got


@pytest.mark.parametrize(
    "lora",
    [{"use_dora": True}, {"modules_to_save": ["lm_head"]}],
    ids=["dora", "modules_to_save"],
)
def test_what_the_streamed_merge_cannot_fold_in_is_refused_not_dropped(
    lora: dict[str, Any],
) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from shoestring.train.merge import plan_merge

    cfg = LlamaConfig(
        vocab_size=8,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    model = get_peft_model(
        LlamaForCausalLM(cfg), LoraConfig(r=2, target_modules=["q_proj"], **lora)
    )
    with pytest.raises(NotImplementedError, match="streamed merge"):
        plan_merge(model)
