"""A checkpoint saved by compressed-tensors (the Hub's RedHatAI ``*-quantized.w4a16``,
``*-w8a16``, ``*-quantized.w8a8``, ``*-FP8-dynamic`` and ``*-FP8`` repos, llm-compressor's
output) streams as stored: the engine computes what transformers computes on the same
checkpoint (decompressed by the same library), in 4-bit groups symmetric and
asymmetric, 8-bit rows packed, and FP8 rows, and with inputs quantized per token or by
a static scale as the scheme says; a layer reads its packed bytes; an adapter merges
into the decompressed weights; a stopped generation resumes bit for bit; and what it
cannot stream is refused before any work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from shoestring.infer import ctensors
from shoestring.infer.adapter import LoraDelta
from shoestring.infer.decode import generate, prompt_logits
from shoestring.infer.engine import StreamingCausalLM, read_config_json
from shoestring.infer.fixtures import build_random_model, save_ctensors
from shoestring.infer.shards import index_model
from shoestring.infer.stored import stored_compute_dtype, stored_refs, stored_weights
from shoestring.infer.weights import weight_hook
from stored_checks import (
    check_adapter_merged,
    check_cli_answers,
    check_resumes_bit_for_bit,
    greedy,
    infer_one,
    prompts,
)

pytest.importorskip("compressed_tensors")

CPU = torch.device("cpu")
WEIGHT_ONLY = ["w4a16", "w4a16-asym", "w8a16", "fp8-weights", "nvfp4a16", "mxfp4a16"]
WITH_INPUTS = ["fp8-dynamic", "w8a8", "fp8-static", "fp8-block", "mxfp4", "nvfp4"]
STREAMED = [*WEIGHT_ONLY, *WITH_INPUTS]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_model(
        tmp_path_factory.mktemp("base"), "llama", seed=3, dtype=torch.bfloat16
    )


@pytest.fixture(scope="module")
def stored(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ct")
    return {s: save_ctensors(base, root / s, s) for s in STREAMED}


def reference(model_dir: Path, dtype: torch.dtype | None = None) -> Any:
    """transformers' model on the checkpoint: weight-only schemes decompressed by
    compressed-tensors at load (its default decompresses on the first forward, and
    cannot load an asymmetric save); schemes that quantize inputs too by its default
    load, whose quantized forward quantizes each input (``dequantize=True`` drops that)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    groups = read_config_json(model_dir)["quantization_config"]["config_groups"]
    inputs = any(g.get("input_activations") for g in groups.values())
    # (passing quantization_config=None would load the codes unscaled)
    q = {} if inputs else {"quantization_config": CompressedTensorsConfig(dequantize=True)}
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype or "auto", **q).eval()


def streaming(
    model_dir: Path, adapter: LoraDelta | None = None, dtype: torch.dtype | None = None
) -> StreamingCausalLM:
    """Our engine on the checkpoint (the tensors as the job indexes them), one unit resident."""
    doc = read_config_json(model_dir)
    refs = stored_refs(doc, index_model(model_dir))
    eng = StreamingCausalLM(
        model_dir, device=CPU, refs=refs, dtype=dtype or stored_compute_dtype(doc)
    )
    found = stored_weights(eng)
    assert isinstance(found, ctensors.StoredCt)
    hook, _ = weight_hook(eng, None, adapter, Path("/nonexistent"), "", found)
    return eng.start(resident=1, depth=1, prepare=hook)


