"""Random-init decoder models saved like real checkpoints, for tests and benchmarks.

Built from a config with ``save_pretrained`` (sharded safetensors) plus the
built-in byte-level tokenizer, so no downloads are needed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ARCHS = ("llama", "mistral", "qwen2")


def build_random_model(
    target: Path,
    arch: str = "llama",
    *,
    hidden: int = 128,
    layers: int = 4,
    ffn: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    dtype: torch.dtype = torch.float32,
    shard: str = "200KB",
    init_std: float = 0.2,
    seed: int = 0,
    tie: bool = False,
    context: int = 1024,
    vocab: int = 0,
    **extra: Any,
) -> Path:
    """Write a random ``arch`` model with the byte tokenizer into ``target`` (``gemma3``:
    the vision-language one, ``extra`` a ``gemma3_text`` config and ``vision_config``).

    ``init_std`` well above the usual 0.02 makes the logits peaked, so greedy
    tokens are decided by clear margins and exactness tests are not at the mercy
    of near-ties.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from shoestring.train.builtin import SPECIAL_TOKENS, build_tokenizer

    tok = build_tokenizer()
    pad_id, bos_id, eos_id = tok.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    vocab = vocab or -(-len(tok) // 64) * 64  # more rows than the tokenizer: a real size
    config = AutoConfig.for_model(
        "gemma3_text" if arch == "gemma3" else arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=context,
        initializer_range=init_std,
        tie_word_embeddings=tie,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        **{k: v for k, v in extra.items() if k != "vision_config"},
    )
    if arch == "gemma3":
        config = _with_tower(config, extra["vision_config"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    gen = model.generation_config
    gen.pad_token_id, gen.bos_token_id, gen.eos_token_id = pad_id, bos_id, eos_id
    model.save_pretrained(target, max_shard_size=shard)
    tok.save_pretrained(target)
    return target


def _with_tower(text: Any, vision: dict[str, Any]) -> Any:
    """A vision-language Gemma 3 (4B and up): the decoder ``text`` beside a tower."""
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "gemma3", text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=4,
        initializer_range=text.initializer_range, tie_word_embeddings=text.tie_word_embeddings,
    )  # fmt: skip


def save_fp8(
    base: Path,
    dest: Path,
    block: tuple[int, int] = (128, 128),
    scale_dtype: torch.dtype = torch.float32,
) -> Path:
    """``base`` saved as the Hub's FP8 checkpoints are (DeepSeek-V3, ``*-FP8``): each
    decoder-layer weight that divides into ``block``-sized blocks quantized by
    transformers' own ``Fp8Quantize`` (float8_e4m3fn codes and ``weight_scale_inv``, in
    ``scale_dtype``), the rest as stored; shards, index and tokenizer kept."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.auto import AutoHfQuantizer
    from transformers.utils.quantization_config import FineGrainedFP8Config

    config = FineGrainedFP8Config(weight_block_size=block)
    op: Any = Fp8Quantize(AutoHfQuantizer.from_config(config, pre_quantized=True))

    def stored(key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        parts: dict[str, torch.Tensor] = (
            op.convert({key: t}) if ".layers." in key and t.ndim >= 2 else {key: t}
        )
        scale = f"{key}_scale_inv"
        if scale in parts:
            parts[scale] = parts[scale].to(scale_dtype)
        return parts

    return _saved_as(base, dest, stored, {**config.to_dict(), "quant_method": "fp8"})


def save_mxfp4(base: Path, dest: Path) -> Path:
    """``base`` (a gpt-oss) saved as openai/gpt-oss-* are: each layer's experts
    (``mlp.experts.gate_up_proj`` and ``down_proj``) as MXFP4 ``_blocks`` (two e2m1
    values a byte, 32 a block) and ``_scales`` (a power-of-two exponent per block, +127),
    laid out as transformers' loader reads them; everything else as stored."""

    def stored(key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if not key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            return {key: t}
        blocks, scales = mxfp4_pack(t.transpose(-1, -2))
        return {f"{key}_blocks": blocks, f"{key}_scales": scales}

    keep = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens"]
    return _saved_as(base, dest, stored, {"quant_method": "mxfp4", "modules_to_not_convert": keep})


def _saved_as(
    base: Path,
    dest: Path,
    stored: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
    quantization: dict[str, Any],
) -> Path:
    """``base`` written to ``dest`` shard by shard, each tensor as ``stored`` gives it,
    with its config's ``quantization_config`` set; the index and tokenizer kept."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    dest.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for shard in sorted(base.glob("*.safetensors")):
        out = {k: v for key, t in load_file(shard).items() for k, v in stored(key, t).items()}
        save_file(out, dest / shard.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, shard.name))
    if (base / "model.safetensors.index.json").exists():
        index = {"metadata": {}, "weight_map": weight_map}
        (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    doc = json.loads((base / "config.json").read_text())
    if quantization:
        doc["quantization_config"] = quantization
    (dest / "config.json").write_text(json.dumps(doc, indent=2))
    written = ("config.json", "model.safetensors.index.json")
    for f in base.iterdir():
        if f.suffix != ".safetensors" and f.name not in written:
            shutil.copy(f, dest / f.name)
    return dest


def mxfp4_pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` (..., rows, cols) as MXFP4 blocks (..., rows, cols/32, 16) and scales (...,
    rows, cols/32): each block of 32 scaled by a power of two so its largest value is
    at most the format's largest (6), each value the nearest e2m1 code (low nibble
    first, as transformers' dequantizer reads them)."""
    g = w.float().reshape(*w.shape[:-1], -1, 32)
    exp = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=2.0**-100) / 6))
    scaled = g / torch.exp2(exp)[..., None]
    # e2m1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6: codes 0-7 by the midpoints; sign: +8
    code = torch.bucketize(scaled.abs(), _E2M1_MIDPOINTS) + 8 * (scaled < 0)
    code = code.to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8)


