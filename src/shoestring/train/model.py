"""Loading the base model and tokenizer, wrapping it with LoRA, fingerprinting it."""

from __future__ import annotations

import ast
import contextlib
import json
import logging
import re
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from shoestring.config import ConfigError
from shoestring.hf import StoredQuantization, bnb_stored, quant_method, quiet_hf
from shoestring.hub import HubAccess, ModelRef, resolve
from shoestring.train.config import LoraSection, ModelConfig
from shoestring.train.nf4experts import quantize_experts, quantized_as_loaded
from shoestring.train.nf4stored import stacks_restored

log = logging.getLogger("shoestring.finetune")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_base(cfg: ModelConfig, hub: HubAccess) -> ModelRef | None:
    """``model.path`` resolved (a local dir, a Hub id, a bucket URL: downloaded now, so
    a bad reference fails before the run directory is written); None for the built-in
    model, which rank 0 materializes later."""
    from shoestring.train.builtin import BUILTIN_MODEL

    if cfg.path == BUILTIN_MODEL:
        return None
    return resolve(cfg.path, hub, key="model.path")


def stored_quantization(model_dir: Path) -> StoredQuantization:
    """How the base's linears are stored (a ``*-bnb-4bit`` checkpoint: ``nf4``)."""
    return bnb_stored(_config_doc(model_dir))


def _config_doc(model_dir: Path) -> dict[str, Any]:
    """The base's config.json ({}: model.path's own checks report a missing or broken one)."""
    try:
        doc = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def check_stored_quantization(model_dir: Path, quantize: str) -> None:
    """A base stored quantized by bitsandbytes trains as stored, never re-quantized:
    ``lora.quantize`` must name that format; a base stored quantized any other way
    (FP8, GPTQ, AWQ, ...) is refused (both checked before any work)."""
    method = quant_method(_config_doc(model_dir))
    if method and method != "bitsandbytes":
        raise ConfigError(
            f"model.path: {model_dir} is stored quantized by {method} "
            "(quantization_config.quant_method of its config.json); finetune trains LoRA "
            "on 16/32-bit bases (--lora.quantize nf4 quantizes one as it loads: QLoRA) "
            "and on bitsandbytes-stored ones: use the model's 16-bit original"
        )
    stored = stored_quantization(model_dir)
    if stored != "none" and quantize != stored:
        raise ConfigError(
            f"lora.quantize: {model_dir} is stored {stored} by bitsandbytes (the "
            f"quantization_config of its config.json); set --lora.quantize {stored} to "
            "train LoRA on it as stored (QLoRA), or use its 16-bit original"
        )


def resolve_model_dir(cfg: ModelConfig, cache_dir: Path, hub: HubAccess | None = None) -> Path:
    """The local model directory, building the embedded tiny model if asked."""
    from shoestring.train.builtin import materialize_tiny_model

    ref = resolve_base(cfg, hub or HubAccess(cache_dir))
    return materialize_tiny_model(cache_dir) if ref is None else ref.path


BNB_HINT = "needs bitsandbytes >= 0.50 (x86/aarch64 CPU and CUDA): pip install 'shoestring[qlora]'"


