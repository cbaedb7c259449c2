"""Checkpoints stored quantized, streamed as stored: which formats infer reads, how the
weights of each are rebuilt (:class:`StoredWeights`), and the refusal of the rest.

* bitsandbytes 4-bit (the Hub's ``*-bnb-4bit``): :mod:`.prequant`;
* FP8 with block scales (``quant_method: fp8``; DeepSeek-V3, ``*-FP8``): :mod:`.fp8`;
* MXFP4 experts (``quant_method: mxfp4``; openai/gpt-oss-*): built with the fused
  parameters, an expert at a time (:mod:`.fused`);
* compressed-tensors (``quant_method: compressed-tensors``; the Hub's
  ``*-quantized.w4a16``, ``*-w8a16``, ``*-quantized.w8a8``, ``*-FP8-dynamic``,
  ``*-NVFP4A16``): :mod:`.ctensors`.

Any other ``quantization_config`` (GPTQ, AWQ, ...) is refused
before anything loads, naming the method and what to use instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from shoestring.config import ConfigError
from shoestring.hf import quant_method
from shoestring.infer.ctensors import StoredCt, aliased, check_ctensors, ct_compute_dtype
from shoestring.infer.engine import StreamingCausalLM
from shoestring.infer.fp8 import StoredFp8, check_fp8, fp8_compute_dtype
from shoestring.infer.prequant import Stored4bit, bnb_compute_dtype, check_bnb
from shoestring.infer.shards import TensorRef
from shoestring.infer.stream import Prepare

#: The ``quantization_config.quant_method`` values infer streams as stored.
STREAMED = ("bitsandbytes", "fp8", "mxfp4", "compressed-tensors")


class StoredWeights(Protocol):
    """A quantized checkpoint's weights, per unit of the engine: what dequantizing them
    takes, and the hook that does it as each unit is prepared."""

    def shapes(self, i: int) -> dict[str, tuple[int, ...]]:
        """Unit ``i``'s stored-quantized weights: model key -> shape."""
        ...

    def kept(self, i: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """What unit ``i``'s hook makes in a dtype of its own: model key -> shape, dtype."""
        ...

    def scratch(self, i: int, dtype: torch.dtype) -> int:
        """Bytes of unit ``i``'s weights dequantized into ``dtype``."""
        ...

    def temps(self, i: int, dtype: torch.dtype) -> int:
        """Bytes beside them while one of its weights is dequantized."""
        ...

    def hook(self, dtype: torch.dtype) -> Prepare: ...


def stored_weights(engine: StreamingCausalLM) -> StoredWeights | None:
    """The engine's checkpoint as stored quantized (its units repointed at the stored
    parts), or None for a 16/32-bit one."""
    return Stored4bit.of(engine) or StoredFp8.of(engine) or StoredCt.of(engine)


def stored_refs(doc: Mapping[str, Any], refs: dict[str, TensorRef]) -> dict[str, TensorRef]:
    """The checkpoint's tensors as the engine's units take them: a compressed-tensors
    packed weight also under its module's ``weight`` key (:func:`.ctensors.aliased`)."""
    return aliased(doc, refs)


def check_stored(doc: Mapping[str, Any], spec: str, compress: str) -> None:
    """Refuse, before anything loads, a quantized checkpoint infer cannot stream."""
    method = quant_method(doc)
    if method and method not in STREAMED:
        raise ConfigError(
            f"--model (model.path): {spec} is stored quantized by {method} "
            "(quantization_config.quant_method); infer streams 16/32-bit safetensors and "
            "checkpoints stored in bitsandbytes 4-bit, in FP8 with block scales, with "
            "MXFP4 experts or by compressed-tensors: use the model's 16-bit "
            "original (add --compress int8 or nf4 to stream it smaller)"
        )
    check_bnb(doc, spec, compress)
    check_fp8(doc, spec, compress)
    check_ctensors(doc, spec, compress)
    if method == "mxfp4" and compress != "none":
        raise ConfigError(
            f"--compress (compress.scheme): {spec} stores its experts in MXFP4 and "
            f"streams as stored; drop --compress {compress}"
        )


def stored_compute_dtype(doc: Mapping[str, Any]) -> torch.dtype | None:
    """The dtype a quantized checkpoint computes in; None for a 16/32-bit one (its
    tensors' own dtype decides)."""
    return bnb_compute_dtype(doc) or fp8_compute_dtype(doc) or ct_compute_dtype(doc)
