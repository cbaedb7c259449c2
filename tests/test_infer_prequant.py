"""A checkpoint saved 4-bit by bitsandbytes (``*-bnb-4bit``) streams as stored: the
engine computes what transformers computes on the same checkpoint loaded with its bnb
quantization (nf4 with double quantization, fp4 without), an adapter trained on it
composes, a stopped generation resumes bit for bit, the plan counts the packed bytes
and the dequantized scratch, and what cannot be streamed is refused before any work."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from shoestring.infer.adapter import LoraDelta
from shoestring.infer.decode import generate, prompt_logits
from shoestring.infer.engine import StreamingCausalLM, read_config_json
from shoestring.infer.fixtures import build_random_model
from shoestring.infer.prequant import Stored4bit
from shoestring.infer.stored import stored_compute_dtype
from shoestring.infer.stream import Prepare
from shoestring.infer.weights import weight_hook
from stored_checks import (
    check_adapter_merged,
    check_cli_answers,
    check_resumes_bit_for_bit,
    greedy,
    infer_one,
    prompts,
)

pytest.importorskip("bitsandbytes")

CPU = torch.device("cpu")
VARIANTS = {"nf4-double": ("nf4", True), "fp4": ("fp4", False)}
#: Largest |logit| difference from transformers seen on this model (fp32), 2026-12-06:
#: 0 (bitwise) for every prompt and variant; the bound leaves room for other kernels.
TOLERANCE = 1e-5


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def save_4bit(
    base: Path, dest: Path, quant_type: str, double: bool, dtype: torch.dtype = torch.float32
) -> Path:
    """``base`` loaded with bitsandbytes' 4-bit quantization (``dtype`` for compute and
    for the tensors it leaves 16-bit) and saved: what the Hub's ``*-bnb-4bit`` repos
    hold, with the tokenizer beside it."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_use_double_quant=double,
        bnb_4bit_compute_dtype=dtype,
    )
    model = AutoModelForCausalLM.from_pretrained(str(base), quantization_config=q, dtype=dtype)
    model.save_pretrained(str(dest))
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, dest / f.name)
    return dest


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("base"), "llama", seed=3)


