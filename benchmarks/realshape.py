"""Real-shape random-init models, written without ever holding them in memory.

A Llama-2-7B has 6.7 billion parameters (13.5 GB in bf16); building it with
``from_config`` + ``save_pretrained`` needs the whole model in RAM twice over. Here
the tensor names and shapes come from transformers itself (the model instantiated
on the meta device), and each tensor is generated in row blocks, from its own
seeded generator, straight into sharded safetensors files with an index, as the
Hub's checkpoints are laid out. Peak memory is one row block (64 MiB of fp32).

``materialize(name)`` is what the scale benchmark (and the GPU check) use;
``init_tensor`` is the same values for a whole tensor, so a test can build the
identical model in memory and compare.

    .venv/bin/python benchmarks/realshape.py llama2-7b   # prints the model dir
    .venv/bin/python benchmarks/realshape.py --fp8 llama2-7b   # and its FP8 save
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:  # run from a checkout without `pip install -e`
    sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from shoestring.stwriter import TensorSpec, write_sharded  # noqa: E402

DEFAULT_CACHE = Path(
    os.environ.get("SHOESTRING_BENCH_CACHE", Path.home() / ".cache" / "shoestring")
)
INIT_STD = 0.02
LM_HEAD_STD = 0.15  # as the built-in model: a confident head, so greedy tokens are clear
ROW_BLOCK_ELEMS = 16 << 20  # fp32 elements generated at once (64 MiB)
_FORMAT = 1  # bump when the init scheme or layout changes: old dirs are rebuilt


@dataclass(frozen=True)
class Shape:
    """A decoder's published shape (Llama family; GQA when kv_heads < heads; with
    ``experts``, a mixture-of-experts ``model_type`` whose ``ffn`` is one expert's)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    max_positions: int
    rope_theta: float
    inference_only: bool = False
    shard_bytes: int = 2 << 30  # as the Hub's checkpoints: several shards and an index
    model_type: str = "llama"
    experts: int = 0
    experts_per_token: int = 0
    head_dim: int = 0  # 0: hidden // heads
    mxfp4: bool = False  # experts stored MXFP4, as openai/gpt-oss-* are

    def config(self, tokenizer_ids: dict[str, int]) -> Any:
        from transformers import AutoConfig, LlamaConfig

        common = dict(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.ffn,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=self.max_positions,
            tie_word_embeddings=False,
            initializer_range=INIT_STD,
            dtype="bfloat16",
            **tokenizer_ids,
        )
        routed = dict(num_experts_per_tok=self.experts_per_token)
        if self.model_type == "gemma3_text":  # its own rope (1M global, 10k local) defaults
            head_dim = self.head_dim or self.hidden // self.heads
            return AutoConfig.for_model(
                "gemma3_text", **{**common, "tie_word_embeddings": True}, head_dim=head_dim,
                query_pre_attn_scalar=head_dim, sliding_window=512, rms_norm_eps=1e-6,
            )  # fmt: skip
        if self.model_type == "gemma3":  # 4B and up: the decoder beside a SigLIP tower
            head_dim = self.head_dim or self.hidden // self.heads
            text = AutoConfig.for_model(
                "gemma3_text", **{**common, "tie_word_embeddings": True}, head_dim=head_dim,
                query_pre_attn_scalar=head_dim, sliding_window=1024, rms_norm_eps=1e-6,
                rope_scaling={"rope_type": "linear", "factor": 8.0},
            )  # fmt: skip
            return AutoConfig.for_model(
                "gemma3", text_config=text.to_dict(), vision_config=SIGLIP_GEMMA3,
                mm_tokens_per_image=256, initializer_range=INIT_STD, dtype="bfloat16",
            )  # fmt: skip
        if self.model_type == "phi3":  # Phi-4-mini: 3/4 rotary, LongRoPE from 4k
            pairs = int(self.hidden // self.heads * 0.75) // 2
            longrope = {"type": "longrope", "long_factor": [1.0] * pairs,
                        "short_factor": [1.0] * pairs}  # fmt: skip
            return AutoConfig.for_model(
                "phi3", **{**common, "tie_word_embeddings": True}, partial_rotary_factor=0.75,
                original_max_position_embeddings=4096, rope_scaling=longrope,
                rope_theta=self.rope_theta, rms_norm_eps=1e-5,
            )  # fmt: skip
        if self.model_type == "gpt_oss":  # its own rope (YaRN) defaults
            head_dim = self.head_dim or self.hidden // self.heads
            return AutoConfig.for_model(
                "gpt_oss", **common, **routed, head_dim=head_dim, num_local_experts=self.experts
            )
        if self.model_type == "qwen3_moe":  # head_dim 128 over 32 heads of a 2048 width
            return AutoConfig.for_model(
                "qwen3_moe", **{**common, "intermediate_size": 6144}, **routed,
                moe_intermediate_size=self.ffn, num_experts=self.experts, norm_topk_prob=True,
                head_dim=self.head_dim, rope_theta=self.rope_theta, rms_norm_eps=1e-6,
            )  # fmt: skip
        if self.experts:
            return AutoConfig.for_model(
                self.model_type,
                **common,
                **routed,
                rope_theta=self.rope_theta,
                num_experts=self.experts,
            )
        return LlamaConfig(
            **common,
            head_dim=self.hidden // self.heads,
            rope_theta=self.rope_theta,
            rms_norm_eps=1e-5,
        )


#: Gemma 3's vision tower (4B, 12B, 27B): SigLIP-So400m at 896 px, no pooling head.
SIGLIP_GEMMA3 = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                 "num_attention_heads": 16, "image_size": 896, "patch_size": 14,
                 "vision_use_head": False}  # fmt: skip

