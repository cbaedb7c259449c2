"""A checkpoint saved 4-bit by bitsandbytes (the Hub's ``*-bnb-4bit`` models, the base
QLoRA trains on), streamed as stored and dequantized where :mod:`.stream` prepares.

bitsandbytes' ``save_pretrained`` stores each quantized Linear weight as parts:
``<key>`` (the packed codes, uint8, two per byte), ``<key>.absmax`` (one scale per
block; with double quantization itself uint8 codes, with ``.nested_absmax`` and
``.nested_quant_map``), ``<key>.quant_map`` and ``<key>.quant_state.bitsandbytes__nf4``
(or ``__fp4``: a uint8 tensor holding the rest as JSON). Here the parts of one weight
are one logical weight: the JSON is read once, when the job plans; the tensors are
streamed as ``<key>::<part>`` refs (about 4.2 bits a weight instead of 16), and each
weight is rebuilt by bitsandbytes' own ``dequantize_4bit``, a row block at a time, into
the slot's scratch in the compute dtype. Norms, embeddings and the head (bitsandbytes
leaves them 16-bit) stream as they are.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from shoestring.config import ConfigError
from shoestring.hf import bnb_stored
from shoestring.infer.engine import StreamingCausalLM
from shoestring.infer.shards import TensorRef, generic_key
from shoestring.infer.stream import Prepare, Slot
from shoestring.infer.unitweights import ByUnit

#: How the JSON part of a weight's quant state is named (``+ nf4 | fp4``).
QUANT_STATE = ".quant_state.bitsandbytes__"
#: The tensor parts of a weight besides its packed codes (the nested ones: double quant).
PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
#: Rows of a weight dequantized at once (a multiple of what aligns them to the blocks).
ROWS = 512
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HINT = "needs bitsandbytes >= 0.50 (x86/aarch64 CPU and CUDA): pip install 'shoestring[qlora]'"


def check_bnb(doc: Mapping[str, Any], spec: str, compress: str) -> None:
    """Refuse, before anything loads, a bitsandbytes checkpoint infer cannot stream: 8-bit
    (LLM.int8 quantizes activations too, so its dequantized weights would not compute
    what the model computes), packed in another dtype than uint8, a ``--compress`` on top
    of 4 bits, or bitsandbytes missing."""
    kind = bnb_stored(doc)
    if kind == "none":
        return
    key = "--model (model.path)"
    if kind == "int8":
        raise ConfigError(
            f"{key}: {spec} is stored 8-bit by bitsandbytes (LLM.int8); infer streams "
            "4-bit (nf4/fp4) bitsandbytes checkpoints and 16/32-bit safetensors: use the "
            "unquantized base (add --compress int8 to stream it 8-bit) or its 4-bit save"
        )
    q = doc["quantization_config"]
    storage = q.get("bnb_4bit_quant_storage") or "uint8"
    if storage != "uint8":
        raise ConfigError(
            f"{key}: {spec} packs its 4-bit weights as {storage} "
            "(quantization_config.bnb_4bit_quant_storage); infer streams uint8 packing "
            "only: save the model again with the default quant storage"
        )
    if compress != "none":
        raise ConfigError(
            f"--compress (compress.scheme): {spec} is already stored 4-bit by bitsandbytes "
            f"({q.get('bnb_4bit_quant_type', 'fp4')}) and streams as stored; drop "
            f"--compress {compress}"
        )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ConfigError(f"{key}: {spec} is stored 4-bit by bitsandbytes; {_HINT}") from None


def bnb_compute_dtype(doc: Mapping[str, Any]) -> torch.dtype | None:
    """The dtype a 4-bit checkpoint computes in (``bnb_4bit_compute_dtype``, else its
    ``dtype``/``torch_dtype``, else float32); None for any other checkpoint."""
    if bnb_stored(doc) != "nf4":
        return None
    q = doc["quantization_config"]
    for name in (q.get("bnb_4bit_compute_dtype"), doc.get("dtype"), doc.get("torch_dtype")):
        if isinstance(name, str) and name.removeprefix("torch.") in _DTYPES:
            return _DTYPES[name.removeprefix("torch.")]
    return torch.float32


@dataclass(frozen=True)
class Packed:
    """One stored 4-bit weight: its key, its shape (out, in) and its quant state's
    non-tensor items (quant_type, blocksize, nested_* ...), read once."""

    key: str
    shape: tuple[int, int]
    state: dict[str, Any]

    @property
    def blocksize(self) -> int:
        return int(self.state["blocksize"])

    @property
    def nested(self) -> bool:
        return "nested_blocksize" in self.state

    def row_step(self) -> int:
        """Rows per dequantized block: a multiple of the rows that start on a block
        boundary (so each block's codes and scales are contiguous slices), about ROWS."""
        cols, bs = self.shape[1], self.blocksize
        unit = bs // math.gcd(cols, bs)
        return max(unit, ROWS // unit * unit)

    def temps(self, dtype: torch.dtype) -> int:
        """What dequantizing it takes beside its scratch: the row block bitsandbytes
        returns (its pure-torch fallback for odd widths or blocks of 2048+ adds int32
        codes and fp32 values), and the double-quantized scales decoded to fp32."""
        rows, cols = min(self.row_step(), self.shape[0]), self.shape[1]
        fallback = cols % 2 == 1 or self.blocksize >= 2048
        per = dtype.itemsize + (16 if fallback else 0)
        blocks = -(-self.shape[0] * cols // self.blocksize)
        return rows * cols * per + (4 * blocks if self.nested else 0)


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


class Stored4bit(ByUnit[Packed]):
    """The 4-bit weights of each unit of an engine built on a bitsandbytes checkpoint;
    :meth:`of` points the engine's units at their parts."""

    @classmethod
    def of(cls, engine: StreamingCausalLM) -> Stored4bit | None:
        """The checkpoint's 4-bit weights, its units repointed at their parts (None: not a
        4-bit bitsandbytes checkpoint). Checks every weight's parts against the model
        before anything is read but the JSON of each quant state."""
        doc = json.loads((engine.model_dir / "config.json").read_text())
        if bnb_compute_dtype(doc) is None:
            return None
        weights: dict[int, dict[str, Packed]] = {}
        for i, unit in enumerate(engine.units):
            found = {r.key: _packed(engine, r) for r in unit.refs}
            packed = {k: p for k, p in found.items() if p is not None}
            if not packed:
                continue
            weights[i] = packed
            refs = [r for r in unit.refs if r.key not in packed]
            for key in packed:
                refs.extend(_part_refs(engine.refs, key, packed[key]))
            engine.replace_refs(i, refs)
        if not weights:
            raise ConfigError(
                f"--model (model.path): {engine.model_dir}/config.json says bitsandbytes 4-bit "
                f"(quantization_config) but no weight has a {QUANT_STATE}nf4|fp4 part: the "
                "weights are not the 4-bit save this config describes"
            )
        return cls(weights)

    def temps(self, i: int, dtype: torch.dtype) -> int:
        return max((p.temps(dtype) for p in self.weights.get(i, {}).values()), default=0)

    def hook(self, dtype: torch.dtype) -> Prepare:
        """The ``prepare`` hook: each 4-bit weight of a unit dequantized into the slot's
        scratch in ``dtype``; the unit's other tensors as read."""
        functional = _functional()

        def prepare(i: int, t: dict[str, torch.Tensor], slot: Slot) -> dict[str, torch.Tensor]:
            packed = self.weights.get(i)
            if packed is None:
                return t
            out = {k: v for k, v in t.items() if "::" not in k}
            for key, p in packed.items():
                parts = {s: t[f"{key}::{s}"] for s in ("q4", *PARTS) if f"{key}::{s}" in t}
                out[key] = dequantize(
                    functional,
                    p,
                    parts,
                    slot.buffer(generic_key(key), p.shape, dtype, parts["q4"].device),
                )
            return out

        return prepare


def dequantize(
    functional: Any, p: Packed, parts: dict[str, torch.Tensor], out: torch.Tensor
) -> torch.Tensor:
    """Weight ``p`` from its streamed ``parts`` into ``out`` (its shape, the compute
    dtype): the quant state rebuilt by ``QuantState.from_dict``, double-quantized scales
    decoded as bitsandbytes' own matmul decodes them, then ``dequantize_4bit`` over
    :meth:`Packed.row_step` rows at a time (each element is decoded on its own, so the
    values are those of one call over the whole weight)."""
    tensors = {s: parts[s] for s in PARTS if s in parts}
    state = functional.QuantState.from_dict({**p.state, **tensors}, parts["q4"].device)
    absmax = state.absmax
    if state.nested:
        absmax = functional.dequantize_blockwise(absmax, state.state2) + state.offset
    codes, (rows, cols), bs = parts["q4"].reshape(-1), p.shape, p.blocksize
    step = p.row_step()
    for r in range(0, rows, step):
        n = min(step, rows - r)
        first, end = r * cols, (r + n) * cols
        block = functional.QuantState(
            absmax=absmax[first // bs : -(-end // bs)].float(),
            shape=torch.Size((n, cols)),
            dtype=out.dtype,
            blocksize=bs,
            quant_type=state.quant_type,
        )
        out[r : r + n].copy_(functional.dequantize_4bit(codes[first // 2 : -(-end // 2)], block))
    return out


def _functional() -> Any:
    import bitsandbytes.functional

    return bitsandbytes.functional


def _packed(engine: StreamingCausalLM, ref: TensorRef) -> Packed | None:
    """The 4-bit weight stored under ``ref.key`` (None: a plain tensor), checked."""
    found = [t for t in ("nf4", "fp4") if f"{ref.key}{QUANT_STATE}{t}" in engine.refs]
    if not found:
        return None
    blob = engine.refs[f"{ref.key}{QUANT_STATE}{found[0]}"]
    with open(blob.file, "rb") as f:
        raw = os.pread(f.fileno(), blob.nbytes, blob.offset)
    where = f"--model (model.path): {ref.file}: {blob.key}"
    try:
        state = json.loads(raw)
        shape = (int(state["shape"][0]), int(state["shape"][1]))
        state["blocksize"] = int(state["blocksize"])
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ConfigError(f"{where}: not a bitsandbytes 4-bit quant state ({e})") from None
    want = _param_shape(engine, ref.key)
    if shape != want or -(-_numel(shape) // 2) != ref.nbytes or ref.dtype != torch.uint8:
        raise ConfigError(
            f"{where}: a {shape} weight packed in {ref.nbytes} {ref.dtype} bytes does not "
            f"fit the model's {want} {ref.key} (a different config.json?)"
        )
    state.pop("dtype", None)  # the stored weight's dtype: we dequantize into the compute one
    return Packed(ref.key, shape, {**state, "dtype": "float32"})


def _param_shape(engine: StreamingCausalLM, key: str) -> tuple[int, ...]:
    for unit in engine.units:
        if key in unit.params:
            mod, name = unit.params[key]
            return tuple(getattr(mod, name).shape)
    return ()


def _part_refs(refs: Mapping[str, TensorRef], key: str, p: Packed) -> list[TensorRef]:
    """The streamed parts of weight ``key``: its codes as ``key::q4`` and each tensor
    of its quant state as ``key::<part>``; a missing one is refused, naming it."""
    need = PARTS if p.nested else PARTS[:2]
    out = [refs[key].renamed(f"{key}::q4")]
    for part in need:
        ref = refs.get(f"{key}.{part}")
        if ref is None:
            raise ConfigError(
                f"--model (model.path): {refs[key].file}: the 4-bit weight {key} has no "
                f"{key}.{part} (a checkpoint saved by bitsandbytes has one)"
            )
        out.append(ref.renamed(f"{key}::{part}"))
    return out