def require_bitsandbytes(key: str) -> Any:
    """Import bitsandbytes lazily; a missing or old install is a config error naming ``key``."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ConfigError(f"{key}: {BNB_HINT}") from None
    major, minor = (int(x) for x in bnb.__version__.split(".")[:2])
    if (major, minor) < (0, 50):
        raise ConfigError(f"{key}: found bitsandbytes {bnb.__version__}; {BNB_HINT}")
    return bnb


def quantization_config(quantize: str, dtype: str, skip: list[str] | None = None) -> Any:
    """The ``BitsAndBytesConfig`` for ``lora.quantize`` (None for 'none'); ``skip``: the
    modules it leaves unquantized instead of transformers' default (the head).

    nf4 uses double quantization (the blockwise absmax is itself quantized to
    uint8: ~0.127 instead of 0.5 extra bits per weight) and computes in the model
    dtype. Embeddings, the LM head and norms stay in that dtype: unlike
    ``peft.prepare_model_for_kbit_training`` we never upcast them to fp32 (for a
    128k vocabulary that upcast alone costs 2 GB, peft #816, bnb #1569).
    """
    if quantize == "none":
        return None
    require_bitsandbytes("lora.quantize")
    from transformers import BitsAndBytesConfig

    if quantize == "nf4":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=_DTYPES[dtype],
            llm_int8_skip_modules=skip,
        )
    if quantize == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    raise ConfigError(f"lora.quantize: unknown value {quantize!r} (none|nf4|int8)")


def _from_pretrained_kwargs(cfg: ModelConfig, device: str, on_device: bool) -> dict[str, Any]:
    # use_kernels=False: transformers 5 otherwise swaps layers for kernels fetched from the
    # Hugging Face Hub at load time (a download, and kernels that differ between machines).
    kwargs: dict[str, Any] = {
        "dtype": _DTYPES[cfg.dtype],
        "use_kernels": False,
        "attn_implementation": cfg.attn_implementation,
    }
    if on_device or device != "cpu":  # weights go straight to the device
        kwargs["device_map"] = {"": device}
    return kwargs


def _frozen(model: Any, quantized: bool, model_dir: Path, experts: bool = False) -> Any:
    """Ready for adapters: no KV cache, nothing trainable, one 4-bit format, ``experts``:
    fused MoE experts in NF4 too (bitsandbytes' quantizer leaves them 16-bit:
    :mod:`.nf4experts`); named after ``model_dir`` (the adapter's
    ``base_model_name_or_path``), wherever it was read from."""
    if experts:
        quantize_experts(model)
    model.config.use_cache = False
    model.config._name_or_path = str(model_dir)
    model.name_or_path = str(model_dir)
    for p in model.parameters():  # k-bit preparation without peft's fp32 upcast
        p.requires_grad_(False)
    if quantized:
        keep_one_4bit_format(model)
    return model


def _skip(model_dir: Path, quantize: str) -> list[str] | None:
    """A vision tower stays unquantized (:mod:`.towers`)."""
    from shoestring.train.towers import kept_unquantized

    return kept_unquantized(model_dir) if quantize != "none" else None


def load_base_model(
    model_dir: Path, cfg: ModelConfig, quantize: str = "none", device: str = "cpu"
) -> Any:
    """The frozen base model on ``device`` (a concrete ``model.dtype``, see
    :func:`shoestring.train.device.resolve`), optionally quantized by bitsandbytes."""
    from transformers import AutoModelForCausalLM

    quiet_hf()
    qcfg = quantization_config(quantize, cfg.dtype, _skip(model_dir, quantize))
    kwargs = _from_pretrained_kwargs(cfg, device, qcfg is not None)
    if qcfg is not None:
        kwargs["quantization_config"] = qcfg
    loading = quantized_as_loaded() if quantize == "nf4" else contextlib.nullcontext()
    try:
        with loading:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    except RuntimeError as e:
        if qcfg is not None and "shape" in str(e):  # bnb CPU kernels need widths % 64 == 0
            raise ConfigError(
                f"lora.quantize: {quantize} cannot load {model_dir} here: {e}. "
                "On CPU, 4-bit layer widths must be multiples of 64."
            ) from e
        raise
    return _frozen(model, qcfg is not None, model_dir, experts=quantize == "nf4")


def load_prequantized(saved_dir: Path, model_dir: Path, cfg: ModelConfig, device: str) -> Any:
    """A base saved quantized (its config carries the bitsandbytes quantization_config),
    loaded as :func:`load_base_model` would have quantized ``model_dir``."""
    from transformers import AutoModelForCausalLM

    quiet_hf()
    kwargs = _from_pretrained_kwargs(cfg, device, True)
    nf4 = stored_quantization(saved_dir) == "nf4"
    with quantized_as_loaded() if nf4 else contextlib.nullcontext(), stacks_restored(saved_dir):
        model = AutoModelForCausalLM.from_pretrained(str(saved_dir), **kwargs)
    return _frozen(model, True, model_dir, experts=nf4)


def empty_base_model(model_dir: Path, cfg: ModelConfig, quantize: str = "none") -> Any:
    """The frozen base as :func:`load_base_model` builds it before reading a weight: on the
    meta device (no memory), with bitsandbytes' linears swapped in by transformers' own
    quantizer, as ``from_pretrained`` does. A rank that does not read the base under FSDP2
    starts from this and receives its shards (:mod:`shoestring.train.onereader`)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.quantizers.auto import AutoHfQuantizer

    quiet_hf()
    config = AutoConfig.from_pretrained(str(model_dir))
    dtype = _DTYPES[cfg.dtype]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=cfg.attn_implementation
        )
    stored = getattr(config, "quantization_config", None)  # a *-bnb-4bit base: as stored
    qcfg = stored
    if qcfg is None:
        qcfg = quantization_config(quantize, cfg.dtype, _skip(model_dir, quantize))
    if qcfg is not None:
        quantizer = AutoHfQuantizer.from_config(qcfg, pre_quantized=stored is not None)
        quantizer.preprocess_model(model, dtype=dtype, device_map={"": "cpu"})
        model.hf_quantizer = quantizer
        quantizer.postprocess_model(model)
    model.eval()  # as from_pretrained leaves it
    return _frozen(model, qcfg is not None, model_dir)


