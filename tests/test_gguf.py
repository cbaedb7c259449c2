"""GGUF export (export.gguf, shoestring export): files that transformers' own GGUF loader
reads back into the merged model (weights, q/k permutation, tokenizer, chat template),
refusals before training, durability against a kill, and the CLI paths."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import CLI, read_events
from gguf_fixtures import adapted_model as _adapted
from gguf_fixtures import tiny_model_dir
from shoestring.config import ConfigError

gguf = pytest.importorskip("gguf")

PROMPTS = ["The quick brown fox", "Hello world! How are you?", "reverse: abcde ="]
#: max |logit - merged logit| / max |merged logit| (measured: f16 6e-4, bf16 4e-3,
#: q8_0 1.7e-2 on these models), and the least top-1 agreement.
TOLERANCE = {"f16": (2e-3, 1.0), "bf16": (1e-2, 1.0), "q8_0": (3e-2, 0.9)}


def _load_gguf(path: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.eval(), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def _greedy(model: Any, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    return [int(t) for t in out[0, len(ids) :]]


def _reads_back(model: Any, tok: Any, path: Path, kind: str, greedy: bool = True) -> Any:
    """The GGUF loads in transformers with ``tok``'s tokens, ``model``'s logits within
    ``kind``'s tolerance and (``greedy``) its greedy tokens; returns its tokenizer."""
    loaded, gtok = _load_gguf(path)
    for text in PROMPTS:
        ids = tok(text)["input_ids"]
        assert gtok(text)["input_ids"] == ids
        ref, got = _logits(model, ids), _logits(loaded, ids)
        assert (got - ref).abs().max() <= TOLERANCE[kind][0] * ref.abs().max()
        if greedy:
            assert _greedy(loaded, ids) == _greedy(model, ids)
    return gtok


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any, Any]:
    from transformers import AutoTokenizer

    d = tiny_model_dir(tmp_path_factory.mktemp("llama") / "tiny-llama", "llama")
    model = _adapted(d)
    merged = copy.deepcopy(model).merge_and_unload().eval()
    return d, AutoTokenizer.from_pretrained(d), model, merged


@pytest.mark.parametrize("kind", ["f16", "bf16", "q8_0"])
def test_llama_gguf_reads_back_as_the_merged_model(
    kind: str, llama: tuple[Path, Any, Any, Any], tmp_path: Path
) -> None:
    from shoestring.train.ggufexport import export_gguf

    d, tok, model, merged = llama
    path = export_gguf(model, tok, tmp_path / "gguf", kind, d.name)  # type: ignore[arg-type]
    assert path == tmp_path / "gguf" / f"tiny-llama-{kind}.gguf"
    loaded, gtok = _load_gguf(path)
    rel_tol, top1_min = TOLERANCE[kind]
    for text in PROMPTS:
        ids = tok(text)["input_ids"]
        assert gtok(text)["input_ids"] == ids  # BOS, merges and split regex all read back
        ref, got = _logits(merged, ids), _logits(loaded, ids)
        assert (got - ref).abs().max() <= rel_tol * ref.abs().max(), text
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= top1_min
        if kind != "q8_0":
            assert _greedy(loaded, ids) == _greedy(merged, ids)
    assert gtok.chat_template == tok.chat_template
    reader = gguf.GGUFReader(path)
    template = reader.fields["tokenizer.chat_template"]
    assert bytes(template.parts[template.data[0]]).decode() == tok.chat_template
    modelfile = (path.parent / "Modelfile").read_text()
    assert f"FROM ./{path.name}\n" in modelfile and 'PARAMETER stop "<|eot_id|>"' in modelfile


