"""The speed levers ``train.kernels`` and ``train.compile`` (issue #26): refusals before
any work, the planner's fused cross-entropy term, and the compile warm-up as its own phase
that leaves the training untouched (and, with inductor, resumes exactly after SIGKILL)."""

from __future__ import annotations

import json
import signal
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import CLI, FAST, read_events, state_digest
from shoestring import exitcodes
from shoestring.config import ConfigError
from shoestring.plan.arch import PRESETS
from shoestring.plan.memory import activation_bytes, liger_chunk_tokens
from shoestring.plan.workload import workload_from_config
from shoestring.train.compiled import check_compile
from shoestring.train.config import FinetuneConfig, TrainConfig
from shoestring.train.kernels import check_family, check_kernels


def test_liger_on_cpu_is_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from shoestring.cli import main

    monkeypatch.setenv("SHOESTRING_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    code = main(["finetune", "--output_dir", str(out), "--train.device", "cpu",
                 "--train.kernels", "liger"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == exitcodes.USAGE, err
    assert "train.kernels" in err and "CUDA only" in err and "Traceback" not in err
    assert not out.exists()  # refused before the run directory, the data or any weights
    assert "liger_kernel" not in sys.modules


def test_liger_refusals_name_the_key() -> None:
    on_gpu = TrainConfig(kernels="liger", loss_chunk_tokens=512)
    with pytest.raises(ConfigError, match="train.kernels.*loss_chunk_tokens"):
        check_kernels(on_gpu, on_gpu=True)
    # liger-kernel is never installed in dev/CI: the install hint, not an ImportError
    with pytest.raises(ConfigError, match=r"train.kernels.*shoestring\[kernels\]"):
        check_kernels(TrainConfig(kernels="liger"), on_gpu=True)
    check_kernels(TrainConfig(), on_gpu=False)  # the default is off, anywhere


def test_liger_refuses_an_unsupported_family(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="train.kernels.*'gpt2'"):
        check_family("liger", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    check_family("liger", tmp_path)
    check_family("none", tmp_path / "missing")  # off: nothing is read


def test_compile_refuses_the_chunked_loss() -> None:
    with pytest.raises(ConfigError, match="train.compile"):
        check_compile(TrainConfig(compile=True, loss_chunk_tokens=256))
    check_compile(TrainConfig(compile=True))


def test_fused_cross_entropy_drops_the_plan_logits_term() -> None:
    arch = PRESETS["llama-3-8b"]
    cfg = FinetuneConfig()
    cfg.data.max_length = 2048
    cfg.train.batch_size, cfg.train.micro_batch_size = 1, 1
    cfg.lora.quantize = "nf4"
    plain, _ = workload_from_config(cfg, arch)
    fused, _ = workload_from_config(replace(cfg, train=replace(cfg.train, kernels="liger")), arch)
    assert fused.kernels == "liger" and plain.kernels == "none"
    a, b = activation_bytes(plain), activation_bytes(fused)
    # Whole logits at 2048 x 128k: bf16 logits + fp32 grads, ~2.5 GiB; fused: one chunk.
    assert a.logits > 2 * 2**30
    assert b.logits < a.logits / 4
    assert b.parts["head"] < a.parts["head"]
    assert b.peak < a.peak
    # the chunk of liger's own rule: BT / ceil(V / H) rounded up to a power of two
    assert liger_chunk_tokens(2048, arch.vocab, arch.hidden) == 64
    assert liger_chunk_tokens(16, 32000, 4096) == 2


def test_compile_warm_up_is_its_own_phase_and_leaves_training_untouched(
    cli: CLI, tmp_path: Path, reference: dict[str, str]
) -> None:
    # Under TORCHDYNAMO_DISABLE (the suite's default) the compiled module runs eagerly:
    # what is checked here is the phase and that the warm-up's gradients never leak
    # into a step (the state is the uncompiled reference's, byte for byte).
    out = tmp_path / "run"
    r = cli.run(out, *FAST, "--train.compile", "true")
    assert r.returncode == 0, r.stderr
    ev = read_events(out)
    kinds = [e["event"] for e in ev]
    (compiled,) = [e for e in ev if e["event"] == "compile"]
    assert compiled["step"] == 0 and compiled["seconds"] > 0
    assert "TORCHDYNAMO_DISABLE" in compiled["eager"]
    assert kinds.index("compile") < kinds.index("step")
    assert state_digest(out, 12) == reference


@pytest.mark.slow  # inductor on CPU: minutes of compilation per process on 2 busy cores
def test_compiled_run_resumes_byte_identical_to_itself_after_sigkill(
    cli: CLI, tmp_path: Path
) -> None:
    env = {"TORCHDYNAMO_DISABLE": "0", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    args = [*FAST, "--train.compile", "true"]
    ref = tmp_path / "ref"
    r = cli.run(ref, *args, env=env, timeout=1200)
    assert r.returncode == 0, r.stderr
    (c,) = [e for e in read_events(ref) if e["event"] == "compile"]
    assert "eager" not in c
    out = tmp_path / "run"
    # Killed right after the step-4 checkpoint commits (a kill at a step's end could beat
    # a slow save, and the rerun would start over).
    faults = {"SHOESTRING_FAULTS": "ckpt.after_rename@1:kill"}
    killed = cli.run(out, *args, env={**env, **faults}, timeout=1200)
    assert killed.returncode == -signal.SIGKILL
    r = cli.run(out, *args, env=env, timeout=1200)
    assert r.returncode == 0, r.stderr
    ev = read_events(out)
    (resume,) = [e for e in ev if e["event"] == "resume"]
    assert resume["from_step"] == 4
    assert [e["step"] for e in ev if e["event"] == "compile"] == [0, 4]
    assert state_digest(out, 12) == state_digest(ref, 12)
