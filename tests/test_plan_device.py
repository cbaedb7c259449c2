"""``shoestring plan`` plans what ``finetune`` will do: the same dtype, precision and
device for the same config (one rule, :func:`shoestring.train.config.resolve_numerics`),
``--device cpu|cuda``, and on CPU the bytes of the model finetune loads and of the
activations it saves, byte for byte (issue 19, item 4).
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import REPO
from shoestring.config import ConfigError, load
from shoestring.plan import memory as M
from shoestring.plan.measure import model_bytes, saved_activation_bytes
from shoestring.plan.workload import PlanRequest, resolve_request
from shoestring.train.config import FinetuneConfig, ModelConfig, TrainConfig
from shoestring.train.device import Accelerator, resolve


def plan_json(cache: Path, *args: str) -> dict[str, Any]:
    r = subprocess.run(
        [sys.executable, "-m", "shoestring", "plan", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            "PYTHONPATH": str(REPO / "src"),
            "PATH": "/usr/bin:/bin",
            "SHOESTRING_CACHE": str(cache),
        },
    )
    assert r.returncode in (0, 1), r.stderr
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


def as_finetune_loads(
    cfg: FinetuneConfig, acc: Accelerator, cache: Path
) -> tuple[FinetuneConfig, Any]:
    """The resolved config and the LoRA model, as ``finetune`` builds them (on the CPU
    here: the bytes of a tensor do not depend on the device it lives on)."""
    from shoestring.train.model import apply_lora, load_base_model, resolve_model_dir

    cfg = resolve(cfg, acc, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = load_base_model(resolve_model_dir(cfg.model, cache), cfg.model, cfg.lora.quantize)
        model = apply_lora(base, cfg.lora, cfg.train.seed, cfg.model.gradient_checkpointing)
    model.train()
    return cfg, model


def batch(vocab: int, b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, s // 2 :] = 0  # padded batches: HF passes a 4D mask to SDPA
    return ids, mask


def test_the_rule_is_finetunes() -> None:
    """auto → float32 / fp32 on CPU; bf16 (or fp16 without bf16) on CUDA; explicit values
    pass through; fp16 autocast on a CPU is refused, as finetune refuses it."""
    from shoestring.train.config import resolve_numerics

    m, t = ModelConfig(), TrainConfig()
    cpu = resolve_numerics(m, t, "cpu", gpu_bf16=True)
    assert (cpu.dtype, cpu.precision, cpu.autocast) == ("float32", "fp32", False)
    l4 = resolve_numerics(m, t, "cuda", gpu_bf16=True)
    assert (l4.dtype, l4.precision, l4.autocast) == ("bfloat16", "bf16", True)
    t4 = resolve_numerics(m, t, "cuda", gpu_bf16=False)
    assert (t4.dtype, t4.precision) == ("float16", "fp16")
    bf = resolve_numerics(ModelConfig(dtype="bfloat16"), t, "cpu", gpu_bf16=False)
    assert (bf.dtype, bf.precision, bf.autocast) == ("bfloat16", "fp32", False)
    with pytest.raises(ConfigError, match="train.precision"):
        resolve_numerics(m, TrainConfig(precision="fp16"), "cpu", gpu_bf16=True)
    # finetune's resolve() is this rule on the device it probed
    on_cpu = resolve(FinetuneConfig(), Accelerator(), 0)
    assert (on_cpu.model.dtype, on_cpu.train.precision) == (cpu.dtype, cpu.precision)
    on_t4 = resolve(FinetuneConfig(), Accelerator(1, False, "Tesla T4"), 0)
    assert (on_t4.model.dtype, on_t4.train.precision) == (t4.dtype, t4.precision)


@pytest.mark.parametrize("how", ["flag", "config"])
def test_cpu_plan_is_the_model_finetune_loads(tmp_path: Path, cache_dir: Path, how: str) -> None:
    """The shipped tiny-reverse config, no dtype flags: planned on the CPU (by --device cpu,
    or by train.device: cpu in the config) as finetune loads it there: float32 weights,
    no autocast, 4-byte dropout masks. Weights, adapters and saved activations are
    byte-exact against the model finetune builds and the tensors autograd saves."""
    text = (REPO / "configs" / "tiny-reverse.yaml").read_text()
    y = tmp_path / "c.yaml"
    y.write_text(text + ("train:\n  device: cpu\n" if how == "config" else ""))
    doc = plan_json(cache_dir, "--config", str(y), *(["--device", "cpu"] if how == "flag" else []))
    cfg, model = as_finetune_loads(load(FinetuneConfig, str(y), []), Accelerator(), cache_dir)
    w = doc["workload"]
    assert (w["dtype"], w["autocast"]) == (cfg.model.dtype, False) == ("float32", False)
    assert doc["device"] == w["device"] == "cpu" and doc["gpu"] is None
    meas = model_bytes(model)
    assert doc["breakdown"]["weights"] == meas["frozen"]
    assert doc["breakdown"]["adapters"] == meas["trainable"]
    assert doc["breakdown"]["workspace"] == 0 and doc["hours"] is None
    ids, mask = batch(model.config.vocab_size, w["micro_batch"], w["seq_len"])
    torch.set_num_threads(1)
    saved = saved_activation_bytes(
        model, lambda: model(input_ids=ids, attention_mask=mask, labels=ids)
    )
    assert doc["breakdown"]["activations"] == saved


@pytest.mark.parametrize("gpu,dtype", [("L4", "bfloat16"), ("T4", "float16")])
def test_cuda_plan_is_what_finetune_does_on_that_gpu(cache_dir: Path, gpu: str, dtype: str) -> None:
    """``--device cuda --gpu L4``: bf16 weights under bf16 autocast, as finetune resolves
    the same config on a GPU with bf16 (fp16 on a T4); the weight bytes are the model's."""
    y = REPO / "configs" / "tiny-reverse.yaml"
    doc = plan_json(cache_dir, "--config", str(y), "--device", "cuda", "--gpu", gpu)
    acc = Accelerator(cuda_devices=1, bf16=gpu != "T4", name=gpu)
    cfg, model = as_finetune_loads(load(FinetuneConfig, str(y), []), acc, cache_dir)
    w = doc["workload"]
    assert (w["device"], w["dtype"], w["autocast"]) == ("cuda", cfg.model.dtype, True)
    assert cfg.model.dtype == dtype and doc["gpu"]["name"] == gpu
    assert doc["breakdown"]["weights"] == model_bytes(model)["frozen"]
    assert doc["breakdown"]["workspace"] > 0 and doc["hours"] > 0
    # --gpu without --device means a CUDA plan: the same workload
    assert plan_json(cache_dir, "--config", str(y), "--gpu", gpu)["workload"] == w


