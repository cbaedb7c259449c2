"""A checkpoint stored in FP8 with block scales (``quantization_config.quant_method:
fp8``: DeepSeek-V3/R1, the Hub's ``*-FP8`` Qwen3 repos), streamed as stored and
dequantized where :mod:`.stream` prepares.

Each quantized weight is stored as ``<key>`` (``float8_e4m3fn``) beside
``<key>_scale_inv``: one scale per block of rows x columns (128 x 128 in the Hub's
checkpoints; float32, bf16 or ue8m0). The two stream as ``<key>::f8`` and
``<key>::scale_inv`` refs (8 bits a weight instead of 16, plus a scale per block), and
each weight is rebuilt by transformers' own FP8 dequantizer (``Fp8Dequantize``: what
``from_pretrained`` runs where no FP8 kernel exists), a few blocks of rows at a time,
into the slot's scratch in the compute dtype. Tensors stored without a scale (norms,
embeddings, the head, ``modules_to_not_convert``) stream as they are. The activation
scales of a static scheme are not read: the dequantized weights compute in the
compute dtype, as transformers computes them without an FP8 GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from shoestring.config import ConfigError
from shoestring.hf import quant_method
from shoestring.infer.dtype import config_dtype
from shoestring.infer.engine import StreamingCausalLM, read_config_json
from shoestring.infer.shards import TensorRef, generic_key
from shoestring.infer.stream import Prepare, Slot
from shoestring.infer.unitweights import ByUnit

#: The dtypes an FP8 weight is stored in.
FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
#: Rows of a weight dequantized at once (a multiple of the scale blocks' rows).
ROWS = 512
#: Bytes per element of a row block while it is dequantized: the codes as float32 and the
#: scaled product in float32 (the result, for raw ue8m0 scales, in bf16 beside them).
TEMP_BYTES = 12
#: Where a weight's block scales are stored, beside ``<module>.weight``: transformers'
#: name, and the one its FP8 loader renames from (Mistral's).
SCALE_SUFFIXES = ("weight_scale_inv", "qscale_weight")


def is_fp8(doc: Mapping[str, Any]) -> bool:
    return quant_method(doc) == "fp8"


def check_fp8(doc: Mapping[str, Any], spec: str, compress: str) -> None:
    """Refuse, before anything loads, ``--compress`` on top of FP8 (it streams as stored)."""
    if is_fp8(doc) and compress != "none":
        raise ConfigError(
            f"--compress (compress.scheme): {spec} is already stored in FP8 with block "
            f"scales and streams as stored; drop --compress {compress}"
        )


def fp8_compute_dtype(doc: Mapping[str, Any]) -> torch.dtype | None:
    """The dtype an FP8 checkpoint computes in: its config's ``dtype``/``torch_dtype``
    (the one its unquantized tensors are stored in), else bfloat16; None for any other
    checkpoint."""
    return config_dtype(doc) if is_fp8(doc) else None


@dataclass(frozen=True)
class Blocked:
    """One stored FP8 weight: its model key, its shape (..., rows, cols) and its scale
    grid (..., grid rows, grid cols)."""

    key: str
    shape: tuple[int, ...]
    grid: tuple[int, ...]

    @property
    def block_rows(self) -> int:
        return self.shape[-2] // self.grid[-2]

    def row_step(self) -> int:
        """Rows dequantized at once: whole blocks of rows, about ROWS."""
        unit = self.block_rows
        return max(unit, ROWS // unit * unit)

    def temps(self) -> int:
        return TEMP_BYTES * min(self.row_step(), self.shape[-2]) * self.shape[-1]


class StoredFp8(ByUnit[Blocked]):
    """The FP8 weights of each unit of an engine built on an FP8 checkpoint; :meth:`of`
    points the engine's units at their codes and scales."""

    @classmethod
    def of(cls, engine: StreamingCausalLM) -> StoredFp8 | None:
        """The checkpoint's FP8 weights, its units repointed at their parts (None: not an
        FP8 checkpoint). Every weight's scale is checked against it before anything is
        read; an FP8 tensor without one is refused, naming it."""
        if not is_fp8(read_config_json(engine.model_dir)):
            return None
        stored = _stored_keys(engine.refs)
        weights: dict[int, dict[str, Blocked]] = {}
        for i, unit in enumerate(engine.units):
            found = [r for r in unit.refs if r.dtype in FP8_DTYPES]
            if not found:
                continue
            parts = {r.key: _parts(engine.refs, r, stored[(r.file, r.offset)]) for r in found}
            weights[i] = {k: _blocked(k, f8, scale) for k, (f8, scale) in parts.items()}
            refs = [r for r in unit.refs if r.key not in parts]
            engine.replace_refs(i, refs + [ref for pair in parts.values() for ref in pair])
        if not weights:
            raise ConfigError(
                f"--model (model.path): {engine.model_dir}/config.json says FP8 "
                "(quantization_config.quant_method) but no weight is stored in FP8: the "
                "weights are not the FP8 save this config describes"
            )
        return cls(weights)

    def temps(self, i: int, dtype: torch.dtype) -> int:
        return max((w.temps() for w in self.weights.get(i, {}).values()), default=0)

    def hook(self, dtype: torch.dtype) -> Prepare:
        """The ``prepare`` hook: each FP8 weight of a unit dequantized into the slot's
        scratch in ``dtype``; the unit's other tensors as read."""
        from transformers.integrations.finegrained_fp8 import Fp8Dequantize

        op = Fp8Dequantize(None)

        def prepare(i: int, t: dict[str, torch.Tensor], slot: Slot) -> dict[str, torch.Tensor]:
            blocked = self.weights.get(i)
            if blocked is None:
                return t
            out = {k: v for k, v in t.items() if "::" not in k}
            for key, w in blocked.items():
                parts = t[f"{key}::f8"], t[f"{key}::scale_inv"]
                out[key] = dequantize(
                    op, w, *parts, slot.buffer(generic_key(w.key), w.shape, dtype, parts[0].device)
                )
            return out

        return prepare


