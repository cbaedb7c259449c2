"""What one position of the sample order stands for: a sample, or a packed row of samples.

The trainer asks a :class:`Samples` for a micro-batch of positions and for the label
tokens of the global batch (the loss normaliser). :class:`PaddedSamples` pads each
sample to the longest in its micro-batch (with an attention mask);
:class:`PackedSamples` concatenates whole samples into ``max_length`` rows chosen by
best-fit packing, with per-sample position ids so attention never crosses samples.
Both read examples from any indexable store: a list, or the memory-mapped cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from shoestring.data.packing import PackPlan, collate_packed, flatten_packed, pack_plan
from shoestring.data.prompts import Prompt
from shoestring.data.records import IGNORE_INDEX, Example


class ExampleStore(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> Example: ...


class Samples(Protocol):
    def __len__(self) -> int: ...
    def collate(self, positions: Sequence[int], pad_id: int) -> dict[str, torch.Tensor]: ...
    def label_tokens(self, position: int) -> int: ...
    def tokens(self, position: int) -> int: ...


def _labels(ex: Example) -> int:
    """Label tokens that enter the loss (labels shift by one, so the first never does)."""
    return sum(1 for t in ex.labels[1:] if t != IGNORE_INDEX)


def collate_padded(batch: Sequence[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example; padding is masked out of attention and loss."""
    width = max(len(ex.input_ids) for ex in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ex in enumerate(batch):
        n = len(ex.input_ids)
        ids[row, :n] = torch.tensor(ex.input_ids)
        labels[row, :n] = torch.tensor(ex.labels)
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@dataclass(frozen=True)
class PaddedSamples:
    store: ExampleStore

    def __len__(self) -> int:
        return len(self.store)

    def collate(self, positions: Sequence[int], pad_id: int) -> dict[str, torch.Tensor]:
        return collate_padded([self.store[i] for i in positions], pad_id)

    def label_tokens(self, position: int) -> int:
        return _labels(self.store[position])

    def tokens(self, position: int) -> int:
        return len(self.store[position].input_ids)


@dataclass(frozen=True)
class PackedSamples:
    """Position ``p`` is row ``bins[p]``: whole samples, at most ``width`` tokens.

    ``flatten``: flash attention separates packed samples only within a batch of one
    row, so a micro-batch's rows are laid end to end (each row starts with an ignored
    label, so nothing is learned across rows)."""

    store: ExampleStore
    plan: PackPlan
    width: int
    flatten: bool = False

    @classmethod
    def pack(
        cls,
        store: ExampleStore,
        lengths: Sequence[int],
        width: int,
        flatten: bool = False,
        saved: Path | None = None,
    ) -> PackedSamples:
        """Best-fit rows of ``width`` tokens (read from ``saved`` beside a cache, if there)."""
        return cls(store, pack_plan(lengths, width, saved), width, flatten)

    def __len__(self) -> int:
        return len(self.plan)

    def collate(self, positions: Sequence[int], pad_id: int) -> dict[str, torch.Tensor]:
        rows = [[self.store[i] for i in self.plan.row(p)] for p in positions]
        batch = collate_packed(rows, pad_id, self.width)
        return flatten_packed(batch) if self.flatten else batch

    def label_tokens(self, position: int) -> int:
        # A packed row trains no sample's first token, exactly like a padded sample.
        return sum(_labels(self.store[i]) for i in self.plan.row(position))

    def tokens(self, position: int) -> int:
        return sum(len(self.store[i].input_ids) for i in self.plan.row(position))


@dataclass(frozen=True)
class PairSamples:
    """Position ``p`` is preference pair ``p``: examples ``2p`` (chosen) and ``2p + 1``
    (rejected). A micro-batch of k pairs is 2k padded rows, the chosen ones first (TRL's
    layout); ``ref`` (reference log-probs, laid out like the examples) adds them as
    ``ref_logps``."""

    store: ExampleStore
    ref: npt.NDArray[np.float64] | None = None

    def __len__(self) -> int:
        return len(self.store) // 2

    def collate(self, positions: Sequence[int], pad_id: int) -> dict[str, torch.Tensor]:
        rows = [2 * p for p in positions] + [2 * p + 1 for p in positions]
        batch = collate_padded([self.store[i] for i in rows], pad_id)
        if self.ref is not None:
            batch["ref_logps"] = torch.from_numpy(np.asarray(self.ref[rows], dtype=np.float64))
        return batch

    def label_tokens(self, position: int) -> int:
        return _labels(self.store[2 * position]) + _labels(self.store[2 * position + 1])

    def tokens(self, position: int) -> int:
        return sum(len(self.store[2 * position + k].input_ids) for k in (0, 1))

    def chosen_labels(self, position: int) -> int:
        """Label tokens of the chosen answer (SimPO's NLL term counts them)."""
        return _labels(self.store[2 * position])

    def chosen_positions(self, position: int) -> int:
        """Positions of the chosen sequence that predict a token (ORPO's NLL counts them)."""
        return len(self.store[2 * position].input_ids) - 1


@dataclass(frozen=True)
class PromptSamples:
    """Position ``p`` is prompt ``p`` (``train.objective grpo``): the step samples its
    completions, so a prompt alone is never a training row; ``collate`` gives the
    prompts right-padded, with no labels."""

    prompts: Sequence[Prompt]

    def __len__(self) -> int:
        return len(self.prompts)

    def collate(self, positions: Sequence[int], pad_id: int) -> dict[str, torch.Tensor]:
        batch = [
            Example(list(self.prompts[p].ids), [IGNORE_INDEX] * len(self.prompts[p].ids))
            for p in positions
        ]
        return collate_padded(batch, pad_id)

    def label_tokens(self, position: int) -> int:
        return 0

    def tokens(self, position: int) -> int:
        return len(self.prompts[position].ids)
