"""The planner's memory model of a mixture of experts against tiny instantiated
Mixtral, Qwen3-MoE and OLMoE models, loaded and adapted as finetune does.

Static components (experts in NF4 or 16 bits, routers, q/k norms, peft's LoRA on the
fused experts and the router, gradients, optimizer state) must match the tensors'
bytes, and saved activations the storages autograd saves, within the tolerances of
``test_plan_memory.py``. The routed terms are exact whatever the routing: every
token's top-k experts make ``T·k`` rows in all."""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from shoestring.infer.fixtures import build_random_model
from shoestring.plan import memory as M
from shoestring.plan.arch import LINEARS, load_arch
from shoestring.plan.measure import grad_bytes, model_bytes, optimizer_bytes, saved_activation_bytes
from shoestring.train.config import LoraSection, ModelConfig

pytest.importorskip("bitsandbytes")

STATIC_TOL = 1e-4
ACTIVATION_TOL = 2e-4

#: Four experts, two a token; widths multiples of 64.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
}


def _model_dir(root: Path, arch: str, **extra: Any) -> Path:
    return build_random_model(
        root / arch, arch, hidden=128, ffn=128, layers=2, heads=4, kv_heads=2,
        init_std=0.05, **SHAPES[arch], **extra,
    )  # fmt: skip


def _adapted(model_dir: Path, quantize: str, targets: list[str], parameters: list[str],
             gc: bool = False, dtype: str = "bfloat16") -> Any:  # fmt: skip
    from shoestring.train.model import apply_lora, load_base_model

    lora = LoraSection(r=8, alpha=16, dropout=0.0, target_modules=targets,
                       target_parameters=parameters)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = ModelConfig(path=str(model_dir), dtype=dtype)  # type: ignore[arg-type]
        base = load_base_model(model_dir, cfg, quantize)
        return apply_lora(base, lora, seed=0, gradient_checkpointing=gc)


def _workload(model_dir: Path, quantize: str, targets: list[str], parameters: list[str],
              **kw: Any) -> M.Workload:  # fmt: skip
    kw.setdefault("dtype", "bfloat16")
    return M.Workload(
        arch=load_arch(str(model_dir)),
        method="qlora" if quantize != "none" else "lora",
        quantize=quantize,  # type: ignore[arg-type]
        lora_r=8,
        lora_dropout=0.0,
        lora_targets=LINEARS if targets == ["all-linear"] else tuple(targets),
        lora_parameters=tuple(parameters),
        device="cpu",
        **kw,
    )


def _within(pred: int, meas: int, tol: float, what: str) -> None:
    assert meas > 0
    print(f"  {what}: predicted {pred}, measured {meas}: {100 * (pred - meas) / meas:+.4f}%")
    assert abs(pred - meas) <= tol * meas, f"{what}: predicted {pred}, measured {meas}"


CASES = [
    # arch, quantize, target_modules, target_parameters, extra config
    ("qwen3_moe", "nf4", ["all-linear"], [], {}),
    ("qwen3_moe", "nf4", ["all-linear"], [], {"gradient_checkpointing": True}),
    ("qwen3_moe", "nf4", ["all-linear"], [], {"dtype": "float32"}),
    ("olmoe", "none", ["all-linear"], [], {"dtype": "float32"}),
    ("qwen3_moe", "none", ["all-linear"], [], {"norm_topk_prob": True}),
    ("mixtral", "nf4", ["q_proj", "v_proj"], [], {}),
    ("mixtral", "none", ["q_proj", "v_proj"], ["down_proj"], {}),
    ("olmoe", "nf4", ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_up_proj", "down_proj"], {}),
    ("olmoe", "none", ["all-linear"], [], {}),
]


def _case_id(c: tuple[Any, ...]) -> str:
    arch, q, targets, params, extra = c
    return f"{arch}-{q}-{'+'.join(targets + params)}{''.join(f'-{k}' for k in extra)}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_moe_static_bytes_and_saved_activations_match_the_tensors(
    tmp_path: Path, case: tuple[Any, ...]
) -> None:
    from shoestring.train.model import build_optimizer, trainable_parameters

    arch, quantize, targets, parameters, extra = case
    torch.set_num_threads(1)
    extra = dict(extra)
    gc = extra.pop("gradient_checkpointing", False)
    dtype = extra.pop("dtype", "bfloat16")
    model_dir = _model_dir(tmp_path, arch, **extra)
    model = _adapted(model_dir, quantize, targets, parameters, gc, dtype)
    params = trainable_parameters(model)
    opt = build_optimizer(list(params.values()), "adamw8bit", 1e-3, 0.0)
    ids = torch.randint(3, 300, (2, 48), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, 40:] = 0
    model.train()
    measured = saved_activation_bytes(
        model, lambda: model(input_ids=ids, attention_mask=mask, labels=ids)
    )
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    opt.step()

    w = _workload(model_dir, quantize, targets, parameters, optimizer="adamw8bit",
                  seq_len=48, micro_batch=2, gradient_checkpointing=gc, dtype=dtype)  # fmt: skip
    assert w.arch.experts is not None and w.nf4_experts == (quantize == "nf4")
    meas = model_bytes(model)
    wb = M.weight_bytes(w)
    _within(wb["linear"] + wb["embeddings"] + wb["norms"] + wb["buffers"], meas["frozen"],
            STATIC_TOL, "weights")  # fmt: skip
    if quantize == "none":
        assert wb["quant_state"] == meas["quant_state"] == 0
    else:
        _within(wb["quant_state"], meas["quant_state"], STATIC_TOL, "quant_state")
    _within(M.adapter_bytes(w), meas["trainable"], STATIC_TOL, "adapters")
    _within(M.grad_bytes(w), grad_bytes(model), STATIC_TOL, "gradients")
    _within(M.optimizer_bytes(w), optimizer_bytes(opt), STATIC_TOL, "optimizer")
    _within(M.activation_bytes(w).saved, measured, ACTIVATION_TOL, "activations")


def test_a_dense_qwen3s_per_head_qk_norms_are_counted(tmp_path: Path) -> None:
    """Qwen3 (dense) normalizes each head's queries and keys as Qwen3-MoE does: fp32
    copies of q and k and their rsqrt are saved per layer, beside the dense MLP."""
    torch.set_num_threads(1)
    model_dir = build_random_model(tmp_path / "qwen3", "qwen3", hidden=128, ffn=256, layers=2,
                                   heads=4, kv_heads=2, head_dim=32)  # fmt: skip
    model = _adapted(model_dir, "nf4", ["all-linear"], [])
    ids = torch.randint(3, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    model.train()
    measured = saved_activation_bytes(model, lambda: model(input_ids=ids, labels=ids))
    w = _workload(model_dir, "nf4", ["all-linear"], [], seq_len=40, micro_batch=2,
                  gradient_checkpointing=False, padded=False)  # fmt: skip
    assert w.arch.qk_norm == "head" and w.arch.experts is None
    _within(M.activation_bytes(w).saved, measured, ACTIVATION_TOL, "activations")
    plain = replace(w, arch=replace(w.arch, qk_norm="none"))
    assert M.activation_bytes(plain).saved < measured * (1 - 10 * ACTIVATION_TOL)
    _within(sum(M.weight_bytes(w).values()) - M.weight_bytes(w)["quant_state"],
            model_bytes(model)["frozen"], STATIC_TOL, "weights")  # fmt: skip
