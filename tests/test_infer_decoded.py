"""``--decode-once`` (``compress.decode_once``): the decoder layers are written once as
the job computes with them, then streamed from that copy. Whatever had to be rebuilt
per pass (FP8 and bitsandbytes 4-bit weights dequantized, MXFP4 experts decoded and
fused, per-expert tensors fused, fp32 cast to bf16), the outputs are the ones of
streaming as stored, byte for byte; the copy holds what the plan predicted, is
committed (an interrupted write leaves none) and kept for a rerun; where it would only
cost, it is refused before any work."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from shoestring.cli import main
from shoestring.config import ConfigError
from shoestring.infer import decoded
from shoestring.infer.fixtures import build_random_model, save_ctensors, save_fp8, save_mxfp4
from shoestring.infer.layercopy import check_room
from shoestring.infer.shards import read_header

MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
BF16 = dict(dtype=torch.bfloat16)
#: Each model, and what its layers need per pass without the copy.
KINDS = {
    "fp8": "FP8 weights dequantized (bf16)",
    "fp8-moe": "FP8 experts dequantized, then fused",
    "mxfp4": "MXFP4 experts decoded into the fused parameters",
    "bnb": "bitsandbytes nf4 (double quant) dequantized (fp32)",
    "w4a16": "compressed-tensors int4 groups decompressed (bf16)",
    "fp8-static": "compressed-tensors FP8 decompressed, static input scales copied",
    "nvfp4": "compressed-tensors NVFP4 decompressed, float32 input global scales kept",
    "fp32-as-bf16": "fp32 cast to bf16",
    "moe-bf16": "per-expert tensors fused",
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from test_infer_mxfp4 import GPT_OSS
    from test_infer_prequant import save_4bit

    root = tmp_path_factory.mktemp("decoded")
    llama = build_random_model(root / "llama", "llama", seed=3, **BF16)  # type: ignore[arg-type]
    moe = build_random_model(root / "moe", "qwen3_moe", seed=3, **BF16, **MOE)  # type: ignore[arg-type]
    oss = build_random_model(root / "oss", "gpt_oss", seed=3, **BF16, **GPT_OSS)  # type: ignore[arg-type]
    fp32 = build_random_model(root / "fp32", "llama", seed=4)
    return {
        "fp8": save_fp8(llama, root / "fp8", (64, 64)),
        "fp8-moe": save_fp8(moe, root / "fp8-moe", (64, 64)),
        "mxfp4": save_mxfp4(oss, root / "mxfp4"),
        "bnb": save_4bit(fp32, root / "bnb", "nf4", True),
        "w4a16": save_ctensors(llama, root / "w4a16", "w4a16"),
        "fp8-static": save_ctensors(llama, root / "fp8-static", "fp8-static"),
        "nvfp4": save_ctensors(llama, root / "nvfp4", "nvfp4"),
        "fp32-as-bf16": fp32,
        "moe-bf16": moe,
        "llama-bf16": llama,
    }


def _infer(model: Path, out: Path, *extra: str, lines: list[dict[str, Any]] | None = None) -> int:
    inp = out.with_suffix(".in.jsonl")
    lines = lines or [
        {"prompt": "alpha beta gamma", "completion": " delta eps"},
        {"prompt": "gamma", "completion": " alpha alpha beta"},
        {"prompt": "delta eps alpha beta beta gamma", "completion": " gamma"},
    ]
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    args = ["infer", "--model", str(model), "--input", str(inp), "--output", str(out)]
    args += ["--threads", "1", "--job.progress", "off", "--memory.resident", "0"]
    return main([*args, *extra])


def _events(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (Path(f"{out}.run") / "events.jsonl").read_text().splitlines()]


def _copy_dir(out: Path) -> Path:
    [found] = Path(f"{out}.run").glob("weights-decoded-*")
    return found


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_decoded_copy_scores_and_generates_what_streaming_as_stored_does(
    models: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    """Score mode writes each completion's summed log-probability as a float64 repr, so
    equal files mean the same logits to the last bit; generate mode the same tokens."""
    model = models[kind]
    dtype = ["--dtype", "bfloat16"] if kind == "fp32-as-bf16" else []
    for mode in ("score", "generate"):
        as_stored, once = tmp_path / f"{mode}-stored.jsonl", tmp_path / f"{mode}-once.jsonl"
        extra = ["--mode", mode, "--max-new-tokens", "6", *dtype]
        assert _infer(model, as_stored, *extra) == 0
        assert _infer(model, once, *extra, "--decode-once") == 0
        assert once.read_bytes() == as_stored.read_bytes(), KINDS[kind]
    start_once, start_stored = _events(once)[0], _events(as_stored)[0]
    copy = _copy_dir(once)
    assert copy.name == f"weights-decoded-{start_once['dtype']}"
    layers = [read_header(f) for f in sorted(copy.glob("layers.*.safetensors"))]
    assert len(layers) == start_once["units"] - 2  # every decoder layer; embed and head as stored
    for refs in layers:
        assert all("::" not in k for k in refs)  # model keys, no stored parts
        floats = {r.dtype for k, r in refs.items() if r.dtype.is_floating_point}
        own = {r.dtype for k, r in refs.items() if k.endswith("input_global_scale")}
        assert floats - own == {getattr(torch, start_once["dtype"])}
        assert own <= {torch.float32}  # NVFP4's input global scales compute in float32
    assert start_once["decode_once"] is True and start_stored["decode_once"] is False
    print(
        f"{kind}: bytes a pass {start_stored['streamed_bytes_per_pass']} as stored, "
        f"{start_once['streamed_bytes_per_pass']} decoded"
    )


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_plan_predicts_the_copy_before_writing_it(
    models: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    """What the plan counts a layer as reading from the copy (known before it is written)
    is what the copy holds; a layer prepares nothing more."""
    from shoestring.infer.engine import StreamingCausalLM, read_config_json
    from shoestring.infer.shards import index_model
    from shoestring.infer.stored import stored_compute_dtype, stored_refs, stored_weights
    from shoestring.infer.weights import weight_hook, weight_needs

    model = models[kind]
    dtype = stored_compute_dtype(read_config_json(model))  # as the job resolves it
    refs = stored_refs(read_config_json(model), index_model(model))  # as the job indexes it
    eng = StreamingCausalLM(
        model,
        device=torch.device("cpu"),
        refs=refs,
        dtype=torch.bfloat16 if kind == "fp32-as-bf16" else dtype,
    )
    stored = stored_weights(eng)
    predicted = weight_needs(eng, None, None, stored, decode_once=True)
    hook, needs = weight_hook(eng, None, None, tmp_path / "copy", "m", stored, decode_once=True)
    layers = decoded.layer_units(eng)
    for i in layers:
        refs = read_header(tmp_path / "copy" / f"{eng.units[i].name}.safetensors")
        assert predicted.read[i] == sum(r.nbytes for r in refs.values())
        assert needs.extra[i] == needs.prepare[i] == 0 and not eng.units[i].fused
    assert predicted.build > max(predicted.read[i] for i in layers)
    if stored is None:
        assert hook is None  # nothing left to do: the embedding and head stream as stored


def test_a_run_switches_the_copy_on_or_off_and_a_rerun_keeps_it(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The copy is not part of the run's identity (the outputs do not change): a run
    stopped mid-chunk while streaming as stored (SIGTERM between two layers: its
    generation state saved) continues from the copy to the uninterrupted bytes; a rerun
    reuses the committed copy."""
    import subprocess
    import sys

    model, out = models["fp8-moe"], tmp_path / "o.jsonl"
    want = tmp_path / "want.jsonl"
    assert _infer(model, want, "--max-new-tokens", "8") == 0
    args = [sys.executable, "-m", "shoestring", "infer", "--model", str(model)]
    args += ["--input", str(want.with_suffix(".in.jsonl")), "--output", str(out)]
    args += ["--threads", "1", "--job.progress", "off", "--memory.resident", "0"]
    args += ["--max-new-tokens", "8"]
    env = {**os.environ, "SHOESTRING_FAULTS": "pass.unit@20:term"}
    stopped = subprocess.run(args, env=env, capture_output=True, text=True)
    assert stopped.returncode != 0 and not out.exists(), stopped.stderr[-2000:]
    assert "on a CPU, --decode-once writes its layers decoded once (" in stopped.stderr
    assert any(e["event"] == "preempt" for e in _events(out)), stopped.stderr[-2000:]
    assert list(Path(f"{out}.run").glob("partial/step-*"))  # mid-chunk state, as stored
    capsys.readouterr()
    assert _infer(model, out, "--max-new-tokens", "8", "--decode-once") == 0
    assert "writing the layers once into" in capsys.readouterr().err
    assert out.read_bytes() == want.read_bytes()
    meta = _copy_dir(out) / "meta.json"
    first = meta.stat().st_mtime_ns
    out.unlink()
    assert _infer(model, out, "--max-new-tokens", "8", "--decode-once") == 0
    assert "writing the layers once" not in capsys.readouterr().err
    assert meta.stat().st_mtime_ns == first and out.read_bytes() == want.read_bytes()