SHAPES: dict[str, Shape] = {
    # meta-llama/Llama-2-7b-hf: MHA, 32k vocabulary
    "llama2-7b": Shape(4096, 32, 32, 32, 11008, 32000, 4096, 10000.0),
    # meta-llama/Meta-Llama-3-8B: GQA 32/8, 128k vocabulary (1 GB embedding and head)
    "llama3-8b": Shape(4096, 32, 32, 8, 14336, 128256, 8192, 500000.0),
    # meta-llama/Llama-2-13b-hf: for streamed inference only (26 GB)
    "llama2-13b": Shape(5120, 40, 40, 40, 13824, 32000, 4096, 10000.0, inference_only=True),
    # allenai/OLMoE-1B-7B-0924: 64 experts of 1024, 8 routed per token (6.9B, 13.8 GB)
    "olmoe-1b-7b": Shape(
        2048,
        16,
        16,
        16,
        1024,
        50304,
        4096,
        10000.0,
        inference_only=True,
        model_type="olmoe",
        experts=64,
        experts_per_token=8,
    ),  # fmt: skip
    # openai/gpt-oss-20b: 32 experts of 2880, 4 routed per token, experts stored MXFP4
    # (21B parameters, 13.8 GB), attention sinks, sliding and full layers, 201k vocabulary
    "gpt-oss-20b": Shape(
        2880,
        24,
        64,
        8,
        2880,
        201088,
        131072,
        150000.0,
        inference_only=True,
        model_type="gpt_oss",
        experts=32,
        experts_per_token=4,
        head_dim=64,
        mxfp4=True,
    ),  # fmt: skip
    # google/gemma-3-1b-pt: 262k vocabulary (a 0.6 GB tied embedding), MQA 4/1, head_dim
    # 256, five sliding layers (512 tokens) in six; 999,885,952 parameters, 2.0 GB
    "gemma3-1b": Shape(
        1152,
        26,
        4,
        1,
        6912,
        262144,
        32768,
        1e6,
        model_type="gemma3_text",
        head_dim=256,
    ),  # fmt: skip
    # google/gemma-3-4b-it: a 262k tied vocabulary, GQA 8/4 with head_dim 256, five
    # sliding layers (1024 tokens) in six, beside a 0.42B SigLIP tower; 4,300,079,472
    # parameters, 8.6 GB
    "gemma3-4b": Shape(
        2560,
        34,
        8,
        4,
        10240,
        262208,
        131072,
        1e6,
        model_type="gemma3",
        head_dim=256,
    ),  # fmt: skip
    # microsoft/Phi-4-mini-instruct: fused q/k/v and gate/up, GQA 24/8, 3/4 of each head
    # rotated (LongRoPE, factors 1 here), a 200k tied vocabulary; 7.7 GB
    "phi4-mini": Shape(
        3072,
        32,
        24,
        8,
        8192,
        200064,
        131072,
        10000.0,
        model_type="phi3",
    ),  # fmt: skip
    # Qwen/Qwen3-30B-A3B: 48 layers of 128 experts of 768, 8 routed per token (top-k
    # renormalized), GQA 32/4 with head_dim 128 and q/k norms; 30.5B parameters, 61 GB
    "qwen3-30b-a3b": Shape(
        2048,
        48,
        32,
        4,
        768,
        151936,
        40960,
        1e6,
        model_type="qwen3_moe",
        experts=128,
        experts_per_token=8,
        head_dim=128,
    ),  # fmt: skip
    # the same structures at small widths (CI smoke; widths multiples of 64)
    "small-mha": Shape(256, 2, 4, 4, 512, 512, 512, 10000.0, shard_bytes=1 << 20),
    "small-gqa": Shape(256, 2, 4, 1, 640, 1024, 512, 500000.0, shard_bytes=1 << 20),
    "small-moe": Shape(
        256,
        2,
        4,
        4,
        128,
        512,
        512,
        10000.0,
        shard_bytes=1 << 20,
        model_type="olmoe",
        experts=4,
        experts_per_token=2,
    ),  # fmt: skip
    "small-gpt-oss": Shape(
        256,
        2,
        4,
        2,
        256,
        512,
        512,
        150000.0,
        shard_bytes=1 << 20,
        model_type="gpt_oss",
        experts=4,
        experts_per_token=2,
        head_dim=64,
        mxfp4=True,
    ),  # fmt: skip
}


