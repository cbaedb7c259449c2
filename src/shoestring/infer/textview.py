"""A vision-language checkpoint streamed as the text model it contains.

Gemma 3 from 4B up is published as one ``Gemma3ForConditionalGeneration``: a text
decoder beside a vision tower and a projector, stored under the checkpoint's own names
(the Hub's: ``language_model.model.layers.0...``; transformers 5 runs them as
``model.language_model.layers.0...``). Prompts here are text, which the tower never
sees, so the engine builds the text model alone (``Gemma3ForCausalLM`` of the
``text_config``: the same decoder modules, mask and head) and reads only the decoder's
tensors, renamed to it. Which stored tensor is which is transformers' own conversion
mapping for the whole model; the tower's tensors are never read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shoestring.hf import VISION_FAMILIES
from shoestring.infer.shards import ShardError, TensorRef


def has_tower(config: Any) -> bool:
    """Whether ``config`` is a vision-language model's (a text decoder beside a tower)."""
    return getattr(config, "vision_config", None) is not None


def text_model(config: Any, dtype: torch.dtype | None) -> tuple[Any, Any]:
    """(the text config, its causal LM on the meta device); a family outside
    :data:`shoestring.hf.VISION_FAMILIES` is refused by name."""
    from transformers import AutoModelForCausalLM

    if config.model_type not in VISION_FAMILIES:
        raise ShardError(
            f"a vision-language model ({config.model_type}): streamed as its text model "
            f"here are {', '.join(sorted(VISION_FAMILIES))} only"
        )
    text = config.get_text_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(text, dtype=dtype)
    return text, model


def _path(model: Any, module: Any) -> str:
    return str(next(name for name, m in model.named_modules() if m is module))


@dataclass(frozen=True)
class TextView:
    """How a vision-language checkpoint's names map onto its text model: each module
    path of the whole model (its decoder, its head) to the text model's."""

    whole: Any  # the whole model on the meta device
    moves: dict[str, str]

    def name(self, key: str) -> str | None:
        """``key`` (the whole model's, as transformers 5 and peft name it) in the text
        model; None for the tower's."""
        for old, new in self.moves.items():
            if key.startswith(old + "."):
                return new + key[len(old) :]
        return None

    def refs(self, refs: dict[str, TensorRef]) -> dict[str, TensorRef]:
        """The decoder's and head's stored tensors under the text model's names, found by
        transformers' conversion mapping for the whole model (the Hub's names too)."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )

        transforms = get_model_conversion_mapping(self.whole)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        meta = self.whole.state_dict()
        out: dict[str, TensorRef] = {}
        for key, ref in refs.items():
            target, _ = rename_source_key(
                key, renamings, converters, self.whole.base_model_prefix, meta
            )
            if (name := self.name(target)) is not None:
                out[name] = ref.renamed(name)
        if not out:
            raise ShardError(
                f"no tensor of the checkpoint maps onto {type(self.whole).__name__}'s text decoder"
            )
        return out


def text_view(model_dir: Path, text: Any) -> TextView | None:
    """The view of the checkpoint in ``model_dir`` as the engine's model ``text``; None
    for a text model's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    if not has_tower(config):
        return None
    with torch.device("meta"):
        whole = AutoModelForCausalLM.from_config(config)
    moves = {  # the decoder, and the head (absent when tied: the embedding serves)
        _path(whole, whole.get_decoder()): _path(text, text.get_decoder()),
        _path(whole, whole.get_output_embeddings()): _path(text, text.get_output_embeddings()),
    }
    return TextView(whole, moves)
