"""QLoRA on CPU: 4-bit NF4 base + 8-bit AdamW trains, checkpoints and resumes bit-exactly
(through the real CLI, with a SIGKILL mid-run); the first-step gradient check; no
silent fp32 upcast; and the 16-bit merge reports its measured logit drift."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from conftest import CLI, read_events, state_digest

pytest.importorskip("bitsandbytes")

QLORA = [
    "--train.max_steps",
    "8",
    "--train.batch_size",
    "4",
    "--train.num_threads",
    "1",
    "--train.warmup_steps",
    "2",
    "--checkpoint.every_steps",
    "4",
    "--checkpoint.keep",
    "3",
    "--data.max_length",
    "24",
    "--data.eval",
    "",
    "--lora.quantize",
    "nf4",
    "--train.optimizer",
    "adamw8bit",
    "--lora.r",
    "16",
]


def test_qlora_sigkill_resume_is_bit_exact_and_merge_reports_drift(
    cli: CLI, cache_dir: Path, tmp_path: Path
) -> None:
    from safetensors import safe_open

    from shoestring.config import load
    from shoestring.train.config import FinetuneConfig
    from shoestring.train.loop import RunOptions, finetune

    ref_out, out = tmp_path / "ref", tmp_path / "run"
    # A CLI run killed without notice right after its step-4 checkpoint commits (training
    # is on a later step; a kill at a step's end could beat a slow save) ...
    killed = cli.start(out, *QLORA, env={"SHOESTRING_FAULTS": "ckpt.after_rename@1:kill"})
    # ... meanwhile the uninterrupted reference runs in this process (same code path,
    # one thread) and also exports the merged model.
    torch.set_num_threads(1)
    cfg = load(
        FinetuneConfig,
        None,
        [
            "--output_dir",
            str(ref_out),
            *QLORA,
            "--export.merged",
            "true",
            "--watch.enabled",
            "false",
        ],
    )
    assert finetune(cfg, RunOptions(resume="never", cache_dir=cache_dir, tty=False)) == 0
    assert killed.wait(timeout=300) != 0
    resumed = cli.run(out, *QLORA)
    assert resumed.returncode == 0, resumed.stderr
    assert [e["from_step"] for e in read_events(out) if e["event"] == "resume"] == [4]
    assert state_digest(out, 8) == state_digest(ref_out, 8)

    # The optimizer really is 8-bit, and its blockwise state made it through safetensors.
    with safe_open(str(out / "checkpoints" / "step-00000008" / "optimizer.safetensors"), "pt") as f:
        dtypes = {k.split(".", 2)[2]: f.get_tensor(k).dtype for k in f.keys()}
    assert dtypes["__bnb_optimizer_quant_state__.state1"] == torch.uint8
    assert dtypes["__bnb_optimizer_quant_state__.absmax1"] == torch.float32

    report = json.loads((ref_out / "merged" / "merge_report.json").read_text())
    assert report["base"] == "dequantized 4/8-bit"
    # fp32 compute: merging onto dequant(W4) must reproduce the adapter-on-4-bit logits
    # up to float rounding; the report carries the measured drift, not a constant.
    assert 0 <= report["max_abs"] < 1e-3 * max(report["ref_std"], 1.0)
    assert report["top1_agreement"] == 1.0
    merged_cfg = json.loads((ref_out / "merged" / "config.json").read_text())
    assert "quantization_config" not in merged_cfg


def _tiny_qlora(cache_dir: Path, dtype: str = "float32") -> tuple[object, object]:
    from shoestring.train.builtin import materialize_tiny_model
    from shoestring.train.config import ModelConfig
    from shoestring.train.model import load_base_model

    d = materialize_tiny_model(cache_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return d, load_base_model(d, ModelConfig(path=str(d), dtype=dtype), "nf4")


def test_no_fp32_upcast_unlike_peft_prepare(cache_dir: Path) -> None:
    from peft import prepare_model_for_kbit_training

    from shoestring.train.model import upcast_frozen_params

    _, model = _tiny_qlora(cache_dir, "bfloat16")
    assert upcast_frozen_params(model, "bfloat16") == []
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    # What we avoid: peft's helper casts embeddings, head and norms to fp32.
    prepared = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    assert "lm_head.weight" in upcast_frozen_params(prepared, "bfloat16")


def test_first_step_check_catches_adapters_without_gradient(cache_dir: Path) -> None:
    from shoestring.train.config import LoraSection
    from shoestring.train.model import (
        NoGradientError,
        apply_lora,
        check_lora_gradients,
        trainable_parameters,
    )

    torch.set_num_threads(1)
    ids = torch.randint(0, 256, (2, 12))
    _, base = _tiny_qlora(cache_dir)
    good = apply_lora(base, LoraSection(r=8), seed=0, gradient_checkpointing=True)
    good.train()
    good(input_ids=ids, labels=ids).loss.backward()
    check_lora_gradients(trainable_parameters(good))  # passes: every lora_B has a gradient

    # The silent failure: reentrant checkpointing on a frozen base whose inputs do not
    # require grad. The loss still backpropagates through nothing; adapters never move.
    _, base = _tiny_qlora(cache_dir)
    bad = apply_lora(base, LoraSection(r=8), seed=0, gradient_checkpointing=False)
    bad.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    bad.disable_input_require_grads()  # transformers re-enables it for PEFT; undo that
    bad.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = bad(input_ids=ids, labels=ids).loss
        if loss.requires_grad:
            loss.backward()
    with pytest.raises(NoGradientError, match="no gradient"):
        check_lora_gradients(trainable_parameters(bad))


def test_quantize_needs_bitsandbytes_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from shoestring.config import ConfigError
    from shoestring.train.model import quantization_config

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails
    with pytest.raises(ConfigError, match=r"lora.quantize: .*shoestring\[qlora\]"):
        quantization_config("nf4", "bfloat16")


def test_quantize_and_optimizer_are_not_resume_safe() -> None:
    from shoestring.config import load
    from shoestring.train.config import FinetuneConfig, config_hash

    base = config_hash(load(FinetuneConfig, None, []))
    assert config_hash(load(FinetuneConfig, None, ["--lora.quantize", "nf4"])) != base
    assert config_hash(load(FinetuneConfig, None, ["--train.optimizer", "adamw8bit"])) != base
    assert (
        config_hash(load(FinetuneConfig, None, ["--plan.gpu", "T4", "--plan.enforce", "false"]))
        == base
    )


def test_an_eval_does_not_change_the_4bit_base_training_uses(cache_dir: Path) -> None:
    """bitsandbytes >= 0.50 repacks a Linear4bit for its AVX512-BF16 CPU kernel on the
    first no-grad forward in eval mode, rounding the block scales to bf16 and routing
    later forwards through a kernel autograd cannot see through. A mid-run eval would
    then change the model being trained (and a resumed run, loading fresh weights,
    would diverge from an uninterrupted one). The loaded base must keep one format."""
    from shoestring.train.config import LoraSection
    from shoestring.train.model import apply_lora, trainable_parameters

    torch.set_num_threads(1)
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 12))
    _, base = _tiny_qlora(cache_dir)
    model = apply_lora(base, LoraSection(r=8, dropout=0.0), seed=0, gradient_checkpointing=False)

    def train_step() -> tuple[float, dict[str, torch.Tensor]]:
        model.train()
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in trainable_parameters(model).items()}

    before_loss, before_grads = train_step()
    model.eval()
    with torch.no_grad():
        eval_logits = model(input_ids=ids).logits
    after_loss, after_grads = train_step()
    assert after_loss == before_loss
    assert before_grads.keys() == after_grads.keys()
    for name, g in before_grads.items():
        assert torch.equal(g, after_grads[name]), name
    # and the eval computed the same function the training step did
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, eval_logits)
    states = [
        m.weight.quant_state
        for m in model.modules()
        if hasattr(m, "weight") and getattr(m.weight, "quant_state", None) is not None
    ]
    assert states and not any(getattr(s, "packing_format_for_cpu", False) for s in states)
