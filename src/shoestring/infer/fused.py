"""Model parameters that are not stored as they are used: an MoE layer's experts.

transformers 5 runs the experts of a mixture-of-experts layer (Mixtral, Qwen2/3-MoE,
OLMoE, ...) as fused 3-D parameters (``mlp.experts.gate_up_proj``: every
expert's gate and up projections, stacked), while checkpoints on the Hub store one
tensor per expert and projection (``mlp.experts.7.up_proj.weight``; Mixtral's
``block_sparse_moe.experts.7.w3.weight``). Its loader converts them with a per-model
*conversion mapping* of renamings and converters (``MergeModulelist``,
``Concatenate``, ...). The streaming engine uses that same mapping, unit by unit:

* :func:`key_map` asks it, once, which checkpoint tensors each missing parameter is
  made of (or which one it is, renamed);
* a :class:`Fused` parameter is built each time its unit is prepared, in the
  reader thread, from the unit's tensors as read (already dequantized and cast to
  the compute dtype), into a scratch buffer of the slot.

The converters MoE models use are ``MergeModulelist(dim=0)``, then for gate and up
``Concatenate(dim=1)``: experts stacked, projections side by side. Those are copied
expert by expert straight into the buffer (:meth:`Fused.build_into`; a test checks
it equals the converter's result, bit for bit). Any other chain runs through the
converter itself (:meth:`Fused.build`), whose stacked intermediates cost twice the
parameter for a moment.

Experts stored MXFP4 (openai/gpt-oss-*: ``experts.gate_up_proj_blocks`` and
``_scales``, 4.25 bits a weight) are mapped by the conversions of transformers' own
MXFP4 quantizer, set to dequantize (:func:`dequantizer`); its ``Mxfp4Dequantize`` would
dequantize a whole layer's experts at once (about three times the parameter, in
temporaries, and slowly on a CPU), so :meth:`Fused.build_into` decodes them an expert
at a time into the buffer (:mod:`.mxfp4`, transformers' values bit for bit).

A unit with fused parameters reads every expert (one pass serves every token of the
batch, and a batch of prompts routes to most of them); the fused copy costs as many
bytes again, which the plan counts as scratch (:meth:`Fused.nbytes`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shoestring.infer.mxfp4 import ROWS, dequantize_expert, pair_table
from shoestring.infer.shards import TensorRef


@dataclass(frozen=True)
class ExpertMerge:
    """What each expert of a parameter decoded as it streams gets once decoded: an
    adapter's delta added (``add(e, values)``), taking ``temps`` bytes beside it."""

    add: Callable[[int, torch.Tensor], torch.Tensor]
    temps: int