@pytest.mark.parametrize("scheme", STREAMED)
def test_logits_and_greedy_tokens_equal_transformers_load(
    stored: dict[str, Path], scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bitwise equal prompt logits (the library's own decompressor on the same bytes),
    with weights rebuilt 16 rows at a time (every weight in several row blocks)."""
    monkeypatch.setattr(ctensors, "ROWS", 16)
    model = stored[scheme]
    ref = reference(model)
    ps = prompts(4)
    eng = streaming(model)
    try:
        logits = prompt_logits(eng, ps)
        out = generate(eng, ps, max_new_tokens=6, eos_ids=set(), pad_id=0, micro_tokens=20)
    finally:
        eng.close()
    with torch.no_grad():
        for p, lg, o in zip(ps, logits, out, strict=True):
            want = ref(torch.tensor([p])).logits[0]
            assert torch.equal(lg.to(want.dtype), want)
            assert o.tokens == greedy(ref, p, 6)


def test_quantized_inputs_change_what_the_same_weights_compute(stored: dict[str, Path]) -> None:
    """FP8-dynamic stores FP8-weights' very bytes; its per-token FP8 inputs are what
    make its logits differ (and equal transformers', above)."""
    weights = [
        {k: v for f in stored[s].glob("*.safetensors") for k, v in load_file(f).items()}
        for s in ("fp8-weights", "fp8-dynamic")
    ]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    logits = []
    for scheme in ("fp8-weights", "fp8-dynamic"):
        eng = streaming(stored[scheme])
        try:
            logits.append(prompt_logits(eng, prompts(2)))
        finally:
            eng.close()
    for a, b in zip(*logits, strict=True):
        assert not torch.equal(a, b)
        print(f"mean |difference| {(a - b).abs().mean():.3f} of mean |logit| {a.abs().mean():.3f}")


def library_save(base: Path, dest: Path, scheme: str) -> Path:
    """``base`` quantized as llm-compressor does it, the whole model in memory:
    ``apply_quantization_config``, each module's min-max qparams (and calibrated static
    input scale), ``compress_model``, ``save_pretrained`` and the config written by
    ``ModelCompressor``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationStatus, apply_quantization_config
    from transformers import AutoModelForCausalLM

    from shoestring.infer.fixtures import ct_config, input_qparams, min_max_qparams

    config = ct_config(scheme)
    config.quantization_status = QuantizationStatus.INITIALIZED
    inputs = config.config_groups["group_0"].input_activations
    static = (
        input_qparams(base, inputs) if inputs is not None and inputs.dynamic is not True else {}
    )
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.bfloat16)
    apply_quantization_config(model, config)
    with torch.no_grad():
        for key, module in model.named_modules():
            if getattr(module, "quantization_scheme", None) is not None:
                qparams = min_max_qparams(module.weight, module.quantization_scheme.weights)
                for name, value in {**qparams, **static.get(key, {})}.items():
                    getattr(module, name).copy_(value.reshape(getattr(module, name).shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(str(dest))
    compressor.update_config(str(dest))
    return dest


@pytest.mark.parametrize("scheme", STREAMED)
def test_the_tensor_at_a_time_writer_saves_what_the_library_pipeline_saves(
    stored: dict[str, Path], base: Path, tmp_path: Path, scheme: str
) -> None:
    """``fixtures.save_ctensors`` (what the real-size benchmark writes a 7B with) gives
    the tensors and quantization config of compressed-tensors' own in-memory pipeline."""
    want_dir = library_save(base, tmp_path / "lib", scheme)
    want = load_file(want_dir / "model.safetensors")
    got = {k: v for f in stored[scheme].glob("*.safetensors") for k, v in load_file(f).items()}
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    config = [
        json.loads((d / "config.json").read_text())["quantization_config"]
        for d in (want_dir, stored[scheme])
    ]
    assert config[0] == config[1]


def test_a_layer_reads_its_packed_parameters_and_holds_its_weights_decompressed(
    stored: dict[str, Path], base: Path
) -> None:
    model = stored["w4a16"]
    eng = StreamingCausalLM(
        model, device=CPU, refs=stored_refs(read_config_json(model), index_model(model)),
        dtype=torch.bfloat16,
    )  # fmt: skip
    found = stored_weights(eng)
    assert found is not None
    layer = next(i for i, u in enumerate(eng.units) if u.name == "layers.1")
    parts = [r for r in eng.units[layer].refs if "::" in r.key]
    assert {r.key.split("::")[1] for r in parts} == {"weight_packed", "weight_scale"}
    dense = StreamingCausalLM(base, device=CPU)
    dense_layer = sum(r.nbytes for r in dense.units[layer].refs)
    weights = sum(r.nbytes for r in dense.units[layer].refs if r.key.endswith("proj.weight"))
    read = sum(r.nbytes for r in eng.units[layer].refs)
    print(f"w4a16 layer: {read} bytes read vs {dense_layer} bf16")
    assert read < 0.32 * dense_layer  # 4 bits and a bf16 scale per 64 weights
    assert found.scratch(layer, torch.bfloat16) == weights


def test_shoestring_infer_writes_transformers_greedy_answers(
    stored: dict[str, Path], tmp_path: Path
) -> None:
    model = stored["w4a16-asym"]
    start = check_cli_answers(model, reference(model), tmp_path, ["alpha beta gamma", "delta"])
    assert start["dtype"] == "bfloat16"


def test_an_adapter_is_merged_into_the_decompressed_weights(
    stored: dict[str, Path], tmp_path: Path
) -> None:
    model = stored["w4a16"]

    def open_engine(model_dir: Path, adapter: LoraDelta | None = None) -> StreamingCausalLM:
        return streaming(model_dir, adapter, torch.float32)

    check_adapter_merged(open_engine, model, reference(model, torch.float32), tmp_path)


def test_a_stopped_generation_resumes_bit_for_bit(stored: dict[str, Path], tmp_path: Path) -> None:
    check_resumes_bit_for_bit(lambda m, a=None: streaming(m, a), stored["w8a16"], tmp_path)


def _with_config(src: Path, dest: Path, **changes: Any) -> Path:
    shutil.copytree(src, dest)
    doc = json.loads((dest / "config.json").read_text())
    doc["quantization_config"].update(changes)
    (dest / "config.json").write_text(json.dumps(doc))
    return dest


def _changed_inputs(model: Path, dest: Path, **changes: Any) -> Path:
    """``model`` with its group's input-activation args changed (None: a kv-cache scheme
    and output args made of them instead)."""
    group = json.loads((model / "config.json").read_text())["quantization_config"]
    group = group["config_groups"]["group_0"]
    group["input_activations"].update(changes)
    return _with_config(model, dest, config_groups={"group_0": group})


GROUP = "quantization_config.config_groups.group_0"
REFUSED: dict[str, tuple[str, str]] = {
    "inputs-per-tensor": ("a scale computed on the fly per tensor (", "fp8-dynamic"),
    "no-global-scale": ("has no model.layers.0.self_attn.q_proj.input_global_scale", "nvfp4"),
    "static-zero-points": (
        f"static zero points ({GROUP}.input_activations.symmetric",
        "fp8-static",
    ),
    "outputs": (f"quantizes module outputs ({GROUP}.output_activations)", "fp8-dynamic"),
    "kv-cache": ("quantizes its KV cache (quantization_config.kv_cache_scheme)", "fp8-static"),
    "no-input-scale": ("has no model.layers.0.self_attn.q_proj.input_scale", "fp8-static"),
    "compress": ("--compress (compress.scheme): ", "w4a16"),
    "sparse": ("is stored sparse (quantization_config.sparsity_config)", "w4a16"),
}


SCALES = ("input_scale", "input_global_scale")


def _refused_model(case: str, model: Path, dest: Path) -> Path:
    if case == "inputs-per-tensor":
        return _changed_inputs(model, dest, strategy="tensor")
    if case == "static-zero-points":
        return _changed_inputs(model, dest, symmetric=False)
    doc = json.loads((model / "config.json").read_text())["quantization_config"]
    args = doc["config_groups"]["group_0"]["input_activations"]
    if case == "outputs":
        groups = doc["config_groups"]
        groups["group_0"]["output_activations"] = args
        return _with_config(model, dest, config_groups=groups)
    if case == "kv-cache":
        return _with_config(model, dest, kv_cache_scheme=args)
    if case in ("no-input-scale", "no-global-scale"):
        shutil.copytree(model, dest)
        for shard in dest.glob("*.safetensors"):
            kept = {k: v for k, v in load_file(shard).items() if not k.endswith(SCALES)}
            save_file(kept, shard, metadata={"format": "pt"})
        return dest
    sparse = {"format": "sparse-24-bitmask", "targets": ["Linear"], "sparsity_structure": "2:4"}
    return _with_config(model, dest, sparsity_config=sparse) if case == "sparse" else model


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_cannot_stream_is_refused_before_any_work(
    stored: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    needle, scheme = REFUSED[case]
    model = _refused_model(case, stored[scheme], tmp_path / "m")
    extra = ["--compress", "int8"] if case == "compress" else []
    assert infer_one(model, tmp_path, *extra) == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert not (tmp_path / "out.jsonl.run").exists()
