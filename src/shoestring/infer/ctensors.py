"""A checkpoint saved by compressed-tensors (``quantization_config.quant_method:
compressed-tensors``: the Hub's RedHatAI/neuralmagic ``*-quantized.w4a16``,
``*-w8a16``, ``*-quantized.w8a8``, ``*-FP8-dynamic``, ``*-FP8``, ``*-FP8-block``,
``*-NVFP4A16`` and ``*-NVFP4`` repos, llm-compressor's output), streamed as stored and decompressed
where :mod:`.stream` prepares.

Each quantized Linear is stored as its compressor's parameters: ``weight_packed``
(int32, eight 4-bit or four 8-bit values a word), ``weight_scale`` (per group of
columns, per row, per block or per tensor), ``weight_shape`` and, when asymmetric,
``weight_zero_point`` (format ``pack-quantized``); ``weight`` as int8 or FP8 codes
beside its scale (``int-quantized``, ``naive-quantized``, ``float-quantized``); or FP4
codes two a byte beside FP8 group scales and a global scale (``nvfp4-pack-quantized``)
or power-of-two group scales (``mxfp4-pack-quantized``). Which
module uses which scheme is the library's own business: the config groups are read by
``QuantizationConfig``, each group's format inferred and its modules matched by
compressed-tensors' ``match_quantizable_tensors``, as its model-free dequantizer does.
The parameters stream as ``<module>.weight::<name>`` refs, and each weight is rebuilt by
the group's compressor (``decompress``), a block of rows at a time, into the slot's
scratch in the compute dtype.

A scheme that quantizes activations too (the Hub's ``*-FP8-dynamic``, ``*-FP8``,
``*-FP8-block``, ``*-quantized.w8a8``, MXFP4) has each targeted module quantize and
dequantize its input as compressed-tensors' own quantized forward does
(:class:`InputQuant`): per token or per group of a token's features computed on the
fly, or with the static ``input_scale`` stored beside the weight, which streams with
its layer as a parameter of the module. That is what transformers computes on the
checkpoint (its default load); outputs stay independent of batching, which is why a
scale computed on the fly over a whole tensor (a sequence's outputs would depend on
its batch-mates) is refused, as are static zero points, quantized outputs, a quantized
KV cache, sparse formats and the formats not in :data:`FORMATS`, all before anything
loads. NVFP4's inputs (FP4 per group of 16, local scales under a static float32
``input_global_scale``) are quantized as its scheme says.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from shoestring.config import ConfigError
from shoestring.hf import quant_method
from shoestring.infer.dtype import config_dtype
from shoestring.infer.engine import StreamingCausalLM, read_config_json
from shoestring.infer.shards import TensorRef, generic_key
from shoestring.infer.stream import Prepare, Slot
from shoestring.infer.unitweights import ByUnit

METHOD = "compressed-tensors"
#: The formats streamed (their compressors decompress one weight from its parameters).
FORMATS = (
    "pack-quantized",
    "int-quantized",
    "naive-quantized",
    "float-quantized",
    "nvfp4-pack-quantized",
    "mxfp4-pack-quantized",
)
#: Rows of a weight decompressed at once (rounded to whole rows of every parameter).
ROWS = 512
#: Bytes per element of a row block while the library decompresses it: the unpacked
#: codes, their float copy and the scaled product beside the result.
TEMP_BYTES = 12
_HINT = "needs compressed-tensors: pip install 'shoestring[ctensors]'"


def is_ctensors(doc: Mapping[str, Any]) -> bool:
    return quant_method(doc) == METHOD


def check_ctensors(doc: Mapping[str, Any], spec: str, compress: str) -> None:
    """Refuse, before anything loads, a compressed-tensors checkpoint infer cannot
    stream (:func:`groups`), or ``--compress`` on top of one."""
    if not is_ctensors(doc):
        return
    if compress != "none":
        raise ConfigError(
            f"--compress (compress.scheme): {spec} is already stored quantized by {METHOD} "
            f"and streams as stored; drop --compress {compress}"
        )
    groups(doc, spec)


def ct_compute_dtype(doc: Mapping[str, Any]) -> torch.dtype | None:
    """The dtype a compressed-tensors checkpoint computes in (its config's), or None
    for any other checkpoint."""
    return config_dtype(doc) if is_ctensors(doc) else None


@dataclass(frozen=True)
class Group:
    """One config group: its scheme, its compressor and the parameters it stores per
    weight (the first is the root: ``weight_packed`` or ``weight``)."""

    name: str
    scheme: Any
    compressor: Any
    params: tuple[str, ...]


def groups(doc: Mapping[str, Any], spec: str) -> tuple[list[Group], list[str]]:
    """The checkpoint's config groups and its ignore list, each group's format inferred
    as compressed-tensors' own dequantizer infers it; what cannot stream is refused."""
    try:
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError:
        raise ConfigError(f"--model (model.path): {spec} is stored by {METHOD}; {_HINT}") from None
    key = "quantization_config"
    try:
        config = QuantizationConfig.model_validate(doc[key])
    except ValueError as e:
        first = str(e).splitlines()[0]
        raise ConfigError(
            f"--model (model.path): {spec}: {key} is not read by {METHOD}: {first}"
        ) from None
    if doc[key].get("sparsity_config"):
        raise ConfigError(
            f"--model (model.path): {spec} is stored sparse ({key}.sparsity_config); "
            f"infer streams dense quantized {METHOD} checkpoints"
        )
    if config.kv_cache_scheme is not None:
        raise ConfigError(
            f"--model (model.path): {spec} quantizes its KV cache ({key}.kv_cache_scheme); "
            "infer keeps the KV cache in the compute dtype (or int8 with --kv-bits 8) and "
            "would not compute this model"
        )
    found = [_group(name, scheme, spec) for name, scheme in config.config_groups.items()]
    return [g for g in found if g is not None], list(config.ignore or [])


def _group(name: str, scheme: Any, spec: str) -> Group | None:
    """Config group ``name`` with its compressor (None: it quantizes no weight); one that
    quantizes activations, or is stored in a format not streamed, is refused."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.config import CompressionFormat

    where = f"quantization_config.config_groups.{name}"
    if scheme.output_activations is not None:
        raise ConfigError(
            f"--model (model.path): {spec} quantizes module outputs ({where}."
            "output_activations); infer streams schemes that quantize weights and inputs"
        )
    _check_inputs(scheme.input_activations, f"{where}.input_activations", spec)
    if scheme.weights is None:
        return None
    scheme.format = CompressionFormat(infer_module_format(torch.nn.Linear, scheme))
    if scheme.format.value not in FORMATS:
        raise ConfigError(
            f"--model (model.path): {spec} stores {where} as {scheme.format.value}; "
            f"infer streams {', '.join(FORMATS)}"
        )
    compressor = BaseCompressor.get_value_from_registry(scheme.format.value)
    return Group(name, scheme, compressor, tuple(compressor.compression_param_names(scheme)))


def _check_inputs(args: Any, where: str, spec: str) -> None:
    """Refuse input quantization whose outputs would depend on the batch (a scale
    computed on the fly over the whole tensor), and static zero points."""
    from compressed_tensors.quantization import DynamicType, QuantizationStrategy

    if args is None:
        return
    strategy = QuantizationStrategy(args.strategy).value
    if args.dynamic == DynamicType.LOCAL and strategy != "tensor_group":
        raise ConfigError(
            f"--model (model.path): {spec} quantizes inputs with local scales per "
            f"{strategy} ({where}.dynamic: local); infer streams them per group under a "
            "static global scale (NVFP4's tensor_group)"
        )
    if args.dynamic is True and strategy not in ("token", "group"):
        raise ConfigError(
            f"--model (model.path): {spec} quantizes inputs with a scale computed on the "
            f"fly per {strategy} ({where}): a sequence's outputs would depend "
            "on the sequences batched with it; infer streams per-token, per-group and "
            "static input scales"
        )
    if args.dynamic is False and not args.symmetric:
        raise ConfigError(
            f"--model (model.path): {spec} quantizes inputs with static zero points "
            f"({where}.symmetric: false); infer streams symmetric static input scales"
        )


def aliased(doc: Mapping[str, Any], refs: dict[str, TensorRef]) -> dict[str, TensorRef]:
    """The checkpoint's tensors with each packed weight also under its module's
    ``weight`` key, where the model has its parameter (the engine gives each parameter
    its stored tensor; :meth:`StoredCt.of` then streams the parts instead)."""
    if not is_ctensors(doc):
        return refs
    out = dict(refs)
    for key, ref in refs.items():
        module, _, name = key.rpartition(".")
        if name == "weight_packed" and f"{module}.weight" not in refs:
            out[f"{module}.weight"] = ref.renamed(f"{module}.weight")
    return out


class StaticInput(NamedTuple):
    """A static input qparam stored beside a weight: its name, shape, and the dtype it
    computes in (None: the compute dtype; NVFP4's global scale keeps float32)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None


@dataclass(frozen=True)
class CtWeight:
    """One stored weight: its model key, dense shape, group, and per parameter how many
    of the weight's rows one of its rows covers (0: passed whole to every row block)."""

    key: str
    shape: tuple[int, ...]
    group: Group
    rows_per: tuple[tuple[str, int], ...]
    inputs: tuple[StaticInput, ...] = ()  # its module's static input qparams

    @property
    def module(self) -> str:
        return self.key.removesuffix(".weight")

    def row_step(self) -> int:
        unit = math.lcm(1, *(r for _, r in self.rows_per if r))
        return min(self.shape[0], max(unit, ROWS // unit * unit))

    def temps(self) -> int:
        return TEMP_BYTES * self.row_step() * math.prod(self.shape[1:])


class StoredCt(ByUnit[CtWeight]):
    """The compressed-tensors weights of each unit of an engine; :meth:`of` points the
    engine's units at their parameters."""

    @classmethod
    def of(cls, engine: StreamingCausalLM) -> StoredCt | None:
        doc = read_config_json(engine.model_dir)
        if not is_ctensors(doc):
            return None
        found, ignore = groups(doc, str(engine.model_dir))
        modules = _modules(engine.model, found, ignore)
        weights: dict[int, dict[str, CtWeight]] = {}
        for i, unit in enumerate(engine.units):
            mine = {r.key: modules[r.key] for r in unit.refs if r.key in modules}
            if not mine:
                continue
            shapes = {k: tuple(getattr(m, p).shape) for k, (m, p) in unit.params.items()}
            weights[i] = {k: _weight(engine.refs, k, shapes[k], g) for k, g in mine.items()}
            parts = [
                engine.refs[f"{w.module}.{p}"].renamed(f"{k}::{p}")
                for k, w in weights[i].items()
                for p in [*(p for p, _ in w.rows_per), *(q.name for q in w.inputs)]
            ]
            engine.replace_refs(i, [r for r in unit.refs if r.key not in mine] + parts)
            for w in weights[i].values():
                module = unit.params[w.key][0]
                for q in w.inputs:
                    own = q.dtype is not None
                    engine.add_param(i, f"{w.module}.{q.name}", module, q.name, own_dtype=own)
                if w.group.scheme.input_activations is not None:
                    module.register_forward_pre_hook(InputQuant(w.group.scheme.input_activations))
        return cls(weights)

    def shapes(self, i: int) -> dict[str, tuple[int, ...]]:
        """Unit ``i``'s stored weights and their modules' static input scales: what
        its ``prepare`` makes in the compute dtype, model key -> shape."""
        out = super().shapes(i)
        for w in self.weights.get(i, {}).values():
            out.update({f"{w.module}.{q.name}": q.shape for q in w.inputs if q.dtype is None})
        return out

    def kept(self, i: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """What unit ``i``'s ``prepare`` makes in a dtype of its own (an NVFP4 input's
        float32 global scale), model key -> shape and dtype."""
        return {
            f"{w.module}.{q.name}": (q.shape, q.dtype)
            for w in self.weights.get(i, {}).values()
            for q in w.inputs
            if q.dtype is not None
        }

    def temps(self, i: int, dtype: torch.dtype) -> int:
        return max((w.temps() for w in self.weights.get(i, {}).values()), default=0)

    def hook(self, dtype: torch.dtype) -> Prepare:
        """The ``prepare`` hook: each weight of a unit decompressed into the slot's
        scratch in ``dtype``; the unit's other tensors as read."""

        def prepare(i: int, t: dict[str, torch.Tensor], slot: Slot) -> dict[str, torch.Tensor]:
            mine = self.weights.get(i)
            if mine is None:
                return t
            out = {k: v for k, v in t.items() if "::" not in k}
            device = next(iter(t.values())).device
            for key, w in mine.items():
                parts = {p: t[f"{key}::{p}"] for p, _ in w.rows_per}
                out[key] = decompress(
                    w, parts, slot.buffer(generic_key(key), w.shape, dtype, device)
                )
                for q in w.inputs:  # copied: no prepared tensor holds the raw bytes
                    name = f"{w.module}.{q.name}"
                    buf = slot.buffer(generic_key(name), q.shape, q.dtype or dtype, device)
                    out[name] = buf.copy_(t[f"{key}::{q.name}"])
            return out

        return prepare


@dataclass(frozen=True)
class InputQuant:
    """A forward pre-hook: the module's input quantized and dequantized as ``args`` says
    before the module computes, as compressed-tensors' quantized forward does it (its
    scale and zero point computed on the fly, or the module's static ``input_scale``
    and ``input_zero_point``, streamed with its layer)."""

    args: Any

    def __call__(
        self, module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...] | None:
        from compressed_tensors.quantization.lifecycle.forward import fake_quantize
        from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

        x = inputs[0]
        if x.numel() == 0:
            return None
        glob = getattr(module, "input_global_scale", None)  # NVFP4's, static
        if self.args.dynamic:  # True, or local: groups' scales on the fly under ``glob``
            scale, zero = compute_dynamic_scales_and_zp(
                value=x, args=self.args, module=module, global_scale=glob
            )
        else:
            scale, zero = module.input_scale, getattr(module, "input_zero_point", None)
        q = fake_quantize(x=x, scale=scale, zero_point=zero, args=self.args, global_scale=glob)
        return (q, *inputs[1:])


def decompress(w: CtWeight, parts: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Weight ``w`` from its streamed parameters into ``out``, by its group's compressor,
    :meth:`CtWeight.row_step` rows at a time (each row's values depend on its own codes,
    scales and zero points only, so they are those of one call over the whole weight)."""
    rows, step, per = w.shape[0], w.row_step(), dict(w.rows_per)
    wants_shape = "weight_shape" in w.group.params
    for r in range(0, rows, step):
        n = min(step, rows - r)
        given = {p: (t[r // per[p] : (r + n) // per[p]] if per[p] else t) for p, t in parts.items()}
        if wants_shape:
            given["weight_shape"] = torch.tensor([n, *w.shape[1:]])
        out[r : r + n].copy_(w.group.compressor.decompress(given, w.group.scheme)["weight"])
    return out


def _modules(model: Any, found: list[Group], ignore: list[str]) -> dict[str, Group]:
    """Model weight key -> its group, for every module a group targets (matched on the
    model skeleton by compressed-tensors' ``match_named_modules``, as transformers
    applies a scheme)."""
    from compressed_tensors.utils.match import match_named_modules

    out: dict[str, Group] = {}
    for g in found:
        for name, _ in match_named_modules(model, g.scheme.targets, ignore):
            out.setdefault(f"{name}.weight", g)
    return out


def _weight(refs: Mapping[str, TensorRef], key: str, shape: tuple[int, ...], g: Group) -> CtWeight:
    """Weight ``key``'s parameters as stored, checked to cover its rows evenly."""
    module = key.removesuffix(".weight")
    rows_per = []
    for p in g.params:
        if p == "weight_shape":
            continue
        ref = refs.get(f"{module}.{p}")
        if ref is None:
            raise ConfigError(
                f"--model (model.path): {key} has no {module}.{p}, which its "
                f"{g.scheme.format.value} scheme ({g.name}) stores"
            )
        lead = ref.shape[0] if ref.shape else 1
        whole = p == "weight_g_idx" or lead == 1 or len(ref.shape) < 2
        if not whole and shape[0] % lead:
            raise ConfigError(
                f"--model (model.path): {ref.file}: {module}.{p} {tuple(ref.shape)} does not "
                f"cover the {shape} weight's rows evenly"
            )
        rows_per.append((p, 0 if whole else shape[0] // lead))
    return CtWeight(key, shape, g, tuple(rows_per), _static_inputs(refs, module, g))


def _static_inputs(refs: Mapping[str, TensorRef], module: str, g: Group) -> tuple[StaticInput, ...]:
    """The static input qparams of ``module`` its group's scheme stores: a static
    scheme's ``input_scale`` (in the compute dtype, as compressed-tensors makes it),
    NVFP4's float32 ``input_global_scale``; none when inputs are not quantized or their
    scales are all computed on the fly."""
    from compressed_tensors.quantization import DynamicType

    args = g.scheme.input_activations
    if args is None or args.dynamic is True:
        return ()
    local = args.dynamic == DynamicType.LOCAL
    name, dtype = ("input_global_scale", torch.float32) if local else ("input_scale", None)
    ref = refs.get(f"{module}.{name}")
    if ref is None:
        raise ConfigError(
            f"--model (model.path): {module} has no {module}.{name}, which its static "
            f"input quantization ({g.name}.input_activations) stores"
        )
    return (StaticInput(name, tuple(ref.shape), dtype),)