def keep_one_4bit_format(model: Any) -> int:
    """Stop bitsandbytes from repacking 4-bit weights for its CPU inference kernel.

    On CPUs with AVX512-BF16, bitsandbytes >= 0.50 converts a ``Linear4bit`` on its
    first no-grad forward in eval mode: block scales rounded to bf16, nested
    quantization dropped, and every later forward (training too) routed through a
    kernel with no autograd formula. One mid-run eval would silently change the
    model being trained and stop gradients flowing through the base layers, and a
    resumed run (fresh weights) would diverge from an uninterrupted one. Returns the
    number of modules switched."""
    n = 0
    for m in model.modules():
        if getattr(m, "support_avx512bf16_for_cpu", False):
            m.support_avx512bf16_for_cpu = False
            n += 1
    return n


def upcast_frozen_params(model: Any, dtype: str) -> list[str]:
    """Names of frozen floating-point parameters wider than ``dtype`` (should be none)."""
    want = _DTYPES[dtype]
    return [
        n
        for n, p in model.named_parameters()
        if not p.requires_grad
        and p.is_floating_point()
        and p.dtype != want
        and p.element_size() > torch.empty((), dtype=want).element_size()
    ]


def build_optimizer(
    params: list[torch.nn.Parameter], name: str, lr: float, weight_decay: float
) -> torch.optim.Optimizer:
    """``train.optimizer``: torch AdamW, or bitsandbytes 8-bit (optionally paged) AdamW.

    The 8-bit moments are blockwise-quantized uint8 (256 values per fp32 absmax);
    tensors under 4096 elements keep fp32 moments. Paged state lives in CUDA
    unified memory and is evicted to host RAM under pressure; on CPU it is plain.
    """
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    bnb = require_bitsandbytes("train.optimizer")
    cls = {"adamw8bit": bnb.optim.AdamW8bit, "paged_adamw8bit": bnb.optim.PagedAdamW8bit}[name]
    return cls(params, lr=lr, weight_decay=weight_decay)  # type: ignore[no-any-return]


class NoGradientError(RuntimeError):
    """A LoRA matrix received no gradient: training would silently do nothing."""