def test_device_flag_errors(cache_dir: Path) -> None:
    with pytest.raises(ConfigError, match="--gpu"):
        resolve_request(PlanRequest(model="llama-3-8b", device="cpu", gpu="L4"))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "shoestring",
            "plan",
            "--model",
            "llama-3-8b",
            "--gpu",
            "T4",
            "--ram",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 2 and "--ram" in r.stderr
    doc = plan_json(cache_dir, "--model", "llama-3-8b", "--device", "cpu", "--ram", "16")
    assert (
        doc["ram_bytes"] == 16 << 30 and not doc["fits"] and doc["workload"]["dtype"] == "float32"
    )
    assert doc["cost_usd"] is None and any("QLoRA" in a["change"] for a in doc["advice"])


# --------------------------------------------------------------------------- a real shape

#: TinyLlama-1.1B's shape (hidden 2048, 32 heads over 4 KV heads, SwiGLU 5632, vocab
#: 32000), two of its 22 layers.
REAL: dict[str, Any] = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=2,
    num_attention_heads=32,
    num_key_value_heads=4,
    tie_word_embeddings=False,
    max_position_embeddings=2048,
)


@pytest.fixture(scope="module")
def real_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tinyllama-2l")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        LlamaForCausalLM(LlamaConfig(**REAL)).save_pretrained(d)
    return d


def saved_by_layer(model: Any, forward: Callable[[], Any]) -> list[int]:
    """Bytes of the storages each decoder layer is the first to save for backward."""
    layers = model.base_model.model.model.layers
    exclude = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}
    seen: set[int] = set()
    per = [0] * len(layers)
    current: list[int | None] = [None]

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if current[0] is not None and st.data_ptr() not in exclude | seen:
            per[current[0]] += st.nbytes()
        seen.add(st.data_ptr())
        return t

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda *_, i=i: current.__setitem__(0, i))
        layer.register_forward_hook(lambda *_: current.__setitem__(0, None))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    return per


@pytest.mark.parametrize("gc", [False, True], ids=["nogc", "gc"])
def test_cpu_activations_are_exact_for_a_real_shape(
    tmp_path: Path, real_dir: Path, gc: bool
) -> None:
    """Two TinyLlama layers, fp32 on the CPU as finetune runs them, LoRA r=16 on every
    linear with dropout 0.05, a padded batch of 2 x 64: the planner's saved bytes are the
    saved tensors' bytes exactly. Without checkpointing a later layer's saves (what
    checkpointing recomputes in backward, the plan's recompute transient) are exact too."""
    y = tmp_path / "c.yaml"
    y.write_text(
        f"model:\n  path: {real_dir}\n  gradient_checkpointing: {str(gc).lower()}\n"
        "data:\n  max_length: 64\ntrain:\n  batch_size: 2\n"
    )
    w = resolve_request(PlanRequest(config=y, device="cpu")).workload
    assert (w.device, w.dtype, w.lora_dropout, w.autocast) == ("cpu", "float32", 0.05, False)
    _, model = as_finetune_loads(load(FinetuneConfig, str(y), []), Accelerator(), tmp_path)
    ids, mask = batch(REAL["vocab_size"], w.micro_batch, w.seq_len)
    torch.set_num_threads(2)

    def forward() -> Any:
        return model(input_ids=ids, attention_mask=mask, labels=ids)

    act = M.activation_bytes(w)
    assert act.saved == saved_activation_bytes(model, forward)
    if not gc:
        assert act.per_layer == saved_by_layer(model, forward)[1]


def test_16_bit_on_a_cpu_without_bf16_kernels_is_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from shoestring.train.device import cpu_computes_bf16

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n")
    assert cpu_computes_bf16(str(info)) is False
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_tile\n")
    assert cpu_computes_bf16(str(info)) is True
    assert cpu_computes_bf16(str(tmp_path / "absent")) is True  # unknown: no warning

    slow = Accelerator(cpu_bf16=False)
    with caplog.at_level("WARNING", logger="shoestring.finetune"):
        resolve(FinetuneConfig(), slow, 0)  # auto on a CPU: float32, fp32
        assert not caplog.records
        bf16 = load(FinetuneConfig, None, ["--model.dtype", "bfloat16"])
        assert resolve(bf16, slow, 0).model.dtype == "bfloat16"  # a warning, not a refusal
        resolve(bf16, Accelerator(cpu_bf16=True), 0)
    assert len(caplog.records) == 1 and "80x slower" in caplog.records[0].getMessage()
