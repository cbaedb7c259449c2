"""Packing: samples stay whole, rows fill up, and a packed batch trains exactly like
the same samples run one by one (same loss sum, same gradients)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy
import pytest
import torch

from shoestring.data import packing
from shoestring.data.packing import (
    PackPlan,
    collate_packed,
    flatten_packed,
    pack_bins,
    pack_plan,
    packing_stats,
)
from shoestring.data.records import IGNORE_INDEX, DataError, Example

# --- pack_bins ---------------------------------------------------------------------------


def label_count(ex: Example) -> int:
    """Label tokens that enter the loss when the sample runs alone (the first never does)."""
    return sum(1 for t in ex.labels[1:] if t != IGNORE_INDEX)


def test_a_saved_plan_is_read_back_instead_of_packing_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lengths = numpy.random.default_rng(3).integers(1, 200, 5000)
    saved = tmp_path / "packing-256.npy"
    plan = pack_plan(lengths, 256, saved)
    assert [plan.row(p) for p in range(len(plan))] == pack_bins(lengths, 256)
    assert saved.exists()

    def no_packing(*_: object) -> list[list[int]]:
        raise AssertionError("packed again")

    monkeypatch.setattr(packing, "pack_bins", no_packing)
    again = pack_plan(lengths, 256, saved)
    assert numpy.array_equal(again.rows, plan.rows)
    assert numpy.array_equal(again.samples, plan.samples)


@pytest.mark.parametrize("damage", ["torn", "other_samples", "not_a_permutation"])
def test_a_damaged_or_foreign_plan_is_repacked(tmp_path: Path, damage: str) -> None:
    lengths = numpy.random.default_rng(4).integers(1, 100, 300)
    saved = tmp_path / "plan.npy"
    want = pack_plan(lengths, 128, None)
    if damage == "torn":
        pack_plan(lengths, 128, saved)
        saved.write_bytes(saved.read_bytes()[:40])
    elif damage == "other_samples":
        pack_plan(lengths[:200], 128, saved)
    else:
        bad = PackPlan(want.rows.copy(), want.samples.copy())
        bad.samples[0] = bad.samples[1]
        bad.save(saved)
    assert PackPlan.load(saved, len(lengths)) is None
    got = pack_plan(lengths, 128, saved)
    assert numpy.array_equal(got.samples, want.samples)
    assert PackPlan.load(saved, len(lengths)) is not None  # rewritten


def _loads(bins: Sequence[Sequence[int]], lengths: numpy.ndarray) -> list[int]:
    return [int(lengths[list(b)].sum()) for b in bins]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pack_bins_places_every_sample_once_within_block_and_fills_rows(seed: int) -> None:
    block = 512
    lengths = numpy.random.default_rng(seed).integers(1, block // 2 + 1, size=2000)
    bins = pack_bins(lengths, block)

    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    loads = _loads(bins, lengths)
    assert max(loads) <= block
    # A sample opens a row only when it fits in no open row, so any two rows
    # together exceed the block (at most one row is half full or less).
    two_emptiest = sorted(loads)[:2]
    assert sum(two_emptiest) > block
    # Near optimal: no packing can use fewer rows than ceil(tokens / block).
    lower_bound = math.ceil(int(lengths.sum()) / block)
    assert len(bins) <= lower_bound + 2
    stats = packing_stats(bins, lengths, block)
    assert stats["fill"] >= 0.99
    assert stats == {
        "rows": float(len(bins)),
        "samples": 2000.0,
        "tokens": float(lengths.sum()),
        "fill": float(lengths.sum()) / (len(bins) * block),
    }


def test_pack_bins_is_best_fit_and_lists_rows_in_a_fixed_order() -> None:
    # Longest first: 7 -> row A (room 3), 4 -> row B (room 6), 4 -> B (room 2);
    # 2 fits A (room 3) and B (room 2): best fit picks the fuller B (first fit: A).
    assert pack_bins([7, 4, 4, 2], 10) == [[0], [1, 2, 3]]
    # Rows ordered by first index, indices ascending inside a row.
    assert pack_bins([1, 9, 2, 8], 10) == [[0, 1], [2, 3]]
    assert pack_bins([], 10) == []


def test_pack_bins_is_deterministic_and_accepts_lists_and_arrays() -> None:
    lengths = numpy.random.default_rng(7).integers(1, 100, size=500)
    first = pack_bins(lengths, 128)
    assert pack_bins(lengths, 128) == first
    assert pack_bins(lengths.tolist(), 128) == first
    assert pack_bins(lengths.astype(numpy.int32), 128) == first


@pytest.mark.parametrize(
    "lengths,match",
    [
        ([3, 11, 2], r"sample 1 has 11 tokens, more than the block of 10"),
        ([3, 0], r"sample 1 is empty"),
        ([-2], r"sample 0 is empty"),
    ],
)
def test_pack_bins_rejects_bad_lengths(lengths: list[int], match: str) -> None:
    with pytest.raises(DataError, match=match):
        pack_bins(lengths, 10)


def test_pack_bins_rejects_a_non_positive_block() -> None:
    with pytest.raises(DataError, match="block must be positive"):
        pack_bins([1], 0)


def test_pack_bins_is_fast_on_many_samples() -> None:
    lengths = numpy.random.default_rng(3).integers(1, 4097, size=200_000)
    bins = pack_bins(lengths, 4096)  # well under a second; a quadratic packer takes minutes
    assert sum(len(b) for b in bins) == 200_000


# --- collate_packed layout ----------------------------------------------------------------


def test_collate_packed_restarts_positions_masks_first_labels_and_pads_as_own_segment() -> None:
    a = Example([10, 11, 12], [IGNORE_INDEX, 11, 12])
    b = Example([20, 21], [20, 21])  # a text sample with no BOS: its first label is set
    c = Example([30, 31, 32, 33], [IGNORE_INDEX, IGNORE_INDEX, 32, 33])
    batch = collate_packed([[a, b], [c]], pad_id=0, width=7)

    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert all(t.dtype == torch.long and t.shape == (2, 7) for t in batch.values())
    ig = IGNORE_INDEX
    assert batch["input_ids"].tolist() == [[10, 11, 12, 20, 21, 0, 0], [30, 31, 32, 33, 0, 0, 0]]
    assert batch["labels"].tolist() == [[ig, 11, 12, ig, 21, ig, ig], [ig, ig, 32, 33, ig, ig, ig]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 0, 1, 2]]


def test_collate_packed_default_width_is_the_longest_row_and_label_count_is_kept() -> None:
    samples = [Example([5, 6, 7], [5, 6, 7]), Example([8, 9], [IGNORE_INDEX, 9]), Example([4], [4])]
    batch = collate_packed([samples[:2], samples[2:]], pad_id=1)
    assert batch["input_ids"].shape == (2, 5)
    assert batch["position_ids"][1].tolist() == [0, 0, 1, 2, 3]
    # Label tokens of the packed rows (labels[1:], as for any row) == the samples' own counts.
    packed = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    assert packed == sum(label_count(s) for s in samples) == 3


def test_flatten_packed_makes_one_row_whose_row_boundaries_learn_nothing() -> None:
    rows = [[Example([1, 2], [1, 2])], [Example([3, 4, 5], [3, 4, 5]), Example([6], [6])]]
    flat = flatten_packed(collate_packed(rows, pad_id=0, width=4))
    ig = IGNORE_INDEX
    assert flat["input_ids"].tolist() == [[1, 2, 0, 0, 3, 4, 5, 6]]
    assert flat["labels"].tolist() == [[ig, 2, ig, ig, ig, 4, 5, ig]]
    assert flat["position_ids"].tolist() == [[0, 1, 0, 1, 0, 1, 2, 0]]


def test_collate_packed_rejects_rows_that_do_not_fit() -> None:
    with pytest.raises(DataError, match="row 0 has 3 tokens, more than the width of 2"):
        collate_packed([[Example([1, 2, 3], [1, 2, 3])]], pad_id=0, width=2)
    with pytest.raises(DataError, match="row 1 has no samples"):
        collate_packed([[Example([1], [1])], []], pad_id=0)
    with pytest.raises(DataError, match="row 0, sample 0: 2 input ids but 1 labels"):
        collate_packed([[Example([1, 2], [1])]], pad_id=0)


# --- a packed batch trains exactly like its samples alone --------------------------------

VOCAB = 320
BLOCK = 48


def _tiny_llama(attn: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        use_cache=False,  # packing is detected only without a cache (as in the trainer)
        tie_word_embeddings=False,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype)
    model.train()  # dropout is 0 in Llama, so train mode stays deterministic
    return model


def _samples() -> list[Example]:
    """Random samples totalling exactly 3 blocks of tokens: odd ones have a masked
    prompt, even ones are plain text without BOS (loss on every token, the first too)."""
    g = torch.Generator().manual_seed(1)
    lengths = [20, 7, 13, 31, 9, 16, 4, 21, 11, 12]
    assert sum(lengths) == 3 * BLOCK
    out = []
    for k, n in enumerate(lengths):
        ids = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        prompt = (n // 3) if k % 2 else 0
        out.append(Example(ids, [IGNORE_INDEX] * prompt + ids[prompt:]))
    return out


def _loss_sum(model: torch.nn.Module, labels: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
    """Cross entropy summed over every shifted label that is not IGNORE_INDEX."""
    logits = model(**inputs).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB),
        labels[:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def _loss_and_grads(
    model: torch.nn.Module, batches: Sequence[dict[str, torch.Tensor]]
) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    total = 0.0
    for batch in batches:
        loss = _loss_sum(model, **batch)
        loss.backward()
        total += float(loss.detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return total, grads


def _alone(samples: Sequence[Example]) -> list[dict[str, torch.Tensor]]:
    return [
        {"input_ids": torch.tensor([s.input_ids]), "labels": torch.tensor([s.labels])}
        for s in samples
    ]


def _padded(samples: Sequence[Example]) -> list[dict[str, torch.Tensor]]:
    width = max(len(s.input_ids) for s in samples)
    ids = torch.zeros((len(samples), width), dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for r, s in enumerate(samples):
        ids[r, : len(s.input_ids)] = torch.tensor(s.input_ids)
        labels[r, : len(s.labels)] = torch.tensor(s.labels)
        mask[r, : len(s.input_ids)] = 1
    return [{"input_ids": ids, "labels": labels, "attention_mask": mask}]


def _packed(samples: Sequence[Example], width: int) -> dict[str, torch.Tensor]:
    bins = pack_bins([len(s.input_ids) for s in samples], BLOCK)
    return collate_packed([[samples[i] for i in b] for b in bins], pad_id=0, width=width)


def _relative_gap(
    a: tuple[float, dict[str, torch.Tensor]], b: tuple[float, dict[str, torch.Tensor]]
) -> float:
    """Largest relative difference: of the loss sums, and of each parameter's gradient (by norm)."""
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert grads_a.keys() == grads_b.keys()
    gaps = [abs(loss_a - loss_b) / abs(loss_b)]
    for name, g in grads_b.items():
        gaps.append(float((grads_a[name] - g).norm() / g.norm().clamp_min(1e-30)))
    return max(gaps)