def check_lora_gradients(named: dict[str, torch.nn.Parameter]) -> None:
    """After the first backward: every trainable tensor has a gradient, and every
    ``lora_B`` a non-zero one.

    ``lora_B`` starts at zero, so ``lora_A``'s first gradient is legitimately zero;
    ``lora_B``'s is not (it is the product of the input and output gradients).
    A ``None`` means the graph never reached the adapter: the known failure of
    reentrant gradient checkpointing without input gradients, or a frozen adapter.
    """
    missing = [n for n, p in named.items() if p.grad is None]
    zero = [
        n
        for n, p in named.items()
        if p.grad is not None
        and "lora_B" in n
        and type(p.grad) is torch.Tensor
        and not bool(p.grad.ne(0).any())
    ]
    if missing or zero:
        names = (missing + zero)[:5]
        raise NoGradientError(
            f"{len(missing)} trainable tensor(s) got no gradient and {len(zero)} lora_B "
            f"matrices got an all-zero gradient after the first step (e.g. {', '.join(names)}); "
            "the adapters would not train. Check lora.target_modules and "
            "model.gradient_checkpointing."
        )


def apply_lora(model: Any, cfg: LoraSection, seed: int, gradient_checkpointing: bool) -> Any:
    """Wrap ``model`` with fresh LoRA adapters; their init depends only on ``seed``."""
    from peft import LoraConfig, get_peft_model

    from shoestring.train.nf4lora import factor_expert_lora
    from shoestring.train.towers import exclude_pattern, outside_decoder

    targets: Any = cfg.target_modules
    if targets == ["all-linear"]:
        targets = "all-linear"
    alpha: Any = cfg.alpha  # peft annotates lora_alpha as int; it computes with a float
    lcfg = LoraConfig(
        r=cfg.r,
        lora_alpha=alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        exclude_modules=exclude_pattern(outside_decoder(model)),  # a vision tower
        target_parameters=list(cfg.target_parameters) or None,
        task_type="CAUSAL_LM",
        bias="none",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                peft_model = get_peft_model(model, lcfg)
        except ValueError as e:
            raise ConfigError(_refused_lora(e, cfg)) from e
    _rewarn(said, getattr(peft_model.base_model, "targeted_parameter_names", []))
    factor_expert_lora(peft_model)  # LoRA on NF4 experts: per routed expert, factored
    _warn_unadapted_experts(peft_model, cfg)
    if gradient_checkpointing:
        peft_model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
        peft_model.enable_input_require_grads()
    return peft_model


#: peft's check of its rank/alpha patterns, which it matches against adapted modules
#: only: the patterns its own ``all-linear`` mapping gives an MoE's fused experts
#: (``gate_up_proj`` at twice the rank) name adapted parameters, are applied (their
#: scaling is right), and are still said to be ignored.
_PATTERNS_IGNORED = re.compile(
    r"The following (rank|alpha)_pattern keys did not match any targeted module and were "
    r"ignored: (\[.*\])\.$"
)


def _rewarn(said: list[warnings.WarningMessage], parameters: list[str]) -> None:
    """Say again what peft warned while wrapping, except that its patterns were
    ignored when each of them names an adapted parameter."""
    for w in said:
        m = _PATTERNS_IGNORED.match(str(w.message))
        keys = ast.literal_eval(m.group(2)) if m else [None]
        if not all(
            key and any(re.match(rf"(.*\.)?({key})$", name) for name in parameters) for key in keys
        ):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _warn_unadapted_experts(model: Any, cfg: LoraSection) -> None:
    """``all-linear`` leaves an MoE's fused experts without adapters where peft does not
    map them (it maps the Mixtral and Qwen-MoE families): said, with the knob."""
    from peft.tuners.lora.layer import ParamWrapper

    from shoestring.train.nf4experts import is_fused_experts

    if cfg.target_parameters or cfg.target_modules != ["all-linear"]:
        return
    adapted = {id(m.get_base_layer()) for m in model.modules() if isinstance(m, ParamWrapper)}
    bare = [m for m in model.modules() if is_fused_experts(m) and id(m) not in adapted]
    if bare:
        log.warning(
            "lora.target_modules all-linear puts no adapter on this model's %d fused "
            "expert modules (%s; peft maps the experts of the Mixtral and Qwen-MoE "
            "families only): --lora.target_parameters gate_up_proj,down_proj adapts them",
            len(bare),
            type(bare[0]).__name__,
        )


def _refused_lora(e: ValueError, cfg: LoraSection) -> str:
    """peft's refusal, said in the knob that fixes it."""
    if "lora_dropout" in str(e):  # peft's ParamWrapper: a fused parameter, no dropout
        return (
            f"lora.dropout: {cfg.dropout} cannot be used with this model: its experts are "
            "fused parameters (a mixture-of-experts layer, as transformers 5 runs it), which "
            f"peft adapts without dropout ({e}); set lora.dropout 0, or adapt the attention "
            "only: lora.target_modules [q_proj, k_proj, v_proj, o_proj]"
        )
    return f"lora.target_modules: {e}"


def fuses_parameters(model_dir: Path) -> bool:
    """Whether transformers fuses this model's stored tensors into other parameters as
    it loads them (an MoE layer's experts): peft then adapts parameters, not only
    linear layers, with rules of its own."""
    from transformers import AutoConfig
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    try:
        model_type = getattr(AutoConfig.from_pretrained(str(model_dir)), "model_type", None)
    except (OSError, ValueError):  # not a model folder: the loader says so, in its turn
        return False
    mapping = get_checkpoint_conversion_mapping(model_type) if model_type else None
    return any(isinstance(t, WeightConverter) for t in mapping or ())


def check_fused_base(
    model_dir: Path, model_cfg: ModelConfig, lora: LoraSection, strategy: str = "ddp"
) -> None:
    """For a model whose stored tensors are fused as it loads (:func:`fuses_parameters`):
    put the adapters on its skeleton (the meta device: no weight read), so a
    configuration peft refuses is refused in seconds, before the base loads and before
    any step. (The merged export writes the fused tensors back under their stored
    names: :mod:`shoestring.train.storednames`.)"""
    if not fuses_parameters(model_dir):
        return
    if lora.quantize == "nf4" and strategy == "fsdp":
        raise ConfigError(
            f"distributed.strategy: fsdp does not shard {model_dir}'s experts in NF4 (with "
            "lora.quantize nf4 they are held as bitsandbytes NF4 matrices per expert, not "
            "parameters FSDP2 can shard); use ddp (each rank holds the 4-bit base) or "
            "lora.quantize none"
        )
    dtype = model_cfg.dtype if model_cfg.dtype in _DTYPES else "float32"  # shapes only
    skeleton = empty_base_model(model_dir, replace(model_cfg, dtype=dtype))
    adapted = apply_lora(skeleton, lora, seed=0, gradient_checkpointing=False)
    nf4 = lora.quantize == "nf4"  # NF4 experts: LoRA per routed expert, factored
    if not nf4 and not model_cfg.gradient_checkpointing and _adapts_parameters(adapted):
        log.warning(
            "LoRA on fused experts: each forward forms every adapted expert stack whole "
            "(peft's W + BA) and autograd keeps it for the backward, a layer's worth per "
            "layer; --model.gradient_checkpointing true keeps one layer's (an OLMoE-1B-7B "
            "shape on 24 GB: killed at 23.9 GB without it, 18.4 GB with it; benchmarks/README.md)"
        )


def _adapts_parameters(model: Any) -> bool:
    """Whether peft put a ``ParamWrapper`` (LoRA on a parameter) anywhere in ``model``."""
    from peft.tuners.lora.layer import ParamWrapper

    return any(isinstance(m, ParamWrapper) for m in model.modules())


def trainable_parameters(model: Any) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def model_summary(model: Any) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"params": total, "trainable_params": trainable}
