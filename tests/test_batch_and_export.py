"""Direct tests of the global-batch split and of the final adapter export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shoestring.config import ConfigError
from shoestring.train.parallel import BatchPlan


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_rank_takes_a_disjoint_share_of_the_same_global_batch(world: int) -> None:
    plans = [BatchPlan.make(16, 2, world, r) for r in range(world)]
    chunks = [c for p in plans for c in p.my_chunks()]
    assert sorted(c[0] for c in chunks) == list(range(8))  # 8 micro-batches of 2, each once
    assert sorted(c[1] for c in chunks) == list(range(0, 16, 2))
    assert all(size == 2 for _, _, size in chunks)
    assert plans[0].accum == 8 // world
    # rank r's micro-batches are contiguous: r*A .. (r+1)*A - 1
    for r, p in enumerate(plans):
        assert [c[0] for c in p.my_chunks()] == list(range(r * p.accum, (r + 1) * p.accum))


def test_auto_micro_batch_is_the_per_rank_share() -> None:
    p = BatchPlan.make(12, 0, 3, 1)
    assert (p.micro_batch_size, p.accum) == (4, 1)
    assert list(p.my_chunks()) == [(1, 4, 4)]


@pytest.mark.parametrize("batch,micro,world", [(16, 3, 1), (10, 2, 4), (3, 0, 4)])
def test_a_split_that_does_not_divide_is_refused_naming_the_keys(
    batch: int, micro: int, world: int
) -> None:
    with pytest.raises(ConfigError, match=r"train\.batch_size .* train\.micro_batch_size"):
        BatchPlan.make(batch, micro, world, 0)


def test_exported_adapter_loads_in_peft_with_the_trained_weights(
    tmp_path: Path, cache_dir: Path
) -> None:
    from peft import PeftModel

    from shoestring.hf import load_tokenizer
    from shoestring.train.config import LoraSection, ModelConfig
    from shoestring.train.export import export_adapter
    from shoestring.train.model import (
        apply_lora,
        load_base_model,
        resolve_model_dir,
        trainable_parameters,
    )

    mcfg = ModelConfig(dtype="float32")
    model_dir = resolve_model_dir(mcfg, cache_dir)
    model = apply_lora(load_base_model(model_dir, mcfg), LoraSection(r=4, alpha=8), 0, False)
    with torch.no_grad():  # make the adapter non-trivial (lora_B starts at zero)
        for p in trainable_parameters(model).values():
            p.add_(torch.randn_like(p) * 0.01)
    final = export_adapter(model, load_tokenizer(model_dir), tmp_path)
    assert final == tmp_path / "final"
    assert (final / "adapter_model.safetensors").is_file()
    assert not list(tmp_path.glob(".tmp-final-*"))  # written aside, renamed into place
    loaded = PeftModel.from_pretrained(load_base_model(model_dir, mcfg), str(final))
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)