_E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


#: compressed-tensors schemes of :func:`save_ctensors`: the library's preset, the changes
#: to its weight args, and whether its input-activation args are kept.
CT_SCHEMES: dict[str, tuple[str, dict[str, Any], bool]] = {
    "w4a16": ("W4A16", {"group_size": 64}, True),  # the Hub's *-quantized.w4a16 (group 128)
    "w4a16-asym": ("W4A16_ASYM", {"group_size": 64}, True),
    "w8a16": ("W8A16", {"strategy": "channel", "group_size": None}, True),  # *-quantized.w8a16
    "fp8-weights": ("FP8_DYNAMIC", {}, False),
    "fp8-dynamic": ("FP8_DYNAMIC", {}, True),  # *-FP8-dynamic: per-token FP8 activations
    "w8a8": ("W8A8", {}, True),  # *-quantized.w8a8: per-token int8 activations
    "fp8-static": ("FP8", {}, True),  # *-FP8: calibrated per-tensor input scales
    "fp8-block": ("FP8_BLOCK", {"block_structure": [64, 64]}, True),  # *-FP8-block (128)
    "nvfp4a16": ("NVFP4A16", {}, True),  # *-NVFP4A16: FP4 groups of 16, FP8 scales
    "nvfp4": ("NVFP4", {}, True),  # *-NVFP4: and FP4 inputs per 16 under a global scale
    "mxfp4a16": ("MXFP4A16", {}, True),  # MXFP4 groups of 32, power-of-two scales
    "mxfp4": ("MXFP4", {}, True),  # and MXFP4 inputs per group of 32
}


