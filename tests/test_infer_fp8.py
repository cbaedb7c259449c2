"""A checkpoint stored in FP8 with block scales (DeepSeek-V3, the Hub's ``*-FP8``
repos) streams as stored: the engine computes what transformers computes on the same
checkpoint (its FP8 loader dequantizes without an FP8 GPU), dense and MoE; a decoder
layer reads about half the bytes of its 16-bit original; an adapter merges into the
dequantized weights; a stopped generation resumes bit for bit; and what cannot be
streamed is refused before any work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from shoestring.infer.adapter import LoraDelta
from shoestring.infer.decode import generate, prompt_logits
from shoestring.infer.engine import StreamingCausalLM
from shoestring.infer.fixtures import build_random_model, save_fp8
from shoestring.infer.fp8 import StoredFp8
from shoestring.infer.weights import weight_hook
from stored_checks import (
    check_adapter_merged,
    check_cli_answers,
    check_resumes_bit_for_bit,
    greedy,
    infer_one,
    prompts,
)

CPU = torch.device("cpu")
BLOCK = (64, 64)  # the Hub's are 128 x 128; 64 divides every weight of these models
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    bf16 = dict(seed=3, dtype=torch.bfloat16)
    return {
        "llama": build_random_model(root / "llama", "llama", **bf16),  # type: ignore[arg-type]
        "qwen3_moe": build_random_model(root / "moe", "qwen3_moe", **bf16, **MOE),  # type: ignore[arg-type]
        "fp32": build_random_model(root / "fp32", "llama", seed=4),
    }


@pytest.fixture(scope="module")
def stored(bases: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8")
    out = {name: save_fp8(base, root / name, BLOCK) for name, base in bases.items()}
    bf16_scales = save_fp8(bases["llama"], root / "bf16-scales", BLOCK, torch.bfloat16)
    return {**out, "llama-bf16-scales": bf16_scales}


def reference(model_dir: Path, dtype: torch.dtype | None = None) -> Any:
    """transformers' model on the checkpoint (on CPU its FP8 loader dequantizes)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype or "auto").eval()


def streaming(
    model_dir: Path, adapter: LoraDelta | None = None, dtype: torch.dtype | None = None
) -> StreamingCausalLM:
    """Our engine on the checkpoint (in its compute dtype by default), one unit resident."""
    eng = StreamingCausalLM(model_dir, device=CPU, dtype=dtype or reference_dtype(model_dir))
    found = StoredFp8.of(eng)
    assert found is not None
    hook, _ = weight_hook(eng, None, adapter, Path("/nonexistent"), "", found)
    return eng.start(resident=1, depth=1, prepare=hook)


def reference_dtype(model_dir: Path) -> torch.dtype:
    from shoestring.infer.engine import read_config_json
    from shoestring.infer.stored import stored_compute_dtype

    dtype = stored_compute_dtype(read_config_json(model_dir))
    assert dtype is not None
    return dtype


@pytest.mark.parametrize(
    ("arch", "dtype"),
    [
        ("llama", torch.bfloat16),  # the config's dtype, through transformers' dequantizer
        ("qwen3_moe", torch.bfloat16),
        ("llama", torch.float32),  # float32 compute: the codes scaled in place
        ("llama-bf16-scales", torch.float32),
    ],
)
def test_greedy_tokens_and_logits_equal_transformers_fp8_load(
    stored: dict[str, Path], bases: dict[str, Path], arch: str, dtype: torch.dtype
) -> None:
    ref, ps = reference(stored[arch], dtype), prompts(5)
    assert reference_dtype(stored[arch]) == torch.bfloat16  # the config's dtype
    eng = streaming(stored[arch], dtype=dtype)
    try:
        eos = {ref.generation_config.eos_token_id}  # transformers stops there too
        out = generate(eng, ps, max_new_tokens=8, eos_ids=eos, pad_id=0, micro_tokens=20)
        logits = prompt_logits(eng, ps)
        layer_bytes = eng.units[1].plan.nbytes
    finally:
        eng.close()
    for p, o, lg in zip(ps, out, logits, strict=True):
        assert o.tokens == greedy(ref, p, 8)
        with torch.no_grad():
            # The same dequantizer on the same bytes: bitwise equal logits.
            assert torch.equal(lg, ref(torch.tensor([p])).logits[0].float())
    # A decoder layer streams its FP8 codes and scales: about half of its bf16 bytes.
    plain = StreamingCausalLM(bases[arch.split("-")[0]], device=CPU).units[1].plan.nbytes
    assert layer_bytes < 0.6 * plain


