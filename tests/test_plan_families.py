"""The planner's other families, Gemma 3 and Phi-3: their tensors to the byte on tiny
models, as for Llama.

Gemma 3 differs from Llama where memory is counted: its RMSNorm scales by ``1 + weight``
formed in fp32 at every call, each layer has four norms (after the attention and the MLP
too) and per-head q/k norms, some layers attend through a sliding window (a mask, and
the grouped KV heads repeated, once the sequence reaches the window) with their own
rotary table, and the embedding is scaled by a stored constant. Gemma 2's soft-capped
logits run through eager attention, which the planner refuses to guess.

Phi-3 (and Phi-4-mini) fuses q, k and v into one projection and gate and up into
another (LoRA on each as one), rotates part of each head (Phi-4-mini: three quarters),
and rotates by concatenating, so SDPA keeps the whole q|k|v output for v and o_proj's
input is a copy."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from shoestring.plan import memory as M
from shoestring.plan.arch import ALL_LINEARS, LINEARS, Unmodelled, from_hf_config
from shoestring.plan.measure import saved_activation_bytes
from test_plan_memory import ACTIVATION_TOL, _lora_model, _within, assert_static_terms

pytest.importorskip("bitsandbytes")


def _gemma3(tmp: Path, layers: int = 4, **kw: Any) -> tuple[Path, Any]:
    """A tiny Gemma 3: sliding and full layers alternating, a 16-token window."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    shape = dict(vocab_size=448, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
                 max_position_embeddings=256, sliding_window=16, pad_token_id=0)  # fmt: skip
    types = ["sliding_attention", "full_attention"] * (layers // 2)
    cfg = Gemma3TextConfig(num_hidden_layers=layers, layer_types=types, **{**shape, **kw})
    torch.manual_seed(0)
    Gemma3ForCausalLM(cfg).save_pretrained(tmp)
    return tmp, cfg


#: A tiny SigLIP tower as Gemma 3's (no pooling head): 16 patches pooled to 4 tokens.
TINY_SIGLIP = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=1, image_size=64, patch_size=16, vision_use_head=False)  # fmt: skip