@pytest.fixture(scope="module")
def samples() -> list[Example]:
    return _samples()


@pytest.mark.parametrize(
    "attn,dtype,tolerance",
    [
        ("sdpa", torch.float32, 1e-6),  # fp32 round-off alone is ~5e-7
        ("eager", torch.float32, 1e-6),
        # In fp64 the only difference left is round-off at 1e-16: the same computation.
        # (Not eager: Llama's eager attention takes its softmax in fp32.)
        ("sdpa", torch.float64, 1e-12),
    ],
)
def test_packed_batch_has_the_loss_and_gradients_of_its_samples_alone(
    attn: str, dtype: torch.dtype, tolerance: float, samples: list[Example]
) -> None:
    model = _tiny_llama(attn, dtype)
    alone = _loss_and_grads(model, _alone(samples))
    padded = _loss_and_grads(model, _padded(samples))
    # Width 64 > BLOCK: every row also carries a padding segment.
    packed_batch = _packed(samples, width=64)
    assert packed_batch["input_ids"].shape[0] < len(samples)  # samples really share rows
    packed = _loss_and_grads(model, [packed_batch])
    # All rows as one (what flash attention needs): the same training signal.
    flat = _loss_and_grads(model, [flatten_packed(packed_batch)])

    assert _relative_gap(padded, alone) < tolerance  # the reference agrees with itself
    assert _relative_gap(packed, alone) < tolerance
    assert _relative_gap(flat, alone) < tolerance


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packing_without_separation_does_not_match(attn: str, samples: list[Example]) -> None:
    """The same check fails for the ways packing goes wrong, so it has teeth."""
    model = _tiny_llama(attn)
    alone = _loss_and_grads(model, _alone(samples))
    packed_batch = _packed(samples, width=64)

    # Same rows, but positions run on across samples: attention crosses them.
    no_reset = {k: v for k, v in packed_batch.items() if k != "position_ids"}
    assert _relative_gap(_loss_and_grads(model, [no_reset]), alone) > 1e-3

    # Positions reset but first labels kept: a sample's last token learns the next's first.
    with_first_labels = dict(packed_batch)
    rows = [[samples[i] for i in b] for b in pack_bins([len(s.input_ids) for s in samples], BLOCK)]
    labels = torch.full_like(packed_batch["labels"], IGNORE_INDEX)
    for r, row in enumerate(rows):
        flat = [t for s in row for t in s.labels]
        labels[r, : len(flat)] = torch.tensor(flat)
    with_first_labels["labels"] = labels
    assert _relative_gap(_loss_and_grads(model, [with_first_labels]), alone) > 1e-3

    # The old concatenate-and-cut packing (shoestring.train.data.pack before this module):
    # the samples total exactly 3 blocks, so no token is dropped, yet samples are split
    # across rows and attend to each other.
    ids = [t for s in samples for t in s.input_ids]
    labels_flat = [t for s in samples for t in s.labels]
    assert len(ids) == 3 * BLOCK
    old_batch = {
        "input_ids": torch.tensor(ids).reshape(3, BLOCK),
        "labels": torch.tensor(labels_flat).reshape(3, BLOCK),
    }
    assert _relative_gap(_loss_and_grads(model, [old_batch]), alone) > 1e-3
