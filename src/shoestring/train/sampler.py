"""GRPO's completions, each drawn from its own random stream, whatever it is batched with.

Completion ``k`` of the prompt at position ``p`` in step ``s`` draws every token from a
generator seeded by (``train.seed``, ``s``, ``p``, ``k``) alone: Gumbel-max sampling,
``argmax(log q + g)`` with ``g = -log e``, ``e ~ Exp(1)`` drawn from the row's
generator, one vector per decoding step, is a draw from ``q`` (the tempered,
top-k/top-p-filtered distribution, made by transformers' own warpers). transformers'
``generate`` runs it as greedy decoding with :class:`KeyedSampler` as the last logits
processor. So several prompts sampled in one left-padded batch (``grpo.sample_prompts``)
draw what each would draw alone — up to the float noise of a padded, batched forward —
and one prompt at a time (the default) gives the same completions at any world size.
A resumed run, its weights restored exactly, samples what the uninterrupted run sampled.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shoestring.data.prompts import Prompt


@dataclass(frozen=True)
class Sampling:
    """How completions are sampled (``grpo.*``)."""

    generations: int
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    #: Prompts whose groups one ``generate`` call samples together.
    prompts_per_call: int = 1


def row_seed(seed: int, step: int, position: int, k: int) -> int:
    """The seed of completion ``k`` of the prompt at ``position`` in ``step``."""
    digest = hashlib.sha256(struct.pack("<qqqq", seed, step, position, k)).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _warpers(s: Sampling) -> list[Any]:
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    out: list[Any] = []
    if s.temperature != 1.0:
        out.append(TemperatureLogitsWarper(s.temperature))
    if s.top_k:
        out.append(TopKLogitsWarper(s.top_k))
    if s.top_p < 1.0:
        out.append(TopPLogitsWarper(s.top_p))
    return out


class KeyedSampler:
    """A logits processor: each row's scores become ``log q + Gumbel noise`` from the
    row's own generator, so greedy decoding samples ``q`` row by row."""

    def __init__(self, seeds: Sequence[int], s: Sampling, device: torch.device) -> None:
        self.generators = [torch.Generator(device=device).manual_seed(x) for x in seeds]
        self.warpers = _warpers(s)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        logq = torch.log_softmax(scores.float(), dim=-1)
        width = scores.shape[-1]
        e = torch.stack(
            [
                torch.empty(width, device=scores.device).exponential_(generator=g)
                for g in self.generators
            ]
        )
        return logq - e.log()


def _cut(row: list[int], stop: tuple[int, ...]) -> tuple[list[int], bool]:
    """The completion up to and including its first stop token; whether it had none."""
    for i, t in enumerate(row):
        if t in stop:
            return row[: i + 1], False
    return row, True


def _left_padded(
    prompts: Sequence[Prompt], copies: int, pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p.ids) for p in prompts)
    ids = torch.full((len(prompts) * copies, width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        rows = slice(i * copies, (i + 1) * copies)
        ids[rows, width - len(p.ids) :] = torch.tensor(p.ids)
        mask[rows, width - len(p.ids) :] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def sample(
    model: Any,
    prompts: Sequence[tuple[int, Prompt]],
    s: Sampling,
    seed: int,
    step: int,
    pad_id: int,
    device: torch.device,
) -> list[tuple[list[int], bool]]:
    """``s.generations`` completions of each ``(position, prompt)``, in order, sampled in
    one ``generate`` call (the model already in eval mode): each ``(ids, truncated)``."""
    from transformers import GenerationConfig, LogitsProcessorList

    group = s.generations
    seeds = [row_seed(seed, step, p, k) for p, _ in prompts for k in range(group)]
    ids, mask = _left_padded([p for _, p in prompts], group, pad_id, device)
    stops = sorted({t for _, p in prompts for t in p.stop})
    config = GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=s.max_new_tokens,
        eos_token_id=stops or None,
        pad_token_id=pad_id,
        use_cache=True,
    )
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        generation_config=config,
        logits_processor=LogitsProcessorList([KeyedSampler(seeds, s, device)]),
    )
    rows = out[:, ids.shape[1] :].tolist()
    return [_cut(row, prompts[i // group][1].stop) for i, row in enumerate(rows)]