def _gemma3_vision(tmp: Path, layers: int = 4, **kw: Any) -> tuple[Path, Any]:
    """A tiny Gemma 3 as 4B and up are published: ``_gemma3``'s decoder beside a vision
    tower and projector, one ``Gemma3ForConditionalGeneration``."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    _, text = _gemma3(tmp / "text", layers, **kw)
    cfg = Gemma3Config(text_config=text.to_dict(), vision_config=TINY_SIGLIP,
                       mm_tokens_per_image=4)  # fmt: skip
    torch.manual_seed(0)
    Gemma3ForConditionalGeneration(cfg).save_pretrained(tmp)
    return tmp, cfg


def _phi3(tmp: Path, layers: int = 4, **kw: Any) -> tuple[Path, Any]:
    """A tiny Phi-3 as Phi-4-mini is built: three quarters of each head rotated, tied,
    LongRoPE scaling (a factor per rotated frequency)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    shape = dict(vocab_size=448, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096,
                 original_max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2, partial_rotary_factor=0.75, tie_word_embeddings=True)  # fmt: skip
    shape |= kw
    half = int(shape["hidden_size"] // shape["num_attention_heads"] * 0.75) // 2
    longrope = {"type": "longrope", "long_factor": [1.5] * half, "short_factor": [1.0] * half}
    cfg = Phi3Config(num_hidden_layers=layers, rope_scaling=longrope, **shape)
    torch.manual_seed(0)
    Phi3ForCausalLM(cfg).save_pretrained(tmp)
    return tmp, cfg


FAMILIES = {"gemma3": _gemma3, "phi3": _phi3, "gemma3-vision": _gemma3_vision}


def _full(model_dir: Path, dtype: str, gc: bool) -> Any:
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    model.config.use_cache = False
    if gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize(
    ("quantize", "optimizer", "dtype"),
    [("none", "adamw", "float32"), ("nf4", "adamw8bit", "bfloat16"), ("int8", "adamw", "bfloat16")],
)
def test_static_components_match_tensor_bytes(
    tmp_path: Path, family: str, quantize: str, optimizer: str, dtype: str
) -> None:
    from shoestring.train.model import build_optimizer, trainable_parameters

    torch.set_num_threads(1)
    model_dir, cfg = FAMILIES[family](tmp_path, layers=2, hidden_size=192,
                                      num_attention_heads=3, num_key_value_heads=1,
                                      intermediate_size=384)  # fmt: skip
    arch = from_hf_config(cfg.to_dict())
    expect = (True, True, False) if family.startswith("gemma3") else (False, False, True)
    assert (arch.norm_offset, arch.sandwich_norms, arch.fused_projections) == expect
    model = _lora_model(model_dir, dtype, quantize, r=24, dropout=0.0, targets=["all-linear"],
                        gc=False)  # fmt: skip
    params = trainable_parameters(model)
    opt = build_optimizer(list(params.values()), optimizer, 1e-3, 0.0)
    ids = torch.randint(0, 448, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    w = M.Workload(arch=arch, method="qlora" if quantize != "none" else "lora", quantize=quantize,
                   dtype=dtype, lora_r=24, lora_targets=ALL_LINEARS, optimizer=optimizer)  # fmt: skip
    assert_static_terms(w, model, opt)


CASES = [
    # method, dtype, quantize, checkpointing, padded, seq: 32 reaches the 16-token window
    ("lora", "float32", "none", False, False, 32),
    ("lora", "bfloat16", "none", False, False, 32),
    ("qlora", "bfloat16", "nf4", False, False, 32),
    ("lora", "float32", "none", False, False, 8),  # shorter than the window: no mask
    ("lora", "float32", "none", False, True, 32),
    ("lora", "float32", "none", True, False, 32),
    ("full", "float32", "none", False, False, 32),
    ("full", "bfloat16", "none", False, False, 32),
    ("full", "float32", "none", True, True, 32),
]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_activation_bytes_match_saved_tensors(
    tmp_path: Path, family: str, case: tuple[Any, ...]
) -> None:
    method, dtype, quantize, gc, padded, s = case
    torch.set_num_threads(1)
    model_dir, cfg = FAMILIES[family](tmp_path)
    if method == "full":
        model = _full(model_dir, dtype, gc)
    else:
        model = _lora_model(model_dir, dtype, quantize, r=8, dropout=0.0,
                            targets=["all-linear"], gc=gc)  # fmt: skip
    model.train()
    ids = torch.randint(0, 448, (2, s), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, s // 2 :] = 0
    measured = saved_activation_bytes(
        model, lambda: model(input_ids=ids, attention_mask=mask, labels=ids)
    )
    w = M.Workload(arch=from_hf_config(cfg.to_dict()), method=method, quantize=quantize,
                   dtype=dtype, lora_r=8, lora_dropout=0.0, seq_len=s, micro_batch=2,
                   gradient_checkpointing=gc,
                   padded=padded, device="cpu", lora_targets=ALL_LINEARS)  # fmt: skip
    _within(M.activation_bytes(w).saved, measured, ACTIVATION_TOL)


def test_qwen3_q_and_k_norms_under_full_fine_tuning(tmp_path: Path) -> None:
    """A trained q/k norm weight also saves the normalized heads (found with Gemma 3)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=448, hidden_size=128, intermediate_size=256, head_dim=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path)
    model = _full(tmp_path, "bfloat16", gc=False).train()
    ids = torch.randint(0, 448, (2, 32))
    measured = saved_activation_bytes(model, lambda: model(input_ids=ids, labels=ids))
    w = M.Workload(arch=from_hf_config(cfg.to_dict()), method="full", dtype="bfloat16",
                   seq_len=32, micro_batch=2, gradient_checkpointing=False, padded=False,
                   device="cpu")  # fmt: skip
    _within(M.activation_bytes(w).saved, measured, ACTIVATION_TOL)


def test_gemma2_soft_capping_is_refused_by_name() -> None:
    from transformers import Gemma2Config

    with pytest.raises(Unmodelled, match="attn_logit_softcapping, final_logit_softcapping"):
        from_hf_config(Gemma2Config().to_dict())


def test_mistral_sliding_window_is_counted_once_the_sequence_reaches_it(tmp_path: Path) -> None:
    """Mistral 7B v0.1's window (every layer): past it SDPA gets a mask, and the
    grouped KV heads are repeated for it, as with padding."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=448, hidden_size=128, intermediate_size=256, head_dim=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        sliding_window=16)  # fmt: skip
    torch.manual_seed(0)
    MistralForCausalLM(cfg).save_pretrained(tmp_path)
    torch.set_num_threads(1)
    model = _lora_model(tmp_path, "float32", "none", r=8, dropout=0.0, targets=["all-linear"],
                        gc=False).train()  # fmt: skip
    arch = from_hf_config(cfg.to_dict())
    assert arch.sliding == (True, True)
    for s in (8, 32):
        ids = torch.randint(0, 448, (2, s))
        measured = saved_activation_bytes(model, lambda ids=ids: model(input_ids=ids, labels=ids))
        w = M.Workload(arch=arch, method="lora", dtype="float32", lora_r=8, lora_dropout=0.0,
                       seq_len=s, micro_batch=2, gradient_checkpointing=False, padded=False,
                       device="cpu", lora_targets=LINEARS)  # fmt: skip
        _within(M.activation_bytes(w).saved, measured, ACTIVATION_TOL)


def test_a_family_the_tests_do_not_check_is_planned_with_a_note() -> None:
    from transformers import GraniteConfig

    from shoestring.gpus import find_gpu
    from shoestring.plan.estimate import make_plan

    arch = from_hf_config(GraniteConfig().to_dict())
    notes = make_plan(M.Workload(arch=arch), find_gpu("T4")).notes
    assert any("model_type 'granite' is planned as a Llama-style layer" in n for n in notes)
    llama = from_hf_config({**GraniteConfig().to_dict(), "model_type": "llama"})
    assert not any("Llama-style layer" in n for n in make_plan(M.Workload(arch=llama),
                                                                find_gpu("T4")).notes)  # fmt: skip


#: google/gemma-3-1b-pt's config.json as transformers 4.50 wrote it (no layer_types).
GEMMA3_1B = {"model_type": "gemma3_text", "hidden_size": 1152, "intermediate_size": 6912,
             "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
             "head_dim": 256, "vocab_size": 262144, "sliding_window": 512,
             "sliding_window_pattern": 6, "rope_theta": 1000000, "rope_local_base_freq": 10000,
             "query_pre_attn_scalar": 256, "max_position_embeddings": 32768,
             "tie_word_embeddings": True, "torch_dtype": "bfloat16"}  # fmt: skip


def test_gemma3_1b_as_the_hub_writes_it() -> None:
    """999,885,952 parameters (what Ollama lists for gemma3:1b as 999.89M); every sixth
    layer attends to all, the rest through 512 tokens with the local rotary table."""
    arch = from_hf_config(GEMMA3_1B)
    assert arch.params == 999_885_952
    assert [i for i, s in enumerate(arch.sliding) if not s] == [5, 11, 17, 23]
    assert (arch.window, arch.rope_table(0), arch.rope_table(5)) == (512, "local", "global")


#: google/gemma-3-4b-it's config.json as published: its text_config names 6 keys, and
#: transformers' defaults give the rest.
GEMMA3_4B = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
             "mm_tokens_per_image": 256, "torch_dtype": "bfloat16",
             "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                             "model_type": "gemma3_text", "num_hidden_layers": 34,
                             "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                             "sliding_window": 1024},
             "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                               "model_type": "siglip_vision_model", "num_attention_heads": 16,
                               "num_hidden_layers": 27, "patch_size": 14,
                               "vision_use_head": False}}  # fmt: skip


def test_gemma3_4b_as_the_hub_writes_it() -> None:
    """4,300,079,472 parameters, what transformers instantiates from this config (0.42B
    of them the SigLIP tower's, which text never runs: weights only); the decoder's
    shape from transformers' defaults; the tower sharded with the rest under FSDP2."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shoestring.plan.sharding import all_params, tower_params

    arch = from_hf_config(GEMMA3_4B)
    config = AutoConfig.for_model(
        "gemma3", **{k: v for k, v in GEMMA3_4B.items() if k != "model_type"}
    )
    with torch.device("meta"):
        counted = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert arch.params == counted == 4_300_079_472
    assert arch.tower is not None and arch.tower.params == 419_816_304
    assert arch.active_params == arch.params - arch.tower.params
    assert (arch.vocab, arch.heads, arch.kv_heads, arch.head_dim, arch.window) == (
        262208, 8, 4, 256, 1024)  # fmt: skip
    w = M.Workload(arch=arch, method="qlora", quantize="nf4", dtype="bfloat16")
    tower = tower_params(w)
    assert sum(p.shape[0] * p.row_numel for p in tower) == arch.tower.params
    assert all_params(w)[-len(tower) :] == tower


def test_another_vision_language_family_or_tower_is_refused_by_name() -> None:
    llava = {"model_type": "llava", "text_config": {"model_type": "llama"},
             "vision_config": {"model_type": "clip_vision_model"}}  # fmt: skip
    with pytest.raises(Unmodelled, match="vision-language model \\(llava\\).*gemma3"):
        from_hf_config(llava)
    headed = {**GEMMA3_4B, "vision_config": {**GEMMA3_4B["vision_config"], "vision_use_head": True}}
    with pytest.raises(Unmodelled, match="pooling head: True"):
        from_hf_config(headed)


def test_all_linear_on_a_phi3_adapts_its_fused_projections() -> None:
    from transformers import Phi3Config

    arch = from_hf_config(Phi3Config(pad_token_id=0).to_dict())
    assert M.Workload(arch=arch).adapted == ("o_proj", "down_proj", "qkv_proj", "gate_up_proj")
    assert arch.rotated == arch.head_dim  # Phi-3-mini rotates whole heads; Phi-4-mini 3/4
