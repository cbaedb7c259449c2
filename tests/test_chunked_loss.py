"""The two memory levers of issue 25 (item 6) against the plain step, on a tiny random
Llama (hidden 128, two 64-wide heads, vocab 320): chunked cross-entropy
(``train.loss_chunk_tokens``) gives transformers' loss and the same LoRA gradients, and
activation offload (``train.offload_activations``) takes exactly the saved activations
(no weights) and changes nothing. Tolerances: fp32, rtol 1e-5 (the chunks only reorder
a float sum); offload is bit-exact."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import CLI, FAST, read_events
from shoestring.config import ConfigError
from shoestring.plan.measure import saved_activation_bytes
from shoestring.train.chunkedloss import _chunk_loss, causal_lm, causal_lm_loss, chunked_lm_loss
from shoestring.train.offload import HostOffload

B, S, VOCAB = 2, 40, 320  # 80 positions


def _model(gc: bool, dropout: float = 0.0, targets: tuple[str, ...] = ("all-linear",)) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    from shoestring.train.config import LoraSection
    from shoestring.train.model import apply_lora

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        tie_word_embeddings=False,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg)
    base.config.use_cache = False
    lora = LoraSection(r=8, alpha=16, dropout=dropout, target_modules=list(targets))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = apply_lora(base, lora, seed=0, gradient_checkpointing=gc)
    with torch.no_grad():  # B = 0 at init would leave every lora_A gradient zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model.train()
    return model


def _batch() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A padded row, an ignored prompt, as the trainer collates them."""
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, 25:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, :7] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}, (
        labels[:, 1:] != -100
    ).sum()


def _step(model: Any, forward: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(5)  # the same dropout masks in both paths
    loss = forward()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _plain(model: Any, batch: dict[str, torch.Tensor], n: torch.Tensor) -> Any:
    return lambda: model(**batch, num_items_in_batch=n).loss


@pytest.mark.parametrize(
    "gc,chunk",
    [(False, 16), (False, 23), (True, 23), (False, 500)],
    ids=["divides", "remainder", "remainder-gc", "one-chunk"],
)
def test_chunked_loss_matches_transformers_loss(gc: bool, chunk: int) -> None:
    torch.set_num_threads(1)
    model = _model(gc, dropout=0.1)
    batch, n = _batch()
    loss, grads = _step(model, _plain(model, batch, n))
    c_loss, c_grads = _step(model, lambda: causal_lm_loss(model, model, batch, n, chunk))
    torch.testing.assert_close(c_loss, loss, rtol=1e-5, atol=0)
    assert c_grads.keys() == grads.keys() and len(grads) == 2 * 7 * 2
    for name, g in grads.items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(c_grads[name], g, rtol=1e-5, atol=1e-8, msg=name)


def test_adapted_head_is_chunked_and_its_dropout_replayed() -> None:
    """A LoRA lm_head: without dropout the same loss and gradients as the plain path;
    with dropout each chunk draws its own mask, and backward's recompute replays it
    (the gradients are those of the same chunks computed without checkpointing)."""
    torch.set_num_threads(1)
    model = _model(False, targets=("q_proj", "lm_head"))
    batch, n = _batch()
    loss, grads = _step(model, _plain(model, batch, n))
    c_loss, c_grads = _step(model, lambda: causal_lm_loss(model, model, batch, n, 23))
    assert any("lm_head.lora" in k for k in grads)
    torch.testing.assert_close(c_loss, loss, rtol=1e-5, atol=0)
    for name, g in grads.items():
        torch.testing.assert_close(c_grads[name], g, rtol=1e-5, atol=1e-8, msg=name)

    head = model.get_base_model().lm_head
    head.lora_dropout["default"] = torch.nn.Dropout(0.3)  # PEFT made it an Identity (p=0)
    hidden = torch.randn(B, S, 128, requires_grad=True)

    def unchecked() -> torch.Tensor:
        shifted = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[..., 1:]
        pairs = zip(hidden.reshape(-1, 128).split(23), shifted.reshape(-1).split(23))
        return sum(_chunk_loss(head, h, y) for h, y in pairs) / n  # type: ignore[return-value]

    ref, ref_grads = _step(model, unchecked)
    got, got_grads = _step(model, lambda: chunked_lm_loss(head, hidden, batch["labels"], n, 23))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=0)
    for name, g in ref_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-8, msg=name)


def test_models_it_cannot_chunk_are_refused() -> None:
    model = _model(False)
    assert causal_lm(model) is model.get_base_model()
    model.get_base_model().config.final_logit_softcapping = 30.0
    with pytest.raises(ConfigError, match=r"train.loss_chunk_tokens: .*final_logit_softcapping"):
        causal_lm(model)
    with pytest.raises(ConfigError, match="train.loss_chunk_tokens: .* no lm_head"):
        causal_lm(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("gc", [False, True], ids=["nogc", "gc"])
@pytest.mark.parametrize("copy", [False, True], ids=["count", "copy"])
def test_offload_takes_the_saved_activations_and_changes_nothing(gc: bool, copy: bool) -> None:
    """The hooks take exactly the storages the planner counts as saved activations
    (weights stay put), and the loss and gradients are bit-identical. ``copy``: the
    bytes go through host copies and are rebuilt in backward, as on a GPU."""
    torch.set_num_threads(1)
    model = _model(gc, dropout=0.1)
    batch, n = _batch()
    forward = _plain(model, batch, n)
    loss, grads = _step(model, forward)
    torch.manual_seed(5)
    saved = saved_activation_bytes(model, forward)
    off = HostOffload(model, torch.device("cpu"), copy=copy)

    def offloaded() -> torch.Tensor:
        with off:
            out: torch.Tensor = forward()
        return out

    o_loss, o_grads = _step(model, offloaded)
    assert off.tensors > 0 and off.bytes == saved
    copies = [s.host for s in off._stored.values()]
    assert all(h is not None for h in copies) if copy else all(h is None for h in copies)
    assert torch.equal(o_loss, loss) and o_grads.keys() == grads.keys()
    assert all(torch.equal(o_grads[k], g) for k, g in grads.items())


def test_finetune_with_chunked_loss_and_offload_follows_the_plain_run(
    cli: CLI, tmp_path: Path, reference_run: Path
) -> None:
    """The FAST run (128 tokens per micro-batch, two chunks of 64) with both levers on:
    the loss curve and gradient norms of the plain run, to float-summation order."""
    out = tmp_path / "chunked"
    args = ["--train.loss_chunk_tokens", "64", "--train.offload_activations", "true"]
    r = cli.run(out, *FAST, *args)
    assert r.returncode == 0, r.stderr
    steps = [[e for e in read_events(d) if e["event"] == "step"] for d in (reference_run, out)]
    assert len(steps[0]) == len(steps[1]) == 12
    for ref, got in zip(*steps):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4), (ref["step"], ref, got)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3)
    cfg = (out / "config.yaml").read_text()
    assert "loss_chunk_tokens: 64" in cfg and "offload_activations: true" in cfg