@dataclass
class Fused:
    """One model parameter built from several checkpoint tensors."""

    key: str  # the model's parameter key
    sources: list[str]  # checkpoint keys, in the order transformers loads them
    patterns: list[str]  # the converter's source pattern each one matched
    converter: Any  # this parameter's own transformers WeightConverter
    merge: ExpertMerge | None = None  # MXFP4 experts: an adapter merged as each is decoded

    @property
    def concat_dim(self) -> int | None:
        """The projections' dim in the fused parameter when the converter only stacks
        experts (0: nothing to concatenate) or stacks then concatenates; None: other."""
        ops = [(type(op).__name__, getattr(op, "dim", None)) for op in self.converter.operations]
        if ops == [("MergeModulelist", 0)]:
            return 0
        if len(ops) == 2 and ops[0] == ("MergeModulelist", 0) and ops[1][0] == "Concatenate":
            dim = ops[1][1]
            return dim if isinstance(dim, int) and dim >= 1 else None
        return None

    @property
    def mxfp4(self) -> bool:
        """Whether the parameter is stored MXFP4 (its blocks and scales)."""
        return [type(op).__name__ for op in self.converter.operations] == ["Mxfp4Dequantize"]

    @property
    def in_place(self) -> bool:
        """Whether :meth:`build_into` writes it (else transformers' converter builds it)."""
        return self.concat_dim is not None or self.mxfp4

    def shape(self, refs: dict[str, TensorRef]) -> tuple[int, ...]:
        """The fused parameter's shape (for a chain :meth:`build_into` writes)."""
        if self.mxfp4:  # blocks (experts, out, blocks, 16), used as (experts, in, out)
            experts, rows, blocks, _ = refs[self._packed()[0]].shape
            return (experts, blocks * 32, rows)
        groups = self.groups()
        first = refs[groups[0][0]].shape
        dim = self.concat_dim or 1
        side = sum(refs[g[0]].shape[dim - 1] for g in groups)
        return (len(groups[0]), *first[: dim - 1], side, *first[dim:])

    def build_into(self, tensors: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """The parameter written into ``out``, expert by expert (no intermediate copy)."""
        if self.mxfp4:
            return self._dequantize_into(tensors, out)
        dim = (self.concat_dim or 1) - 1  # in one expert's tensor
        offset = 0
        for group in self.groups():
            size = tensors[group[0]].shape[dim]
            for e, source in enumerate(group):
                out[e].narrow(dim, offset, size).copy_(tensors[source])
            offset += size
        return out

    def groups(self) -> list[list[str]]:
        """The sources per converter pattern, in the converter's order (gate, then up),
        experts in load order."""
        order = [p for p in self.converter.source_patterns if p in self.patterns]
        return [[s for s, p in zip(self.sources, self.patterns) if p == q] for q in order]

    def build(self, tensors: dict[str, torch.Tensor], model: Any, config: Any) -> torch.Tensor:
        """The parameter, from its sources among ``tensors`` (a new tensor)."""
        for source, pattern in zip(self.sources, self.patterns):
            self.converter.add_tensor(self.key, source, pattern, _given(tensors[source]))
        out = self.converter.convert(self.key, model=model, config=config)
        return out[self.key]  # type: ignore[no-any-return]

    def nbytes(self, refs: dict[str, TensorRef], dtype: torch.dtype) -> int:
        """The parameter's bytes in ``dtype`` (its sources' elements, rearranged)."""
        if self.mxfp4:
            return math.prod(self.shape(refs)) * dtype.itemsize
        return sum(r.nbytes // r.dtype.itemsize for r in (refs[s] for s in self.sources)) * (
            dtype.itemsize
        )

    def temps(self, refs: dict[str, TensorRef], dtype: torch.dtype) -> int:
        """What building it takes beside its buffer: transformers' converter, its stacked
        sources and its result (twice the parameter); an MXFP4 expert's dequantizing,
        a block of rows' int64 codes, values and scales (:mod:`.mxfp4`)."""
        if not self.in_place:
            return 2 * self.nbytes(refs, dtype)
        if self.mxfp4:
            _, cols, rows = self.shape(refs)  # an expert's input and output features
            n = min(ROWS, rows)
            decode = n * cols * (4 + dtype.itemsize) + 2 * n * cols // 32 * dtype.itemsize
            return max(decode, self.merge.temps if self.merge else 0)
        return 0

    def _packed(self) -> tuple[str, str]:
        """The MXFP4 blocks' and scales' checkpoint keys."""
        blocks = next(s for s, p in zip(self.sources, self.patterns) if p.endswith("_blocks"))
        scales = next(s for s, p in zip(self.sources, self.patterns) if p.endswith("_scales"))
        return blocks, scales

    def _dequantize_into(self, tensors: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """The MXFP4 experts decoded an expert at a time (:mod:`.mxfp4`: transformers'
        values, bit for bit)."""
        blocks, scales = (tensors[k] for k in self._packed())
        table = pair_table(out.dtype)
        for e in range(out.shape[0]):
            dequantize_expert(blocks[e], scales[e], out[e], table)
            if self.merge is not None:
                self.merge.add(e, out[e])
        return out


def _given(t: torch.Tensor) -> Any:
    return lambda: t


@dataclass(frozen=True)
class KeyMap:
    """Parameters whose checkpoint tensor has another name, and fused ones."""

    renamed: dict[str, str]  # model key -> checkpoint key
    fused: dict[str, Fused]  # model key -> how it is built


def dequantizer(config: Any) -> Any | None:
    """transformers' quantizer of a checkpoint whose experts are stored MXFP4, set to
    dequantize (its conversions name the stored blocks and scales); None otherwise."""
    q = getattr(config, "quantization_config", None)
    doc = q if isinstance(q, dict) else q.to_dict() if q is not None else {}
    if doc.get("quant_method") != "mxfp4":
        return None
    from transformers.quantizers.auto import AutoHfQuantizer
    from transformers.utils.quantization_config import Mxfp4Config

    keep = doc.get("modules_to_not_convert")
    return AutoHfQuantizer.from_config(
        Mxfp4Config(modules_to_not_convert=keep, dequantize=True), pre_quantized=True
    )


def key_map(model: Any, refs: dict[str, TensorRef], wanted: set[str]) -> KeyMap:
    """How each of the ``wanted`` parameters (absent from the checkpoint under its own
    name) comes from the checkpoint, by the model's transformers conversion mapping
    (and, for MXFP4 experts, its quantizer's)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    transforms = get_model_conversion_mapping(model, hf_quantizer=dequantizer(model.config))
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    meta = model.state_dict()
    renamed: dict[str, str] = {}
    fused: dict[str, Fused] = {}
    for source in sorted(refs, key=dot_natural_key):
        target, pattern = rename_source_key(
            source, renamings, converters, model.base_model_prefix, meta
        )
        if target not in wanted:
            continue
        if pattern is None:
            renamed[target] = source
            continue
        if target not in fused:
            proto = next(c for c in converters if pattern in c.source_patterns)
            fused[target] = Fused(target, [], [], copy.deepcopy(proto))
        fused[target].sources.append(source)
        fused[target].patterns.append(pattern)
    return KeyMap(renamed, fused)
