"""A mixture-of-experts base through the trainer and back: LoRA trains on it as peft
adapts it (the attention as linear layers; the router and the fused experts as
parameters), and ``shoestring infer`` streams the base with that adapter merged, expert
by expert, to the answers of peft's own merged model. (The base itself streams exactly:
``test_infer_engine.py``, ``test_infer_job.py``; its refusals before loading:
``test_early_errors.py``.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import FAST
from shoestring.cli import main
from shoestring.infer.fixtures import build_random_model


def test_lora_trains_an_moe_base_and_infer_merges_its_expert_adapter_as_peft(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("SHOESTRING_CACHE", str(cache_dir))
    moe = build_random_model(tmp_path / "moe", "qwen3_moe", num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=64, init_std=0.02)  # fmt: skip
    out = tmp_path / "run"
    args = [*FAST, "--train.max_steps", "3", "--model.path", str(moe), "--lora.dropout", "0"]
    assert main(["finetune", "--output_dir", str(out), *args]) == 0
    final = out / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert {"gate_up_proj", "down_proj"} <= set(config["target_parameters"])
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= set(config["target_modules"])
    tensors = load_file(str(final / "adapter_model.safetensors"))
    experts = [k for k in tensors if ".mlp.experts." in k and ".lora_B." in k]
    assert experts and all(bool(tensors[k].ne(0).any()) for k in experts)  # trained, from 0
    losses = [
        e["loss"]
        for e in map(json.loads, (out / "events.jsonl").read_text().splitlines())
        if e["event"] == "step"
    ]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    # Its answers, streamed with the adapter merged per stored expert tensor, are those of
    # peft's merged model (and not the base's).
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(moe)), str(final))
    _streams_as(moe, final, merged.merge_and_unload().eval(), tmp_path)


def test_the_merged_export_of_an_moe_is_peft_merge_in_the_stored_layout(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``export.merged`` on an MoE base trained with expert adapters writes what peft's
    ``merge_and_unload`` + ``save_pretrained`` write: the experts back in the Hub's
    layout (a tensor per expert and projection, as the base is stored), every tensor
    bitwise equal; it loads without peft and answers as peft's merged model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("SHOESTRING_CACHE", str(cache_dir))
    moe = build_random_model(tmp_path / "moe", "qwen3_moe", num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=64, init_std=0.02)  # fmt: skip
    out = tmp_path / "run"
    args = [*FAST, "--train.max_steps", "3", "--model.path", str(moe), "--lora.dropout", "0"]
    assert main(["finetune", "--output_dir", str(out), *args, "--export.merged"]) == 0
    peft_merged = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(moe)), str(out / "final")
    ).merge_and_unload()
    peft_merged.save_pretrained(str(tmp_path / "peft-merged"))
    ours, theirs = (_tensors(d) for d in (out / "merged", tmp_path / "peft-merged"))
    assert ours.keys() == theirs.keys() == _tensors(moe).keys()  # the stored layout
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in ours
    for k, v in theirs.items():
        assert ours[k].dtype == v.dtype and torch.equal(ours[k], v), k
    base = _tensors(moe)
    assert not torch.equal(ours["model.layers.0.mlp.experts.0.down_proj.weight"],
                           base["model.layers.0.mlp.experts.0.down_proj.weight"])  # fmt: skip
    report = json.loads((out / "merged" / "merge_report.json").read_text())
    print(f"MoE merged export: drift max {report['max_abs']:.3g}")
    assert report["top1_agreement"] == 1.0 and report["max_abs"] < 1e-3
    loaded = AutoModelForCausalLM.from_pretrained(str(out / "merged")).eval()
    ids = torch.tensor([[5, 9, 33, 7, 81]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, peft_merged.eval()(ids).logits)


def test_lora_on_the_experts_without_gradient_checkpointing_is_warned_before_loading(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """peft forms each adapted expert stack whole in the forward and autograd keeps it:
    at real size that was the difference between killed and training. The check on the
    model's skeleton (no weight read) says so, and names the remedy; not when it is on,
    nor for an adapter on the attention only."""
    from shoestring.config import load
    from shoestring.train.config import FinetuneConfig
    from shoestring.train.model import check_fused_base

    moe = build_random_model(tmp_path / "moe", "qwen3_moe", num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=64)  # fmt: skip
    attention = ["--lora.target_modules", "q_proj,k_proj,v_proj,o_proj"]
    said = []
    for flags in ([], ["--model.gradient_checkpointing", "true"], attention):
        cfg = load(FinetuneConfig, None, ["--lora.dropout", "0", *flags])
        caplog.clear()
        with caplog.at_level("WARNING", "shoestring.finetune"):
            check_fused_base(moe, cfg.model, cfg.lora)
        said.append("--model.gradient_checkpointing true" in caplog.text)
    assert said == [True, False, False]


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


def _streams_as(model: Path, adapter: Path, merged: torch.nn.Module, tmp_path: Path) -> None:
    """``infer --adapter`` gives ``merged``'s greedy answers, which are not the base's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    prompts = ["alpha beta", "gamma", "delta eps alpha"]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    out = tmp_path / "out.jsonl"
    args = ["infer", "--model", str(model), "--adapter", str(adapter), "--input", str(inp),
            "--output", str(out), "--max-new-tokens", "5", "--threads", "1",
            "--job.progress", "off"]  # fmt: skip
    assert main(args) == 0
    got = [json.loads(x)["completion"] for x in out.read_text().splitlines()]

    def greedy(m: torch.nn.Module) -> list[str]:
        texts = []
        for p in prompts:
            ids = tok(p, return_tensors="pt")["input_ids"]
            g = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                           do_sample=False)  # fmt: skip
            texts.append(tok.decode(g[0, ids.shape[1] :], skip_special_tokens=True))
        return texts

    base = AutoModelForCausalLM.from_pretrained(str(model)).eval()
    assert got == greedy(merged) and got != greedy(base)