def test_the_plan_counts_codes_read_and_dequantized_scratch(stored: dict[str, Path]) -> None:
    eng = StreamingCausalLM(stored["llama"], device=CPU, dtype=torch.bfloat16)
    found = StoredFp8.of(eng)
    assert found is not None
    _, needs = weight_hook(eng, None, None, Path("/nonexistent"), "", found)
    layer = eng.units[1]
    assert needs.read[1] == layer.plan.nbytes
    parts = {r.key.rsplit("::", 1)[-1]: r.dtype for r in layer.refs if "::" in r.key}
    assert parts == {"f8": torch.float8_e4m3fn, "scale_inv": torch.float32}
    linears = sum(
        getattr(m, n).numel() for k, (m, n) in layer.params.items() if k.endswith("proj.weight")
    )
    assert needs.extra[1] == 2 * linears  # every FP8 weight dequantized to bf16
    assert needs.prepare[1] > 0
    assert needs.extra[0] == 0 and needs.read[0] == eng.units[0].plan.nbytes  # embed as is


def test_shoestring_infer_on_an_fp8_base_writes_transformers_greedy_answers(
    stored: dict[str, Path], tmp_path: Path
) -> None:
    model = stored["qwen3_moe"]
    start_ev = check_cli_answers(
        model,
        reference(model),
        tmp_path,
        ["alpha beta", "gamma", "delta eps alpha", "beta beta gamma delta"],
    )
    assert start_ev["dtype"] == "bfloat16"


def test_an_adapter_is_merged_into_the_dequantized_weights(
    stored: dict[str, Path], tmp_path: Path
) -> None:
    model = stored["fp32"]
    check_adapter_merged(streaming, model, reference(model), tmp_path)


def test_a_stopped_generation_on_an_fp8_base_resumes_bit_for_bit(
    stored: dict[str, Path], tmp_path: Path
) -> None:
    check_resumes_bit_for_bit(streaming, stored["qwen3_moe"], tmp_path)


def _copy(src: Path, dest: Path, quant: dict[str, Any] | None = None) -> Path:
    shutil.copytree(src, dest)
    if quant is not None:
        cfg = json.loads((dest / "config.json").read_text())
        cfg["quantization_config"] = quant
        (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def _edit_tensors(model: Path, edit: Any) -> None:
    for shard in model.glob("*.safetensors"):
        tensors = load_file(shard)
        edit(tensors)
        save_file(tensors, shard, metadata={"format": "pt"})
    index = model / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    names = {k for s in model.glob("*.safetensors") for k in load_file(s)}
    doc["weight_map"] = {k: v for k, v in doc["weight_map"].items() if k in names}
    index.write_text(json.dumps(doc))


SCALE = "model.layers.1.self_attn.o_proj.weight_scale_inv"


def _drop_scale(t: dict[str, torch.Tensor]) -> None:
    t.pop(SCALE, None)


def _odd_grid(t: dict[str, torch.Tensor]) -> None:
    if SCALE in t:
        t[SCALE] = torch.ones(3, 2)


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("compress", "--compress (compress.scheme): "),
        ("gptq", "is stored quantized by gptq (quantization_config.quant_method)"),
        ("plain-weights", "says FP8 (quantization_config.quant_method) but no weight"),
        ("no-scale", "model.layers.1.self_attn.o_proj.weight is stored in torch.float8_e4m3fn"),
        ("odd-grid", "the (3, 2) block scales of model.layers.1.self_attn.o_proj.weight"),
    ],
)
def test_what_cannot_stream_is_refused_before_any_work(
    stored: dict[str, Path],
    bases: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    case: str,
    needle: str,
) -> None:
    extra: list[str] = []
    model = stored["llama"]
    if case == "compress":
        extra = ["--compress", "int8"]
    elif case == "gptq":
        model = _copy(bases["llama"], tmp_path / "m", {"quant_method": "gptq", "bits": 4})
    elif case == "plain-weights":  # config.json says FP8, the weights are the 16-bit ones
        model = _copy(bases["llama"], tmp_path / "m", {"quant_method": "fp8"})
    else:
        model = _copy(stored["llama"], tmp_path / "m")
        _edit_tensors(model, _drop_scale if case == "no-scale" else _odd_grid)
    assert infer_one(model, tmp_path, *extra) == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert not (tmp_path / "out.jsonl.run").exists()