def test_an_interrupted_copy_leaves_nothing_and_the_rerun_writes_it(
    models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, out = models["fp8"], tmp_path / "o.jsonl"
    written: list[Path] = []
    real = decoded._write_layer

    def killed_after_one(path: Path, tensors: dict[str, torch.Tensor]) -> None:
        if written:
            raise KeyboardInterrupt  # what a SIGINT mid-copy raises
        real(path, tensors)
        written.append(path)

    monkeypatch.setattr(decoded, "_write_layer", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        _infer(model, out, "--decode-once")
    run = Path(f"{out}.run")
    assert written and not list(run.glob("weights-*")) and not list(run.glob(".tmp-*"))
    monkeypatch.setattr(decoded, "_write_layer", real)
    assert _infer(model, out, "--decode-once") == 0
    assert (_copy_dir(out) / "meta.json").is_file()


@pytest.mark.parametrize(
    ("kind", "extra", "needle"),
    [
        ("fp8", ["--compress", "int8"], "--decode-once (compress.decode_once): the layers are"),
        ("llama-bf16", [], "there is nothing to decode"),
        ("fp32-as-bf16", [], "(float32, nothing quantized or fused)"),
    ],
)
def test_a_copy_that_would_only_cost_is_refused_before_any_work(
    models: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    kind: str,
    extra: list[str],
    needle: str,
) -> None:
    out = tmp_path / "o.jsonl"
    assert _infer(models[kind], out, "--decode-once", *extra) == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert not list(Path(f"{out}.run").glob("weights-*"))


def test_a_disk_without_room_for_the_copy_is_refused_naming_what_it_takes(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match=r"GB free; the weights-decoded copy of the layers takes"):
        check_room(tmp_path, 1 << 60, "weights-decoded")
    check_room(tmp_path, 1 << 20, "weights-decoded")  # a MiB fits