def test_the_llama_q_and_k_rows_are_permuted_as_llama_cpp_expects(
    llama: tuple[Path, Any, Any, Any], tmp_path: Path
) -> None:
    from shoestring.train.ggufarch import permute_qk
    from shoestring.train.ggufexport import export_gguf

    d, tok, model, merged = llama
    path = export_gguf(model, tok, tmp_path, "f16", d.name)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    attn = merged.model.layers[0].self_attn
    for gguf_name, weight, heads in (
        ("blk.0.attn_q.weight", attn.q_proj.weight, 4),
        ("blk.0.attn_k.weight", attn.k_proj.weight, 2),
    ):
        stored = torch.from_numpy(tensors[gguf_name].data.astype("float32"))
        assert torch.allclose(stored, permute_qk(weight.detach(), heads).half().float())
        assert not torch.allclose(stored, weight.detach().half().float())
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32


def test_a_tied_qwen2_with_biases_exports_and_loads(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from shoestring.train.ggufexport import export_gguf

    d = tiny_model_dir(tmp_path / "tiny-qwen2", "qwen2", tied=True)
    tok, model = AutoTokenizer.from_pretrained(d), _adapted(d)
    path = export_gguf(model, tok, tmp_path / "gguf", "q8_0", d.name)
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert "output.weight" not in names and "blk.0.attn_q.bias" in names  # tied; biases kept
    gtok = _reads_back(model, tok, path, "q8_0", greedy=False)
    assert gtok.chat_template == tok.chat_template
    assert 'PARAMETER stop "<|im_end|>"' in (path.parent / "Modelfile").read_text()


def test_a_qwen3_with_q_and_k_norms_exports_and_loads(tmp_path: Path) -> None:
    """Qwen3 (llama.cpp's QWEN3: Qwen2's layout without biases, RMS norms on each head's
    q and k) reads back as the adapted model, its q/k norms as written."""
    from transformers import AutoTokenizer

    from shoestring.train.ggufexport import export_gguf

    d = tiny_model_dir(tmp_path / "tiny-qwen3", "qwen3")
    tok, model = AutoTokenizer.from_pretrained(d), _adapted(d)
    path = export_gguf(model, tok, tmp_path / "gguf", "f16", d.name)
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    assert "blk.1.attn_k_norm.weight" in tensors and "blk.0.attn_q.bias" not in tensors
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "qwen3"
    q_norm = model.get_base_model().model.layers[1].self_attn.q_norm.weight.detach()
    stored = torch.from_numpy(tensors["blk.1.attn_q_norm.weight"].data.astype("float32"))
    assert torch.equal(stored, q_norm) and not torch.equal(q_norm, torch.ones_like(q_norm))
    _reads_back(model, tok, path, "f16")


def _field(reader: Any, key: str) -> list[Any]:
    """A GGUF metadata array (or one value) as Python values."""
    f = reader.fields[key]
    return [f.contents(i) for i in range(len(f.data))] if len(f.data) > 1 else [f.contents()]


def test_a_mistral_with_a_sentencepiece_tokenizer_exports_and_loads(tmp_path: Path) -> None:
    """Mistral (llama.cpp's LLAMA, q/k permuted) with a SentencePiece ``tokenizer.model``
    (Llama 2's and Mistral 7B's kind): written as convert_hf_to_gguf writes one, every
    piece with its score and type, the added special token CONTROL, the rows past them
    ``[PAD<id>]``; it reads back as the adapted model, tokenizing every prompt (bytes
    outside the pieces too) as the trained tokenizer does."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    from shoestring.train.ggufexport import export_gguf
    from shoestring.train.ggufspm import sentencepiece_model

    d = tiny_model_dir(tmp_path / "tiny-mistral", "mistral")
    tok, model = AutoTokenizer.from_pretrained(d), _adapted(d)
    spm_path = sentencepiece_model(d)
    assert spm_path is not None and not (tmp_path / "saved" / "tokenizer.model").exists()
    path = export_gguf(model, tok, tmp_path / "gguf", "f16", d.name, spm_path)
    gtok = _reads_back(model, tok, path, "f16")
    for text in ("Ünïcode ∑ 123", "[INST] hi [/INST]"):  # byte fallback; the template's text
        assert gtok(text)["input_ids"] == tok(text)["input_ids"]
    assert gtok.chat_template == tok.chat_template

    reader = gguf.GGUFReader(path)
    assert _field(reader, "tokenizer.ggml.model") == ["llama"]
    assert _field(reader, "general.architecture") == ["llama"]
    tokens, types = (
        _field(reader, "tokenizer.ggml.tokens"),
        _field(reader, "tokenizer.ggml.token_type"),
    )
    scores = _field(reader, "tokenizer.ggml.scores")
    sp = spm.SentencePieceProcessor(model_file=str(spm_path))
    assert len(tokens) == len(scores) == model.config.vocab_size == 448
    assert tokens[: sp.vocab_size()] == [sp.IdToPiece(i) for i in range(sp.vocab_size())]
    n = sp.vocab_size()
    assert scores[3:n] == pytest.approx([sp.GetScore(i) for i in range(3, n)])
    T = gguf.TokenType  # <unk> <s> </s> are the tokenizer's added tokens: convert's CONTROL
    assert [types[i] for i in (0, 1, 2, 3, 300)] == [T.CONTROL] * 3 + [T.BYTE, T.NORMAL]
    assert scores[:3] == [-1000.0] * 3
    added = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    assert (tokens[added], types[added]) == ("[TOOL_CALLS]", T.CONTROL)
    assert (tokens[447], types[447], scores[447]) == ("[PAD447]", T.UNUSED, -10000.0)
    assert _field(reader, "tokenizer.ggml.bos_token_id") == [1]
    assert 'PARAMETER stop "</s>"' in (path.parent / "Modelfile").read_text()


def test_a_mistral_with_a_sliding_window_is_refused_by_name() -> None:
    from shoestring.train.ggufarch import check_arch

    v01 = {"model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 32768}
    with pytest.raises(ConfigError, match="sliding window of 4096 tokens"):
        check_arch(v01, "export.gguf")
    assert check_arch({**v01, "sliding_window": None}, "export.gguf") == "mistral"


def test_a_gemma3_exports_with_its_norms_shifted_and_loads(tmp_path: Path) -> None:
    """Gemma 3 (llama.cpp's GEMMA3, 270M/1B): its norm weights stored plus one (llama.cpp
    multiplies by them, transformers by 1 + weight), the head tied, the window in the
    metadata, the SentencePiece tokenizer without a space prefix; it reads back as the
    adapted model, greedy tokens and tokenization included."""
    from transformers import AutoTokenizer

    from shoestring.train.ggufexport import export_gguf
    from shoestring.train.ggufspm import sentencepiece_model

    d = tiny_model_dir(tmp_path / "tiny-gemma3", "gemma3_text")
    tok, model = AutoTokenizer.from_pretrained(d), _adapted(d)
    path = export_gguf(model, tok, tmp_path / "gguf", "f16", d.name, sentencepiece_model(d))
    gtok = _reads_back(model, tok, path, "f16")
    assert gtok("<start_of_turn>user hi")["input_ids"] == tok("<start_of_turn>user hi")["input_ids"]
    assert gtok.chat_template == tok.chat_template
    reader = gguf.GGUFReader(path)
    assert _field(reader, "general.architecture") == ["gemma3"]
    assert _field(reader, "gemma3.attention.sliding_window") == [16]
    assert _field(reader, "tokenizer.ggml.add_space_prefix") == [False]
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors and "blk.5.post_ffw_norm.weight" in tensors
    norm = model.get_base_model().model.layers[2].self_attn.k_norm.weight.detach()
    stored = torch.from_numpy(tensors["blk.2.attn_k_norm.weight"].data.astype("float32"))
    assert torch.equal(stored, norm.float() + 1) and not torch.equal(norm, torch.zeros_like(norm))
    assert 'PARAMETER stop "<end_of_turn>"' in (path.parent / "Modelfile").read_text()


def test_a_gemma3_with_a_vision_tower_exports_its_text_model_and_loads(tmp_path: Path) -> None:
    """Gemma 3 from 4B up (``Gemma3ForConditionalGeneration``): the GGUF holds its text
    model, as llama.cpp's converter writes it (the tower goes to an mmproj file, not
    written here): no vision tensor, the decoder's under their llama.cpp names; it reads
    back as the adapted model on text."""
    from transformers import AutoTokenizer

    from shoestring.train.ggufexport import check_model_dir, export_gguf
    from shoestring.train.ggufspm import sentencepiece_model

    d = tiny_model_dir(tmp_path / "tiny-gemma3-vision", "gemma3")
    check_model_dir(d, "export.gguf")  # the pre-training check takes it too
    tok, model = AutoTokenizer.from_pretrained(d), _adapted(d)
    assert type(model.get_base_model()).__name__ == "Gemma3ForConditionalGeneration"
    path = export_gguf(model, tok, tmp_path / "gguf", "f16", d.name, sentencepiece_model(d))
    _reads_back(model, tok, path, "f16")
    reader = gguf.GGUFReader(path)
    assert _field(reader, "general.architecture") == ["gemma3"]
    names = {t.name for t in reader.tensors}
    assert "blk.5.attn_q.weight" in names and "token_embd.weight" in names
    assert not [n for n in names if n.startswith(("v.", "mm."))]  # llama.cpp's mmproj names
    assert len(names) == 2 + 6 * 13  # embeddings and output norm; 13 tensors a layer


def test_a_gemma3_llama_cpp_would_run_otherwise_is_refused_by_name() -> None:
    from transformers import Gemma3TextConfig

    from shoestring.train.ggufarch import check_arch

    ok = Gemma3TextConfig(num_hidden_layers=6, head_dim=256, query_pre_attn_scalar=256)
    assert check_arch(ok.to_dict(), "export.gguf") == "gemma3_text"
    odd = Gemma3TextConfig(num_hidden_layers=6, head_dim=128, query_pre_attn_scalar=256,
                           layer_types=["sliding_attention", "full_attention"] * 3)  # fmt: skip
    with pytest.raises(ConfigError, match="layer_types .*; query_pre_attn_scalar"):
        check_arch(odd.to_dict(), "export.gguf")


def test_a_phi3_exports_its_fused_projections_and_loads(tmp_path: Path) -> None:
    """Phi-3 (llama.cpp's PHI3): LoRA on the fused q/k/v and gate/up merged into them,
    stored fused (``attn_qkv``, ``ffn_up``), nothing permuted; it reads back as the
    adapted model."""
    from transformers import AutoTokenizer

    from shoestring.train.ggufexport import export_gguf
    from shoestring.train.ggufspm import sentencepiece_model

    d = tiny_model_dir(tmp_path / "tiny-phi3", "phi3")
    tok, model = AutoTokenizer.from_pretrained(d), _adapted(d)
    assert {"qkv_proj", "gate_up_proj"} <= set(model.peft_config["default"].target_modules)
    path = export_gguf(model, tok, tmp_path / "gguf", "f16", d.name, sentencepiece_model(d))
    _reads_back(model, tok, path, "f16")
    reader = gguf.GGUFReader(path)
    tensors = {t.name for t in reader.tensors}
    assert {"blk.1.attn_qkv.weight", "blk.1.ffn_up.weight"} <= tensors
    assert _field(reader, "general.architecture") == ["phi3"]
    assert _field(reader, "phi3.rope.dimension_count") == [32]  # hidden 128 / 4 heads
    assert _field(reader, "phi3.attention.sliding_window") == [0]


def test_a_phi4_mini_style_rope_is_written_as_the_converter_writes_it(tmp_path: Path) -> None:
    """Three quarters of each head rotated, LongRoPE: the rotated features per head, the
    pretraining context, the attention factor sqrt(1 + ln(scale) / ln(context)) and the
    long and short factor tables (F32), as convert_hf_to_gguf's Phi3MiniModel writes
    them. transformers' GGUF reader reads none of these back, so they are checked here."""
    import math

    from transformers import AutoTokenizer

    from shoestring.train.ggufexport import export_gguf
    from shoestring.train.ggufspm import sentencepiece_model

    longrope = {"type": "longrope", "long_factor": [1.0 + i / 10 for i in range(12)],
                "short_factor": [1.0] * 12}  # fmt: skip
    keys = {"partial_rotary_factor": 0.75, "max_position_embeddings": 4096,
            "original_max_position_embeddings": 256, "rope_scaling": longrope}  # fmt: skip
    d = tiny_model_dir(tmp_path / "tiny-phi4", "phi3", rope=keys)
    tok, model = AutoTokenizer.from_pretrained(d), _adapted(d)
    path = export_gguf(model, tok, tmp_path / "gguf", "f16", d.name, sentencepiece_model(d))
    reader = gguf.GGUFReader(path)
    assert _field(reader, "phi3.rope.dimension_count") == [24]
    assert _field(reader, "phi3.rope.scaling.original_context_length") == [256]
    attn = _field(reader, "phi3.rope.scaling.attn_factor")[0]
    assert attn == pytest.approx(math.sqrt(1 + math.log(16) / math.log(256)))
    tables = {t.name: t for t in reader.tensors}
    long = tables["rope_factors_long.weight"].data.tolist()
    assert long == pytest.approx(longrope["long_factor"])
    assert tables["rope_factors_short.weight"].data.tolist() == [1.0] * 12


def test_a_qwen3_moe_exports_its_adapted_experts_stacked_and_loads(tmp_path: Path) -> None:
    """Qwen3-MoE (QWEN3MOE) with LoRA on its fused experts: each layer's experts stacked
    as llama.cpp's converter stacks them (gate, up and down, each experts x rows x
    columns), the expert counts in the metadata; it reads back as the adapted model."""
    from transformers import AutoTokenizer

    from gguf_fixtures import EXPERTS
    from shoestring.train.ggufexport import export_gguf

    d = tiny_model_dir(tmp_path / "tiny-qwen3-moe", "qwen3_moe")
    tok, model = AutoTokenizer.from_pretrained(d), _adapted(d, EXPERTS)
    path = export_gguf(model, tok, tmp_path / "gguf", "f16", d.name)
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    assert {f"blk.1.ffn_{w}_exps.weight" for w in ("gate", "up", "down")} <= tensors.keys()
    assert "blk.0.ffn_gate_inp.weight" in tensors
    assert tensors["blk.0.ffn_gate_exps.weight"].data.shape == (4, 768, 128)
    assert tensors["blk.0.ffn_down_exps.weight"].data.shape == (4, 128, 768)
    count = reader.fields["qwen3moe.expert_count"]
    assert int(count.parts[count.data[0]][0]) == 4
    merged = copy.deepcopy(model).merge_and_unload()
    up = merged.model.layers[1].mlp.experts.gate_up_proj.detach()[:, 768:]
    stored = torch.from_numpy(tensors["blk.1.ffn_up_exps.weight"].data.astype("float32"))
    assert torch.equal(stored, up.half().float())  # the merged up half, expert by expert
    _reads_back(model, tok, path, "f16")


#: Llama 3.1's RoPE scaling with a context small enough for the tiny head_dim (32) to
#: have frequencies in all three bands (wavelength < 16, 16..64, > 64).
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def test_llama3_rope_is_written_as_rope_freqs_and_reads_back(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from shoestring.train.ggufexport import check_model_dir, export_gguf

    d = tiny_model_dir(tmp_path / "tiny-llama31", "llama", rope=LLAMA3_ROPE)
    check_model_dir(d, "export.gguf")  # no longer refused
    tok, model = AutoTokenizer.from_pretrained(d), _adapted(d)
    merged = copy.deepcopy(model).merge_and_unload().eval()
    path = export_gguf(model, tok, tmp_path / "gguf", "f16", d.name)

    reader = gguf.GGUFReader(path)
    freqs = reader.tensors[0]  # convert's extra tensors come first
    assert freqs.name == "rope_freqs.weight"
    assert freqs.tensor_type == gguf.GGMLQuantizationType.F32
    written = torch.from_numpy(freqs.data.astype("float32"))
    assert not [k for k in reader.fields if ".rope.scaling." in k]  # as convert: none
    config = merged.config
    default, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    llama3, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    wavelen = 2 * torch.pi / default
    assert (wavelen < 16).any() and (wavelen > 64).any()
    assert ((wavelen > 16) & (wavelen < 64)).any()  # high, low and smoothed bands all hit
    assert written.shape == (16,)
    assert torch.allclose(written, default / llama3, rtol=1e-6, atol=0)

    # transformers' GGUF loader reads no llama3 scaling for llama (llama.cpp takes it from
    # rope_freqs): give the loaded config the original RoPE parameters back (transformers
    # 5's name for rope_scaling) before comparing with the merged model.
    cfg = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    cfg.rope_parameters = dict(LLAMA3_ROPE)
    loaded = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=cfg, dtype=torch.float32
    ).eval()
    gtok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in PROMPTS:
        ids = tok(text)["input_ids"]
        assert gtok(text)["input_ids"] == ids
        ref, got = _logits(merged, ids), _logits(loaded, ids)
        assert (got - ref).abs().max() <= TOLERANCE["f16"][0] * ref.abs().max(), text
    assert gtok.chat_template == tok.chat_template
    unscaled, _ = _load_gguf(path)  # as the loader reads it: measurably off (0.6-1.2%)
    ref, got = _logits(merged, ids), _logits(unscaled, ids)
    assert (got - ref).abs().max() > 2 * TOLERANCE["f16"][0] * ref.abs().max()


def _finetune_cfg(model_path: str, kind: str = "q8_0") -> Any:
    from shoestring.config import load
    from shoestring.train.config import FinetuneConfig

    return load(FinetuneConfig, None, ["--model.path", model_path, "--export.gguf", kind])


def test_unsupported_architectures_and_tokenizers_are_refused_by_name(tmp_path: Path) -> None:
    from shoestring.train.builtin import materialize_tiny_model
    from shoestring.train.ggufexport import check_exportable, check_model_dir

    falcon = tmp_path / "falcon"
    falcon.mkdir()
    (falcon / "config.json").write_text(json.dumps({"model_type": "falcon"}))
    with pytest.raises(ConfigError, match="export.gguf: model_type 'falcon' has no GGUF export"):
        check_exportable(_finetune_cfg(str(falcon)), falcon)
    with pytest.raises(ConfigError, match="built-in tiny model's byte tokenizer"):
        check_exportable(_finetune_cfg("builtin:tiny"), None)
    builtin = materialize_tiny_model(tmp_path / "cache")  # its tokenizer.json: no merges
    with pytest.raises(ConfigError, match="without merges"):
        check_model_dir(builtin, "export.gguf")
    check_exportable(_finetune_cfg("builtin:tiny", "none"), None)  # not asked: no check


@pytest.mark.parametrize(
    ("model_type", "rope_type"), [("llama", "yarn"), ("llama", "dynamic"), ("qwen2", "llama3")]
)
def test_rope_types_without_an_export_are_refused_by_name(model_type: str, rope_type: str) -> None:
    from shoestring.train.ggufarch import check_arch

    cfg = {"model_type": model_type, "rope_theta": 5e5, "rope_scaling": {"rope_type": rope_type}}
    with pytest.raises(ConfigError, match=f"{model_type} with RoPE type '{rope_type}' is not"):
        check_arch(cfg, "export.gguf")
    llama31 = {"rope_scaling": {**LLAMA3_ROPE, "original_max_position_embeddings": 8192}}
    assert check_arch({"model_type": "llama", **llama31}, "export.gguf") == "llama"


#: A child that exports and SIGKILLs itself halfway through the tensors.
KILLED_EXPORT = """
import os, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import shoestring.train.ggufexport as ge
from gguf_fixtures import adapted_model
from transformers import AutoTokenizer

real, calls = ge._write_data, [0]
def dying(writer, plan, t):
    calls[0] += 1
    if calls[0] == 8:
        os.kill(os.getpid(), 9)
    real(writer, plan, t)
ge._write_data = dying
d = Path(sys.argv[2])
ge.export_gguf(adapted_model(d), AutoTokenizer.from_pretrained(d), Path(sys.argv[3]), "f16", d.name)
"""


@pytest.mark.e2e
def test_a_killed_export_leaves_no_file_that_looks_like_the_output(
    llama: tuple[Path, Any, Any, Any], tmp_path: Path
) -> None:
    import subprocess
    import sys

    from shoestring.train.ggufexport import export_gguf

    d, tok, model, merged = llama
    out = tmp_path / "gguf"
    args = [sys.executable, "-c", KILLED_EXPORT, str(Path(__file__).parent), str(d), str(out)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, r.stderr
    leftovers = [p for p in out.rglob("*") if p.is_file()]
    assert leftovers and all(
        p.relative_to(out).parts[0].startswith(".tmp-gguf-") for p in leftovers
    )
    assert not list(out.glob("*.gguf")) and not (out / "Modelfile").exists()
    path = export_gguf(model, tok, out, "f16", d.name)
    assert sorted(p.name for p in out.iterdir()) == ["Modelfile", path.name]  # temp pruned
    loaded, _ = _load_gguf(path)
    ids = tok(PROMPTS[0])["input_ids"]
    assert torch.allclose(_logits(loaded, ids), _logits(merged, ids), atol=1e-2)


# --------------------------------------------------------------------------- the CLI

SHORT = [
    "--train.max_steps",
    "2",
    "--train.batch_size",
    "2",
    "--train.num_threads",
    "1",
    "--train.warmup_steps",
    "0",
    "--data.max_length",
    "32",
    "--data.eval",
    "",
    "--plan.gpu",
    "none",
]


@pytest.mark.e2e
def test_finetune_exports_gguf_and_the_export_verb_exports_a_preempted_run(
    cli: CLI, tmp_path: Path
) -> None:
    import subprocess
    import sys

    d = tiny_model_dir(tmp_path / "tiny-llama", "llama")
    out = tmp_path / "run"
    r = cli.run(out, "--model.path", str(d), *SHORT, "--export.gguf", "q8_0")
    assert r.returncode == 0, r.stderr
    path = out / "gguf" / "tiny-llama-q8_0.gguf"
    end = [e for e in read_events(out) if e.get("event") == "run_end"][-1]
    assert end["gguf"] == str(path)
    loaded, gtok = _load_gguf(path)
    assert gtok.chat_template is not None and gtok.eos_token == "<|eot_id|>"

    # A run killed at step 3 (checkpoint at step 2, no final/): export its checkpoint.
    killed = tmp_path / "killed"
    r = cli.run(
        killed,
        "--model.path",
        str(d),
        *SHORT,
        "--train.max_steps",
        "6",
        "--checkpoint.every_steps",
        "2",
        "--checkpoint.async_mode",
        "off",
        env={"SHOESTRING_FAULTS": "step.end@3:kill"},
    )
    assert r.returncode != 0 and not (killed / "final").exists()
    r = subprocess.run(
        [sys.executable, "-m", "shoestring", "export", str(killed), "--gguf", "f16"],
        env=cli.env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "checkpoint step-00000002" in r.stderr
    exported, _ = _load_gguf(killed / "gguf" / "tiny-llama-f16.gguf")
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = gtok(PROMPTS[0])["input_ids"]
    assert not torch.allclose(_logits(exported, ids), _logits(base, ids), atol=1e-4)  # adapted


@pytest.mark.e2e
def test_finetune_refuses_gguf_of_the_builtin_model_before_training(
    cli: CLI, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    r = cli.run(out, *SHORT, "--export.gguf", "q8_0")
    assert r.returncode == 2
    assert "export.gguf: the built-in tiny model's byte tokenizer" in r.stderr
    assert not (out / "checkpoints").exists()