@pytest.fixture(scope="module")
def stored(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bnb")
    return {name: save_4bit(base, root / name, *v) for name, v in VARIANTS.items()}


def reference(model_dir: Path, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' model on the checkpoint, with its bnb 4-bit linears. Its AVX512-BF16
    CPU path (repacking the weights with bf16 block scales on the first eval forward)
    is turned off: it computes another model than the one stored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    return model


def streaming(model_dir: Path, adapter: LoraDelta | None = None) -> StreamingCausalLM:
    """Our engine on the checkpoint, one unit resident, reading one ahead."""
    eng = StreamingCausalLM(model_dir, device=CPU, dtype=torch.float32)
    hook, _ = hook_and_needs(eng, adapter)
    return eng.start(resident=1, depth=1, prepare=hook)


def hook_and_needs(eng: StreamingCausalLM, adapter: LoraDelta | None = None) -> Any:
    found = Stored4bit.of(eng)
    assert found is not None
    hook: Prepare | None
    hook, needs = weight_hook(eng, None, adapter, Path("/nonexistent"), "", found)
    return hook, needs


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_and_logits_match_transformers_bnb(
    stored: dict[str, Path], base: Path, variant: str
) -> None:
    ref, ps = reference(stored[variant]), prompts()
    eng = streaming(stored[variant])
    try:
        out = generate(eng, ps, max_new_tokens=10, eos_ids=set(), pad_id=0, micro_tokens=20)
        logits = prompt_logits(eng, ps)
        layer_bytes = eng.units[1].plan.nbytes
    finally:
        eng.close()
    worst = 0.0
    for p, o, lg in zip(ps, out, logits, strict=True):
        assert o.tokens == greedy(ref, p, 10)
        with torch.no_grad():
            worst = max(worst, (lg - ref(torch.tensor([p])).logits[0].float()).abs().max().item())
    print(f"{variant}: max |logit difference| {worst:.3g}")  # pytest -s: the TOLERANCE note
    assert worst <= TOLERANCE
    # A decoder layer streams its packed parts: ~4.5 bits a weight instead of 32.
    plain = StreamingCausalLM(base, device=CPU).units[1].plan.nbytes
    assert layer_bytes < plain / 5


def test_a_bf16_bnb_base_computes_in_its_compute_dtype_as_transformers_does(
    base: Path, tmp_path: Path
) -> None:
    """The unsloth shape: 16-bit tensors and compute in bf16. The job's compute dtype
    (``--dtype auto``) is the config's ``bnb_4bit_compute_dtype``, and prompt logits, one
    sequence per micro-batch as transformers computes them, are bitwise equal."""
    model = save_4bit(base, tmp_path / "bf16", "nf4", True, torch.bfloat16)
    dtype = stored_compute_dtype(read_config_json(model))
    assert dtype == torch.bfloat16
    ref, ps = reference(model, torch.bfloat16), prompts(4, seed=4)
    eng = StreamingCausalLM(model, device=CPU, dtype=dtype)
    eng.start(resident=0, depth=1, prepare=hook_and_needs(eng)[0])
    try:
        logits = prompt_logits(eng, ps)
    finally:
        eng.close()
    for p, lg in zip(ps, logits, strict=True):
        with torch.no_grad():
            assert torch.equal(lg, ref(torch.tensor([p])).logits[0].float())


def test_shoestring_infer_on_a_bnb_base_writes_transformers_greedy_answers(
    stored: dict[str, Path], tmp_path: Path
) -> None:
    model = stored["nf4-double"]
    start_ev = check_cli_answers(
        model,
        reference(model),
        tmp_path,
        ["alpha beta", "gamma", "delta eps alpha", "beta beta gamma delta"],
    )
    assert start_ev["dtype"] == "float32" and start_ev["plan"]["resident"] == []


def test_the_plan_counts_packed_bytes_read_and_dequantized_scratch(
    stored: dict[str, Path],
) -> None:
    eng = StreamingCausalLM(stored["nf4-double"], device=CPU, dtype=torch.float32)
    _, needs = hook_and_needs(eng)
    layer = eng.units[1]
    assert needs.read[1] == layer.plan.nbytes  # the parts as streamed
    assert {r.key.rsplit("::", 1)[-1] for r in layer.refs if "::" in r.key} == {
        "q4",
        "absmax",
        "quant_map",
        "nested_absmax",
        "nested_quant_map",
    }
    linears = sum(
        getattr(m, n).numel() for k, (m, n) in layer.params.items() if k.endswith("proj.weight")
    )
    assert needs.extra[1] == 4 * linears  # every 4-bit weight dequantized to fp32
    assert 0 < needs.prepare[1] < needs.extra[1]  # one row block at a time
    assert needs.extra[0] == 0 and needs.read[0] == eng.units[0].plan.nbytes  # embed as is


def test_an_adapter_trained_on_the_bnb_base_is_merged_into_its_dequantized_weights(
    stored: dict[str, Path], tmp_path: Path
) -> None:
    model = stored["nf4-double"]
    check_adapter_merged(streaming, model, reference(model), tmp_path)


def test_a_stopped_generation_on_a_bnb_base_resumes_bit_for_bit(
    stored: dict[str, Path], tmp_path: Path
) -> None:
    check_resumes_bit_for_bit(streaming, stored["fp4"], tmp_path)


def _with_config(src: Path, dest: Path, **quant: Any) -> Path:
    shutil.copytree(src, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", **quant}
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("8bit", "stored 8-bit by bitsandbytes (LLM.int8); infer streams 4-bit"),
        ("compress", "--compress (compress.scheme): "),
        ("storage", "packs its 4-bit weights as bfloat16"),
        ("plain-weights", "no weight has a .quant_state.bitsandbytes__nf4|fp4 part"),
    ],
)
def test_what_cannot_stream_is_refused_before_any_work(
    stored: dict[str, Path],
    base: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    case: str,
    needle: str,
) -> None:
    extra: list[str] = []
    model = stored["nf4-double"]
    if case == "8bit":
        model = _with_config(base, tmp_path / "m", load_in_8bit=True)
    elif case == "compress":
        extra = ["--compress", "nf4"]
    elif case == "storage":
        q = {"load_in_4bit": True, "bnb_4bit_quant_storage": "bfloat16"}
        model = _with_config(base, tmp_path / "m", **q)
    else:  # config.json says 4-bit, the weights are the 16-bit ones
        model = _with_config(base, tmp_path / "m", load_in_4bit=True)
    assert infer_one(model, tmp_path, *extra) == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert not (tmp_path / "out.jsonl.run").exists()


@pytest.mark.slow  # three processes (~25 s on 2 cores); the engine-level resume is in CI
@pytest.mark.e2e
def test_a_job_on_a_bnb_base_stopped_inside_a_pass_resumes_byte_identically(
    stored: dict[str, Path], tmp_path: Path
) -> None:
    model = stored["nf4-double"]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt": "ab " * (1 + i % 3)}) + "\n" for i in range(6)))

    def run(out: Path, faults: str = "") -> int:
        args = [sys.executable, "-m", "shoestring", "infer", "--model", str(model)]
        args += ["--input", str(inp), "--output", str(out), "--max-new-tokens", "6"]
        args += ["--batch-size", "3", "--threads", "1", "--job.progress", "off"]
        args += ["--memory.resident", "0"]
        env = {**os.environ, "SHOESTRING_FAULTS": faults}
        return subprocess.run(args, env=env, stderr=subprocess.DEVNULL).returncode

    assert run(tmp_path / "ref.jsonl") == 0
    out = tmp_path / "out.jsonl"
    # 4 layers: the stop check runs before units 1-5 of each pass; hit 23 is before the
    # 2nd layer of pass 5: chunk 0 stops mid-pass with 4 whole passes saved.
    assert run(out, "pass.unit@23:term") == 75
    events = [json.loads(x) for x in (Path(f"{out}.run") / "events.jsonl").read_text().splitlines()]
    assert [(e["chunk"], e["passes"]) for e in events if e["event"] == "partial_saved"] == [(0, 4)]
    assert run(out) == 0
    assert out.read_bytes() == (tmp_path / "ref.jsonl").read_bytes()
