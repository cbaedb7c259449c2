"""benchmarks/scale.py --small: the streamed real-shape writer (MHA and GQA Llamas, sharded
bf16 safetensors with an index) writes what transformers loads, equal tensor for tensor to
the same model built in memory, without holding the model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.e2e


@pytest.mark.slow  # ~50 s in CI: benchmark tooling (scale.py), not a product path; the
# writer's block-at-a-time unit test below stays in CI (CI time, 2026-12-06)
def test_scale_small_builds_models_transformers_loads_equal(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "scale.py"),
            "--small",
            "--checks",
            "build",
            "--out",
            str(out),
            "--work",
            str(tmp_path / "work"),
            "--cache",
            str(tmp_path / "models"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["small"] is True and set(report["shapes"]) == {"small-mha", "small-gqa"}
    for name, shape in report["shapes"].items():
        build = shape["build"]
        assert build["built_now"] and build["equal_to_in_memory_model"] is True, name
        model = tmp_path / "models" / f"realshape-{name}-s0-v1"
        index = json.loads((model / "model.safetensors.index.json").read_text())
        shards = list(model.glob("*.safetensors"))
        assert index["metadata"]["total_size"] == sum(_data_bytes(p) for p in shards)
        assert build["shards"] == len(set(index["weight_map"].values())) > 1, name


def test_the_writer_streams_a_block_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """What is generated at once is one row block, not the tensor (a 128k-vocabulary
    embedding is 1 GB of bf16); the blocks are the tensor's values whatever their size."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import torch

    import realshape

    whole = realshape.init_tensor("model.embed_tokens.weight", (128256, 64), 0, torch.bfloat16)
    monkeypatch.setattr(realshape, "ROW_BLOCK_ELEMS", 64 * 1000)
    blocks = list(
        realshape.row_blocks("model.embed_tokens.weight", (128256, 64), 0, torch.bfloat16)
    )
    assert len(blocks) == 129 and all(b.numel() <= 64 * 1000 for b in blocks)
    assert torch.equal(torch.cat(blocks), whole)
    assert not torch.equal(  # each tensor has its own stream
        whole[:8], realshape.init_tensor("lm_head.weight", (8, 64), 0, torch.bfloat16)
    )


def _data_bytes(path: Path) -> int:
    import struct

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return path.stat().st_size - 8 - n


def test_an_moe_shape_is_written_as_the_hub_stores_it_and_loads_fused(tmp_path: Path) -> None:
    """The writer takes the checkpoint's names from transformers with its load-time
    conversions reverted: an MoE (OLMoE) is written one tensor per expert, as on the Hub,
    and transformers loads it into its fused experts, tensor for tensor."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(REPO / "benchmarks"))
    import realshape

    model_dir = realshape.write_model(tmp_path / "moe", realshape.SHAPES["small-moe"])
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    names = set(index["weight_map"])
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in names
    assert not any("gate_up_proj" in n for n in names)
    model, info = AutoModelForCausalLM.from_pretrained(str(model_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    fused = model.model.layers[1].mlp.experts.gate_up_proj.detach()
    for e in range(4):
        gate, up = (
            realshape.init_tensor(
                f"model.layers.1.mlp.experts.{e}.{p}_proj.weight", (128, 256), 0, torch.bfloat16
            )  # fmt: skip
            for p in ("gate", "up")
        )
        assert torch.equal(fused[e].to(torch.bfloat16), torch.cat([gate, up]))


def test_a_gpt_oss_shape_is_written_with_mxfp4_experts_as_the_hub_stores_them(
    tmp_path: Path,
) -> None:
    """openai/gpt-oss-*'s layout: each layer's experts as MXFP4 blocks and scales, written
    an expert at a time; transformers loads it with nothing missing, its experts of
    the init's magnitude, and the streaming engine computes what transformers computes
    on it, bit for bit."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(REPO / "benchmarks"))
    import realshape
    from shoestring.infer.decode import prompt_logits
    from shoestring.infer.engine import StreamingCausalLM

    model_dir = realshape.write_model(tmp_path / "oss", realshape.SHAPES["small-gpt-oss"])
    names = set(json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"])
    assert {"model.layers.1.mlp.experts.gate_up_proj_blocks",
            "model.layers.1.mlp.experts.down_proj_scales"} <= names  # fmt: skip
    assert not any(n.endswith("experts.gate_up_proj") for n in names)
    model, info = AutoModelForCausalLM.from_pretrained(str(model_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    got = model.model.layers[1].mlp.experts.gate_up_proj.float()
    assert 0.005 < got.std().item() < 0.05  # about INIT_STD: the init's magnitudes
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    eng = StreamingCausalLM(model_dir, device=torch.device("cpu")).start(resident=0, depth=1)
    try:
        logits = prompt_logits(eng, prompts)
    finally:
        eng.close()
    for p, lg in zip(prompts, logits, strict=True):
        with torch.no_grad():
            assert torch.equal(lg, model.eval()(torch.tensor([p])).logits[0].float())
