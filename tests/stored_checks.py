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


def infer_one(model: Path, tmp_path: Path, *extra: str) -> int:
    """``shoestring infer`` on one prompt: its exit code (for refusals)."""
    from shoestring.cli import main

    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hello"}\n')
    out = tmp_path / "out.jsonl"
    return main(["infer", "--model", str(model), "--input", str(inp), "--output", str(out), *extra])


def check_cli_answers(model: Path, ref: Any, tmp_path: Path, texts: list[str]) -> dict[str, Any]:
    """``shoestring infer`` on ``model`` (nothing resident, one unit read ahead) writes
    ``ref``'s greedy answers; returns the job's start event."""
    import json

    from transformers import AutoTokenizer

    from shoestring.cli import main

    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    out = tmp_path / "out.jsonl"
    args = ["infer", "--model", str(model), "--input", str(inp), "--output", str(out)]
    args += ["--max-new-tokens", "6", "--threads", "1", "--job.progress", "off"]
    args += ["--memory.resident", "0", "--memory.prefetch_depth", "1"]
    assert main(args) == 0
    tok = AutoTokenizer.from_pretrained(str(model))
    got = [json.loads(line) for line in out.read_text().splitlines()]
    for t, line in zip(texts, got, strict=True):
        new = greedy(ref, tok(t)["input_ids"], 6)
        assert line["completion"] == tok.decode(new, skip_special_tokens=True)
    start: dict[str, Any] = json.loads(
        (Path(f"{out}.run") / "events.jsonl").read_text().splitlines()[0]
    )
    return start


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