def tensor_seed(seed: int, name: str) -> int:
    """Each tensor's generator seed: independent of write order and sharding."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _std(name: str) -> float | None:
    """None: a norm weight (ones)."""
    if name.endswith("norm.weight"):
        return None
    return LM_HEAD_STD if name.startswith("lm_head.") else INIT_STD


def row_blocks(
    name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype
) -> Iterator[torch.Tensor]:
    """The tensor's values, a block of leading rows at a time."""
    std = _std(name)
    rows = shape[0]
    per_row = max(1, int(torch.Size(shape[1:]).numel()))
    step = max(1, ROW_BLOCK_ELEMS // per_row)
    gen = torch.Generator().manual_seed(tensor_seed(seed, name))
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        block_shape = (n, *shape[1:])
        if std is None:
            yield torch.ones(block_shape, dtype=dtype)
        else:
            yield torch.empty(block_shape).normal_(0.0, std, generator=gen).to(dtype)


#: What gpt-oss keeps 16-bit (its published quantization_config).
MXFP4_KEEP = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
]
_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
_PACKED = {"_blocks": "blocks", "_scales": "scales"}


def mxfp4_specs(spec: TensorSpec) -> list[TensorSpec]:
    """An expert parameter (experts, in, out) as its MXFP4 blocks (experts, out, in/32,
    16) and scales (experts, out, in/32), uint8, as openai/gpt-oss-* store it."""
    if not spec.name.endswith(_EXPERTS):
        return [spec]
    experts, cols, rows = spec.shape
    return [
        TensorSpec(f"{spec.name}_blocks", (experts, rows, cols // 32, 16), torch.uint8),
        TensorSpec(f"{spec.name}_scales", (experts, rows, cols // 32), torch.uint8),
    ]


def tensor_blocks(spec: TensorSpec, seed: int) -> Iterator[torch.Tensor]:
    """A tensor's stored values, a block of leading rows at a time; MXFP4 parts an expert
    at a time: uniformly random e2m1 codes, and block exponents around INIT_STD's (a
    block's values are then 0.5-6 times 2^-9 to 2^-6: the init's magnitudes)."""
    part = next((p for p in _PACKED if spec.name.endswith(p)), None)
    if part is None:
        yield from row_blocks(spec.name, spec.shape, seed, spec.dtype)
        return
    gen = torch.Generator().manual_seed(tensor_seed(seed, spec.name))
    low, high = (0, 256) if part == "_blocks" else (127 - 9, 127 - 5)
    for _ in range(spec.shape[0]):
        yield torch.randint(low, high, (1, *spec.shape[1:]), generator=gen, dtype=torch.uint8)


def init_tensor(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """The whole tensor, equal to what :func:`row_blocks` streams (for tests)."""
    return torch.cat(list(row_blocks(name, shape, seed, dtype)), dim=0)


def model_tensors(config: Any) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint's tensor names and shapes, as transformers saves them: its load-time
    conversions reverted (an MoE model's fused experts as one tensor per expert, the
    Hub's layout), on the meta device."""
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        stored = revert_weight_conversion(model, model.state_dict())
    # save_pretrained drops a tied head (a vision-language model's text config says so)
    tied = getattr(config.get_text_config(), "tie_word_embeddings", False)
    return [
        (n, tuple(t.shape))
        for n, t in stored.items()
        if not (tied and n.endswith("lm_head.weight"))
    ]


def _tokenizer_ids() -> tuple[Any, dict[str, int]]:
    from shoestring.train.builtin import SPECIAL_TOKENS, model_tokenizer

    tok = model_tokenizer()
    pad, bos, eos = tok.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    return tok, {"pad_token_id": pad, "bos_token_id": bos, "eos_token_id": eos}


def write_model(
    target: Path,
    shape: Shape,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int | None = None,
) -> Path:
    """A Hugging Face model folder: config, generation config, the byte-level tokenizer,
    ``model-0000k-of-0000n.safetensors`` shards and ``model.safetensors.index.json``."""
    from transformers import GenerationConfig

    tok, ids = _tokenizer_ids()
    config = shape.config(ids)
    specs = [TensorSpec(name, shp, dtype) for name, shp in model_tensors(config)]
    if shape.mxfp4:
        specs = [p for s in specs for p in mxfp4_specs(s)]
        config.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": MXFP4_KEEP}
    write_sharded(
        target,
        specs,
        lambda s: tensor_blocks(s, seed),
        max_shard_bytes or shape.shard_bytes,
    )
    config.save_pretrained(target)
    GenerationConfig(**ids).save_pretrained(target)
    tok.save_pretrained(target)
    return target


def materialize(name: str, cache: Path = DEFAULT_CACHE, seed: int = 0) -> Path:
    """``cache/realshape-<name>-s<seed>-v<format>``, written once (a temporary sibling
    renamed into place, so an interrupted build is never mistaken for a model)."""
    target = cache / f"realshape-{name}-s{seed}-v{_FORMAT}"
    if (target / ".complete").is_file():
        return target
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write_model(tmp, SHAPES[name], seed=seed)
    (tmp / ".complete").write_text("ok\n")
    shutil.rmtree(target, ignore_errors=True)
    os.rename(tmp, target)
    return target


def materialize_fp8(name: str, cache: Path = DEFAULT_CACHE, seed: int = 0) -> Path:
    """The model's FP8 save (128 x 128 block scales, as the Hub's ``*-FP8`` repos and
    DeepSeek-V3 store it; transformers' own quantizer, a shard at a time), written once
    beside it the same way."""
    from shoestring.infer.fixtures import save_fp8

    return _saved_beside(
        name, "fp8", lambda base, tmp: save_fp8(base, tmp, (128, 128)), cache, seed
    )


def materialize_ctensors(
    name: str, cache: Path = DEFAULT_CACHE, seed: int = 0, scheme: str = "w4a16"
) -> Path:
    """The model's compressed-tensors save in ``scheme`` (``fixtures.CT_SCHEMES``; w4a16:
    int4, symmetric groups of 128, the Hub's RedHatAI ``*-quantized.w4a16`` layout; the
    library's own compressor, a tensor at a time), written once beside it."""
    from shoestring.infer.fixtures import save_ctensors

    group = 128 if scheme == "w4a16" else None  # the Hub's group (tests: 64)

    def save(base: Path, tmp: Path) -> Path:
        return save_ctensors(base, tmp, scheme, group=group)

    return _saved_beside(name, scheme, save, cache, seed)


def _saved_beside(
    name: str, suffix: str, save: Callable[[Path, Path], Path], cache: Path, seed: int
) -> Path:
    base = materialize(name, cache, seed)
    target = base.with_name(f"{base.name}-{suffix}")
    if (target / ".complete").is_file():
        return target
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save(base, tmp)
    (tmp / ".complete").unlink(missing_ok=True)  # copied from the base: not yet
    (tmp / ".complete").write_text("ok\n")
    shutil.rmtree(target, ignore_errors=True)
    os.rename(tmp, target)
    return target


if __name__ == "__main__":
    kinds: dict[str, Callable[[str], Path]] = {"--fp8": materialize_fp8}
    for scheme in ("w4a16", "fp8-weights", "fp8-dynamic"):  # static scales need calibration
        kinds[f"--{scheme}"] = functools.partial(materialize_ctensors, scheme=scheme)
    make = next((kinds[a] for a in sys.argv[1:] if a in kinds), materialize)
    for arg in [a for a in sys.argv[1:] if a not in kinds] or ["small-mha"]:
        print(make(arg))