def dequantize(
    op: Any, w: Blocked, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Weight ``w`` from its streamed codes and scales into ``out`` (its shape, the
    compute dtype) by transformers' ``Fp8Dequantize``, :meth:`Blocked.row_step` rows at a
    time (each block is scaled on its own, so the values are those of one call over the
    whole weight); stacked weights (experts) one at a time.

    Into float32 with float scales, the same product is formed in place instead (the
    codes copied into ``out``, then scaled block by block): no temporaries, and half
    the passes over memory (1.9x faster on this project's 2-core CPU; the tests check
    it equals the dequantizer's result bit for bit)."""
    rows, cols = w.shape[-2:]
    q = codes.view(w.shape).reshape(-1, rows, cols)
    s = scales.view(w.grid).reshape(-1, *w.grid[-2:])
    dest = out.view(-1, rows, cols)
    step, per = w.row_step(), w.block_rows
    in_place = out.dtype == torch.float32 and scales.dtype != torch.uint8
    for e in range(q.shape[0]):
        for r in range(0, rows, step):
            n = min(step, rows - r)
            block, rows_out = _exact(s[e, r // per : (r + n) // per]), dest[e, r : r + n]
            if in_place:
                _scale_in_place(rows_out.copy_(q[e, r : r + n]), block)
            else:
                given = {"weight": q[e, r : r + n], "weight_scale_inv": block}
                rows_out.copy_(op.convert(given)["weight"])
    return out


def _scale_in_place(values: torch.Tensor, scales: torch.Tensor) -> None:
    """``values`` (rows, cols) times its block's scale, each block of ``scales``' grid."""
    (rows, cols), (grid_rows, grid_cols) = values.shape, scales.shape
    blocks = values.view(grid_rows, rows // grid_rows, grid_cols, cols // grid_cols)
    blocks.mul_(scales.view(grid_rows, 1, grid_cols, 1))


def _exact(scales: torch.Tensor) -> torch.Tensor:
    """Float scales as float32, so the product is rounded once, into the compute dtype,
    as transformers rounds it into the parameter's (raw ue8m0 bytes stay uint8: its
    dequantizer decodes those itself)."""
    return scales if scales.dtype == torch.uint8 else scales.float()


def _stored_keys(refs: Mapping[str, TensorRef]) -> dict[tuple[Any, int], str]:
    """Each stored tensor's checkpoint key by where its bytes are: a unit's ref carries
    the model's key, which differs for a renamed tensor or an expert of a fused one."""
    return {(r.file, r.offset): k for k, r in refs.items()}


def _parts(
    refs: Mapping[str, TensorRef], ref: TensorRef, stored_key: str
) -> tuple[TensorRef, TensorRef]:
    """The streamed parts of FP8 weight ``ref``: its codes as ``key::f8`` and its block
    scales as ``key::scale_inv``; a weight without scales is refused, naming it."""
    module = stored_key.removesuffix(".weight")
    names = [f"{module}.{suffix}" for suffix in SCALE_SUFFIXES]
    scale = next((refs[n] for n in names if n in refs), None)
    if scale is None or not stored_key.endswith(".weight"):
        raise ConfigError(
            f"--model (model.path): {ref.file}: {stored_key} is stored in {ref.dtype} but "
            f"has no block scales ({names[0]}): not an FP8 checkpoint transformers can "
            "dequantize"
        )
    return ref.renamed(f"{ref.key}::f8"), scale.renamed(f"{ref.key}::scale_inv")


def _blocked(key: str, codes: TensorRef, scales: TensorRef) -> Blocked:
    """The weight's shape and scale grid, checked: whole blocks, one grid per weight."""
    shape, grid = codes.shape, scales.shape
    if grid in ((), (1,)) and len(shape) == 2:  # one scale for the whole weight
        grid = (1, 1)
    fits = (
        len(shape) >= 2
        and len(grid) == len(shape)
        and grid[:-2] == shape[:-2]
        and all(g > 0 and s % g == 0 for s, g in zip(shape[-2:], grid[-2:]))
    )
    if not fits:
        raise ConfigError(
            f"--model (model.path): {scales.file}: the {tuple(grid)} block scales of "
            f"{key} do not divide its {tuple(shape)} weight into whole blocks (what "
            "transformers' FP8 dequantizer takes)"
        )
    return Blocked(key, tuple(shape), tuple(grid))
