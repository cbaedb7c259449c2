"""A gpt-oss checkpoint whose experts are stored MXFP4 (as openai/gpt-oss-* are) streams
as stored: the engine computes what transformers computes on the same checkpoint (its
MXFP4 loader dequantizes without Triton kernels), a decoder layer reads about a quarter
of its experts' 16-bit bytes, the experts are dequantized one at a time (the plan's
transient is one expert's, not the layer's), and ``--compress`` on top is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from shoestring.cli import main
from shoestring.infer.decode import generate, prompt_logits
from shoestring.infer.engine import StreamingCausalLM
from shoestring.infer.fixtures import build_random_model, save_mxfp4
from shoestring.infer.weights import weight_hook, weight_needs
from stored_checks import check_cli_answers, greedy, prompts

CPU = torch.device("cpu")
GPT_OSS = dict(
    num_local_experts=4,
    num_experts_per_tok=2,
    head_dim=32,
    sliding_window=8,  # prompts longer than the window: sliding and full layers differ
    context=131072,  # gpt-oss's: its YaRN rope is configured for it (else transformers warns)
    layer_types=["sliding_attention", "full_attention"] * 2,
)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpt-oss")
    base = build_random_model(root / "bf16", "gpt_oss", seed=3, dtype=torch.bfloat16, **GPT_OSS)  # type: ignore[arg-type]
    return {"bf16": base, "mxfp4": save_mxfp4(base, root / "mxfp4")}


def reference(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()


def test_greedy_tokens_and_logits_equal_transformers_mxfp4_load(models: dict[str, Path]) -> None:
    ref, ps = reference(models["mxfp4"]), prompts(5, longest=20)
    eng = StreamingCausalLM(models["mxfp4"], device=CPU).start(resident=1, depth=1)
    try:
        assert eng.dtype == torch.bfloat16
        eos = {ref.generation_config.eos_token_id}  # transformers stops there too
        out = generate(eng, ps, max_new_tokens=8, eos_ids=eos, pad_id=0, micro_tokens=40)
        logits = prompt_logits(eng, ps)
        experts = {k for k, f in eng.units[1].fused.items() if f.mxfp4}
    finally:
        eng.close()
    assert {k.rsplit(".", 1)[-1] for k in experts} == {"gate_up_proj", "down_proj"}
    for p, o, lg in zip(ps, out, logits, strict=True):
        assert o.tokens == greedy(ref, p, 8)
        with torch.no_grad():
            # The same dequantizer on the same bytes, an expert at a time: bitwise.
            assert torch.equal(lg, ref(torch.tensor([p])).logits[0].float())


def test_the_plan_reads_the_packed_experts_and_holds_one_expert_in_temporaries(
    models: dict[str, Path],
) -> None:
    eng = StreamingCausalLM(models["mxfp4"], device=CPU)
    plain = StreamingCausalLM(models["bf16"], device=CPU)
    needs = weight_needs(eng, None, None)
    layer, bf16_layer = eng.units[1], plain.units[1]
    expert_bytes = {r.key: r.nbytes for r in bf16_layer.refs if ".mlp.experts." in r.key}
    packed = sum(r.nbytes for r in layer.refs if r.key.endswith(("_blocks", "_scales")))
    # 4.25 bits a weight (a uint8 scale per 32) instead of 16.
    assert packed == pytest.approx(
        sum(v for k, v in expert_bytes.items() if "bias" not in k) * 17 / 64
    )
    fused = eng.fuse_bytes(1)
    params = {k: getattr(m, n) for k, (m, n) in layer.params.items() if k in layer.fused}
    assert fused[0] == sum(2 * p.numel() for p in params.values())  # dequantized to bf16
    # Decoding takes a block of one expert's rows at a time: less than one copy of the
    # layer's largest parameter (transformers' whole-layer dequantizer takes about three).
    largest = max(params.values(), key=lambda p: p.numel())
    assert 0 < fused[1] < 2 * largest.numel()
    assert needs.read[1] == layer.plan.nbytes and needs.extra[1] >= fused[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_the_expert_decoder_gives_transformers_values_for_every_code_and_exponent(
    dtype: torch.dtype,
) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from shoestring.infer.mxfp4 import ROWS, dequantize_expert, pair_table

    g = torch.Generator().manual_seed(0)
    rows, groups = ROWS + 64, 3  # two row blocks, the second partial
    blocks = torch.randint(0, 256, (1, rows, groups, 16), generator=g, dtype=torch.uint8)
    blocks[0, :16, 0] = torch.arange(256, dtype=torch.uint8).view(16, 16)  # every byte
    scales = torch.randint(0, 256, (1, rows, groups), generator=g, dtype=torch.uint8)
    scales[0, :256, 1] = torch.arange(256, dtype=torch.uint8)  # every exponent
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)[0]
    got = torch.empty(groups * 32, rows, dtype=dtype)
    dequantize_expert(blocks[0], scales[0], got, pair_table(dtype))
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_shoestring_infer_on_a_gpt_oss_mxfp4_checkpoint_writes_transformers_answers(
    models: dict[str, Path], tmp_path: Path
) -> None:
    model = models["mxfp4"]
    start_ev = check_cli_answers(
        model,
        reference(model),
        tmp_path,
        ["alpha beta gamma delta eps", "gamma", "delta eps alpha beta beta gamma"],
    )
    assert start_ev["dtype"] == "bfloat16"


def test_compress_on_an_mxfp4_checkpoint_is_refused_before_any_work(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hello"}\n')
    out = tmp_path / "out.jsonl"
    args = ["infer", "--model", str(models["mxfp4"]), "--input", str(inp), "--output", str(out)]
    assert main([*args, "--compress", "nf4"]) == 2
    err = capsys.readouterr().err
    assert "--compress (compress.scheme): " in err and "MXFP4" in err, err
    assert not (tmp_path / "out.jsonl.run").exists()


def test_peak_rss_stays_within_the_least_budget_the_plan_accepts(tmp_path: Path) -> None:
    """A ring slot's raw buffer holds the largest streamed unit (here the embedding of a
    64k vocabulary) and keeps the decoder layers' dequantized experts as scratch while
    the embedding passes through it: the plan counts both per slot (it once counted the
    larger of the two units, and gpt-oss-20b ran 0.94 GB over its budget)."""
    from test_infer_budget import OVER_BUDGET, TOO_SMALL, _least_from_refusal, _run

    # The embedding (134 MB) about as large as a layer's packed experts and their
    # dequantized copy together (26 + 101 MB): counting the larger unit misses ~100 MB
    # a slot.
    base = build_random_model(
        tmp_path / "bf16", "gpt_oss", seed=1, dtype=torch.bfloat16, hidden=1024, ffn=1024,
        heads=16, kv_heads=2, layers=2, vocab=65536, shard="200MB",
        **{**GPT_OSS, "num_local_experts": 16, "layer_types": ["full_attention"] * 2},
    )  # fmt: skip
    model = save_mxfp4(base, tmp_path / "mxfp4")
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt": "ab " * (2 + i)}) + "\n" for i in range(4)))
    pinned = ("--memory.resident", "0", "--memory.prefetch_depth", "1")
    refused = _run(model, inp, tmp_path / "r.jsonl", TOO_SMALL, *pinned)
    assert refused.rc == 2 and "is too small for this model" in refused.err, refused.err[-2000:]
    budget = int(_least_from_refusal(refused.err) * 1.02)
    ran = _run(model, inp, tmp_path / "o.jsonl", budget, *pinned)
    assert ran.rc == 0, ran.err[-2000:]
    print(f"peak_rss gpt-oss mxfp4: {ran.peak / 1e6:.1f} MB of {budget / 1e6:.1f} MB")
    assert ran.peak <= budget and OVER_BUDGET not in ran.err


def _open_engine(tmp_path: Path, dtype: torch.dtype | None = None) -> Any:
    """How ``infer`` opens the engine with an adapter (fitted, then its merge hook)."""

    def open_engine(model_dir: Path, adapter: Any = None) -> StreamingCausalLM:
        from shoestring.infer.prepare import _fit_adapter

        eng = StreamingCausalLM(model_dir, device=CPU, dtype=dtype)
        if adapter is not None:
            _fit_adapter(adapter, eng, model_dir)
        hook = weight_hook(eng, None, adapter, tmp_path / "unused", "")[0]
        return eng.start(resident=1, depth=1, prepare=hook)

    return open_engine


def test_an_attention_adapter_is_merged_as_peft_computes_it(tmp_path: Path) -> None:
    """LoRA on gpt-oss's attention (peft's ``all-linear``) merges into the streamed
    attention of the MXFP4 checkpoint as peft computes it (fp32)."""
    from stored_checks import check_adapter_merged

    base = build_random_model(tmp_path / "fp32", "gpt_oss", seed=5, **GPT_OSS)  # type: ignore[arg-type]
    model = save_mxfp4(base, tmp_path / "mxfp4")
    open_engine = _open_engine(tmp_path, torch.float32)
    check_adapter_merged(open_engine, model, reference(model), tmp_path / "attn")


def test_an_expert_adapter_merges_into_each_decoded_expert_as_peft_merges_it(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """gpt-oss with a random LoRA on both fused expert parameters (as OpenAI's
    fine-tuning recipe targets them), stored MXFP4: each expert gets its delta as it is
    decoded, every layer's experts bitwise those of peft's merge into transformers'
    dequantized load (bf16); ``infer --adapter`` answers as that merged model (and not
    as the base)."""
    from peft import LoraConfig, get_peft_model

    from shoestring.infer.adapter import LoraDelta
    from test_moe import _streams_as

    torch.manual_seed(0)
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=[],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        init_lora_weights=False,
    )
    peft_model = get_peft_model(reference(models["mxfp4"]), lora)
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    merged = peft_model.merge_and_unload().eval()
    want = dict(merged.named_parameters())
    eng = _open_engine(tmp_path)(models["mxfp4"], LoraDelta(tmp_path / "adapter"))
    try:
        assert eng.streamer is not None
        for i, unit in enumerate(eng.units):
            got = eng.streamer.acquire(i)
            for key in unit.fused:
                assert torch.equal(got[key], want[key].detach()), key
            eng.streamer.release(i)
    finally:
        eng.close()
    _streams_as(models["mxfp4"], tmp_path / "adapter", merged, tmp_path)