def test_an_attention_adapter_streams_on_an_moe_base_as_peft_merges_it(tmp_path: Path) -> None:
    """Mixtral (``block_sparse_moe`` names) with an adapter on the attention only."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    moe = build_random_model(tmp_path / "moe", "mixtral", num_local_experts=4,
                             num_experts_per_tok=2, seed=3)  # fmt: skip
    torch.manual_seed(0)
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(moe)),
        LoraConfig(r=4, lora_alpha=8, target_modules=attention, init_lora_weights=False),
    )
    peft_model.save_pretrained(str(tmp_path / "final"))
    _streams_as(moe, tmp_path / "final", peft_model.merge_and_unload().eval(), tmp_path)


def test_an_expert_adapter_streams_as_peft_merges_it(tmp_path: Path) -> None:
    """Qwen3-MoE with random (not zero) adapters on everything peft adapts: the attention,
    the router and both fused expert parameters (gate/up, down), split per stored
    expert tensor as they stream; with ``rank_pattern`` (peft doubles gate_up's rank)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    moe = build_random_model(tmp_path / "moe", "qwen3_moe", num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=64, init_std=0.02)  # fmt: skip
    torch.manual_seed(0)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(moe)),
        LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=0.0,
            target_modules="all-linear",
            init_lora_weights=False,
        ),  # fmt: skip
    )
    peft_model.save_pretrained(str(tmp_path / "final"))
    config = json.loads((tmp_path / "final" / "adapter_config.json").read_text())
    assert "gate_up_proj" in config["target_parameters"] and config["rank_pattern"]
    _streams_as(moe, tmp_path / "final", peft_model.merge_and_unload().eval(), tmp_path)


def test_an_expert_adapter_streams_on_an_fp8_moe_base_as_peft_merges_it(tmp_path: Path) -> None:
    """Qwen3-MoE stored in FP8 (as the Hub's ``Qwen3-*-FP8`` are: each expert's weight
    with its block scales): the experts are decoded, then fused, then the adapter's
    per-expert pairs merged, as peft merges them into transformers' dequantized model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from shoestring.infer.fixtures import save_fp8

    base = build_random_model(tmp_path / "moe", "qwen3_moe", num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=64, init_std=0.02)  # fmt: skip
    fp8 = save_fp8(base, tmp_path / "fp8", (64, 64))
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                      init_lora_weights=False)  # fmt: skip
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(fp8)), lora)
    peft_model.save_pretrained(str(tmp_path / "final"))
    config = json.loads((tmp_path / "final" / "adapter_config.json").read_text())
    assert "gate_up_proj" in config["target_parameters"]
    _streams_as(fp8, tmp_path / "final", peft_model.merge_and_unload().eval(), tmp_path)
