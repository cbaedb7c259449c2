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
