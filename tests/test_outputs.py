"""Outputs users load with the ecosystem's own tools: a PEFT adapter dir and a merged model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from conftest import CLI, FAST, read_events


def test_final_adapter_loads_with_peft_and_matches_merged(cli: CLI, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    r = cli.run(out, *FAST, "--export.merged", "true")
    assert r.returncode == 0, r.stderr
    final = out / "final"
    cfg = json.loads((final / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 16
    model_dir = Path(cfg["base_model_name_or_path"])
    assert (model_dir / "config.json").exists()

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(final)).eval()
    # The adapter really is the trained one: equal to the step-12 checkpoint's tensors.
    ck = load_file(str(out / "checkpoints" / "step-00000012" / "adapter.safetensors"))
    live = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    assert set(live) == set(ck)
    for n, t in ck.items():
        assert torch.equal(live[n], t), n
    assert any(t.abs().sum() > 0 for n, t in ck.items() if "lora_B" in n)

    merged = AutoModelForCausalLM.from_pretrained(str(out / "merged"), dtype=torch.float32).eval()
    ids = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = peft_model(input_ids=ids).logits
        b = merged(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
    assert not torch.allclose(a, plain, atol=1e-4)  # the adapter changes the model
    end = [e for e in read_events(out) if e["event"] == "run_end"][-1]
    assert end["status"] == "completed" and end["merged"].endswith("merged")


def test_event_log_schema(cli: CLI, tmp_path: Path) -> None:
    out = tmp_path / "run"
    r = cli.run(
        out, *FAST, "--data.eval", "auto", "--eval.max_samples", "8", "--eval.every_steps", "6"
    )
    assert r.returncode == 0, r.stderr
    ev = read_events(out)
    kinds = [e["event"] for e in ev]
    # The process start (from the CLI, so a number), its load phases, then the run.
    assert kinds[:5] == ["start", "load", "load", "run_start", "data"]
    assert kinds[-2:] == ["run_end", "cost"]
    start, data_load, model_load = ev[:3]
    assert isinstance(start["process_start"], float) and start["process_start"] <= start["ts"]
    assert (data_load["phase"], model_load["phase"]) == ("data", "model")
    assert model_load["source"] == "model_dir" and model_load["seconds"] >= model_load["read_s"]
    ev = ev[3:]  # from run_start on, as below
    data = ev[1]
    assert data["cache"] in ("built", "hit") and data["samples"] == ev[0]["train_samples"] > 0
    assert data["tokens"] > 0 and data["truncated"] >= 0 and data["eval_samples"] > 0
    steps = [e for e in ev if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, 13))
    for e in steps:
        assert {
            "v",
            "ts",
            "run_id",
            "rank",
            "loss",
            "lr",
            "tokens",
            "tokens_per_s",
            "step_ms",
        } <= set(e)
        assert e["tokens_per_s"] > 0 and e["loss"] > 0
    ck = [e for e in ev if e["event"] == "checkpoint"]
    assert [e["step"] for e in ck] == [4, 8, 12]
    for e in ck:
        assert e["bytes"] > 0 and e["blocking_ms"] >= 0 and e["background_ms"] > 0
    evals = [e for e in ev if e["event"] == "eval"]
    assert [e["tag"] for e in evals] == ["before", "periodic", "after"]
    assert all(0 <= e["exact_match"] <= 1 and e["perplexity"] > 1 for e in evals)
    assert "exact-match" in r.stderr and "before:" in r.stderr and "after:" in r.stderr
