"""Checks shared by the tests of checkpoints stored quantized (bnb-4bit, FP8, MXFP4):
the same prompts, transformers' greedy answer, an adapter merged as peft computes it,
and a generation stopped between passes resumed from its saved state."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from shoestring.infer import partial
from shoestring.infer.adapter import LoraDelta
from shoestring.infer.decode import Rules, generate, generate_from, prompt_logits, start
from shoestring.infer.engine import StreamingCausalLM

Open = Callable[..., StreamingCausalLM]  # (model_dir, adapter=None) -> a started engine


def prompts(n: int = 6, seed: int = 0, longest: int = 14) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, longest, (n,), generator=g).tolist()
    return [torch.randint(0, 256, (k,), generator=g).tolist() for k in lens]


def greedy(ref: Any, p: list[int], new: int) -> list[int]:
    """transformers' greedy answer to ``p`` (stopping at the model's EOS)."""
    want = ref.generate(
        torch.tensor([p]),
        attention_mask=torch.ones(1, len(p), dtype=torch.long),
        max_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
    )
    return list(want[0, len(p) :].tolist())


def check_adapter_merged(open_engine: Open, model: Path, base: Any, tmp_path: Path) -> None:
    """A random LoRA on every linear layer of ``base`` (transformers' model of ``model``)
    merged by the engine as it streams: peft's greedy tokens, and logits within fp32
    rounding of peft's separate product and far from the base's."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    ref = get_peft_model(base, lora).eval()  # what finetune's final/ holds
    ref.save_pretrained(str(tmp_path / "adapter"))
    ps = prompts(4, seed=1)
    eng = open_engine(model, LoraDelta(tmp_path / "adapter"))
    try:
        eos = {ref.generation_config.eos_token_id}  # transformers stops there too
        out = generate(eng, ps, max_new_tokens=8, eos_ids=eos, pad_id=0, micro_tokens=20)
        logits = prompt_logits(eng, ps)
    finally:
        eng.close()
    for p, o, lg in zip(ps, out, logits, strict=True):
        assert o.tokens == greedy(ref, p, 8)
        with torch.no_grad():
            want = ref(torch.tensor([p])).logits[0].float()
            with ref.disable_adapter():
                base_logits = ref(torch.tensor([p])).logits[0].float()
        # Merged (W + s·B·A) against peft's separate product: fp32 rounding apart, and
        # far from the base without the adapter.
        print(f"adapter: {(lg - want).abs().max().item() / want.abs().max().item():.2g}")
        assert (lg - want).abs().max().item() <= 1e-4 * want.abs().max().item()
        assert (lg - base_logits).abs().max().item() > 100 * (lg - want).abs().max().item()


class _Stop(Exception):
    pass


def check_resumes_bit_for_bit(open_engine: Open, model: Path, tmp_path: Path) -> None:
    """A generation stopped after its 3rd pass, saved, and continued by a new engine
    gives the tokens of one uninterrupted run."""
    ps = prompts(5, seed=2)
    kw: dict[str, Any] = dict(rules=Rules.uniform(len(ps), 6, set()), pad_id=0)
    eng = open_engine(model)
    try:
        first = start(eng, ps, pad_id=0, micro_tokens=24)
        want = [g.tokens for g in generate_from(eng, first, **kw)]
        state = start(eng, ps, pad_id=0, micro_tokens=24)

        def on_pass() -> None:
            if state.step == 3:
                raise _Stop

        with pytest.raises(_Stop):
            generate_from(eng, state, on_pass=on_pass, **kw)
        path, _ = partial.save(tmp_path / "partial", 3, state, {"chunk": 0})
    finally:
        eng.close()
    eng = open_engine(model)  # a new process, as far as the engine is concerned
    try:
        got = [g.tokens for g in generate_from(eng, partial.load(path, eng, len(ps)), **kw)]
    finally:
        eng.close()
    assert got == want