def save_ctensors(base: Path, dest: Path, scheme: str = "w4a16", group: int | None = None) -> Path:
    """``base`` saved as llm-compressor saves a model with compressed-tensors (the Hub's
    RedHatAI ``*-quantized.w4a16`` layout), a tensor at a time: every decoder-layer
    Linear weight quantized with ``CT_SCHEMES[scheme]`` (min-max scales per group, row
    or tensor, what an observer would find by compressed-tensors' ``calculate_qparams``)
    and compressed by the scheme's own compressor; a static input scale from the range
    each Linear's input takes on calibration tokens (:func:`input_qparams`); the
    ``quantization_config`` written by its ``ModelCompressor``; everything else as
    stored (shards, index, tokenizer). ``group``: another group size than the scheme's."""
    from compressed_tensors.compressors import BaseCompressor, ModelCompressor

    config = ct_config(scheme, group)
    target = config.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(target.format)
    inputs = target.input_activations
    static = (
        input_qparams(base, inputs) if inputs is not None and inputs.dynamic is not True else {}
    )

    def stored(key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if not (".layers." in key and key.endswith("proj.weight") and t.ndim == 2):
            return {key: t}
        module = key.removesuffix(".weight")
        state = {"weight": t, **min_max_qparams(t, target.weights)}
        packed = compressor.compress(state, target)
        scales = {k: _scale_dtype(k, v, t.dtype) for k, v in static.get(module, {}).items()}
        return {f"{module}.{k}": v for k, v in {**packed, **scales}.items()}

    _saved_as(base, dest, stored, {})
    ModelCompressor(quantization_config=config).update_config(str(dest))
    return dest


def _scale_dtype(name: str, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An input scale as compressed-tensors keeps it: in the model's dtype; a global
    scale in float32."""
    return v if name.endswith("global_scale") else v.to(dtype)


def ct_config(scheme: str, group_size: int | None = None) -> Any:
    """The compressed-tensors ``QuantizationConfig`` of ``CT_SCHEMES[scheme]`` (with
    ``group_size`` if given) on every Linear but the head, its format inferred as the
    library infers it."""
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationStatus,
        preset_name_to_scheme,
    )

    preset, changes, inputs = CT_SCHEMES[scheme]
    target = preset_name_to_scheme(preset, ["Linear"])
    changes = {**changes, **({"group_size": group_size} if group_size else {})}
    assert target.weights is not None
    target.weights = QuantizationArgs(**{**target.weights.model_dump(), **changes})
    if not inputs:
        target.input_activations = None
    target.format = infer_module_format(torch.nn.Linear, target)
    return QuantizationConfig(
        config_groups={"group_0": target},
        ignore=["lm_head"],
        format=target.format,
        quantization_status=QuantizationStatus.COMPRESSED,
    )


@torch.no_grad()
def input_qparams(base: Path, args: Any, seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """Per decoder-layer Linear of ``base``: its static ``input_scale`` (and, when
    asymmetric, ``input_zero_point``) from the range its input takes over a calibration
    batch of random tokens, by compressed-tensors' ``calculate_qparams`` (what a
    static min-max observer finds while llm-compressor calibrates); for NVFP4's inputs
    (local scales) the ``input_global_scale`` of that range (``generate_gparam``)."""
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base)).eval()
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def record(name: str) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            low, high = torch.aminmax(inputs[0].float())
            old = seen.get(name, (low, high))
            seen[name] = (torch.minimum(old[0], low), torch.maximum(old[1], high))

        return hook

    for name, module in model.named_modules():
        if ".layers." in name and name.endswith("proj") and isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(record(name))
    gen = torch.Generator().manual_seed(seed)
    model(torch.randint(0, model.config.vocab_size, (4, 32), generator=gen))
    out = {}
    for name, (low, high) in seen.items():
        if args.dynamic:  # local: only the global scale is static
            out[name] = {"input_global_scale": generate_gparam(low.reshape(1), high.reshape(1))}
            continue
        scale, zero = calculate_qparams(low.reshape(1), high.reshape(1), args)
        out[name] = {"input_scale": scale}
        if not args.symmetric:
            out[name]["input_zero_point"] = zero.to(args.zp_dtype or torch.int8)
    return out


@torch.no_grad()
def min_max_qparams(w: torch.Tensor, args: Any) -> dict[str, torch.Tensor]:
    """``weight_scale`` (in ``w``'s dtype; the compressor casts it to the scheme's) and, when
    asymmetric, ``weight_zero_point`` of ``w`` from its range per group of columns, per
    row, per block or per tensor, by compressed-tensors' ``calculate_qparams`` (what a
    min-max observer gives); NVFP4's groups beside a ``weight_global_scale`` from the
    whole weight's range (``generate_gparam``)."""
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    x = w.float()
    glob = None
    if args.strategy in ("group", "tensor_group"):  # (rows, groups)
        x = x.unflatten(-1, (x.shape[-1] // args.group_size, args.group_size))
        low, high = x.amin(-1), x.amax(-1)
        if args.strategy == "tensor_group":
            glob = generate_gparam(x.amin().reshape(1), x.amax().reshape(1))
    elif args.strategy == "block":  # (row blocks, column blocks)
        br, bc = args.block_structure
        x = x.unflatten(0, (-(-x.shape[0] // br), -1)).unflatten(-1, (x.shape[-1] // bc, bc))
        low, high = x.amin((1, 3)), x.amax((1, 3))
    elif args.strategy == "tensor":  # (1,)
        low, high = x.amin().reshape(1), x.amax().reshape(1)
    else:  # channel: (rows, 1)
        low, high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale, zero = calculate_qparams(low, high, args, global_scale=glob)
    out = {"weight_scale": scale.to(w.dtype)}
    if glob is not None:
        out["weight_global_scale"] = glob
    if not args.symmetric:
        out["weight_zero_point"] = zero.to(args.zp_dtype or torch.int8)
    return out
