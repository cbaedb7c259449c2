"""Held-out evaluation: loss and perplexity, and exact match by greedy decoding.

Both stop early (returning ``None``) when ``should_stop()`` becomes true, so a
preemption notice during a long eval is honoured within one batch. Neither
touches the global RNG, so evaluating never changes the training trajectory.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shoestring.data.chat import end_of_turn_ids, prompt_text
from shoestring.data.records import IGNORE_INDEX, Example, Record
from shoestring.data.specials import encode, plain_prompt_ids
from shoestring.data.tokenize import ids_within
from shoestring.train.device import to_device
from shoestring.train.samples import collate_padded


@torch.no_grad()
def eval_loss(
    model: Any,
    examples: Sequence[Example],
    batch_size: int,
    pad_id: int,
    should_stop: Callable[[], bool],
    device: torch.device | None = None,
) -> dict[str, float] | None:
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for i in range(0, len(examples), batch_size):
            if should_stop():
                return None
            batch = to_device(collate_padded(examples[i : i + batch_size], pad_id), device)
            labels = batch.pop("labels")
            logits = model(**batch).logits.float()
            shift_logits = logits[:, :-1].reshape(-1, logits.size(-1))
            shift_labels = labels[:, 1:].reshape(-1)
            loss = torch.nn.functional.cross_entropy(
                shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum"
            )
            total += float(loss)
            count += int((shift_labels != IGNORE_INDEX).sum())  # one sync per batch
    finally:
        model.train(was_training)
    mean = total / max(count, 1)
    return {"loss": mean, "perplexity": math.exp(min(mean, 50.0)), "tokens": count}


@dataclass(frozen=True)
class Probe:
    """One exact-match question: the prompt as training rendered it, and the answer."""

    prompt: list[int]
    want: str
    stop: tuple[int, ...]


def probes(
    records: Sequence[Record], tok: Any, template: str | None, max_length: int
) -> list[Probe]:
    """Prompt+completion records and conversations ending in an assistant turn, rendered
    the way training renders them (the tokenizer's own prefix + prompt, see
    :mod:`shoestring.data.specials`; the chat template up to the answer). A prompt of
    more than ``max_length`` tokens is left out, as evaluation drops such examples, and
    is judged by a bounded cut (:func:`ids_within`), never tokenized whole."""
    eos = (tok.eos_token_id,) if tok.eos_token_id is not None else ()
    out: list[Probe] = []
    for r in records:
        if r.messages is not None:
            last = r.messages[-1]
            if last.get("role") == "assistant" and isinstance(last.get("content"), str):
                text = prompt_text(r.messages[:-1], tok, template, r.tools)
                ids = ids_within(text, lambda t: encode(tok, t), max_length)
                stop = tuple(end_of_turn_ids(tok, template)) or eos
                if ids is not None:
                    out.append(Probe(ids, last["content"], stop))
        elif r.is_pair:
            ids = ids_within(r.prompt or "", lambda t: plain_prompt_ids(tok, t), max_length)
            if ids is not None:
                out.append(Probe(ids, r.completion or "", eos))
    return out


def _answer(tok: Any, row: list[int], stop: tuple[int, ...]) -> str:
    cut = next((i for i, t in enumerate(row) if t in stop), len(row))
    return str(tok.decode(row[:cut], skip_special_tokens=True))


@torch.no_grad()
def exact_match(
    model: Any,
    tok: Any,
    items: Sequence[Probe],
    max_new_tokens: int,
    batch_size: int,
    should_stop: Callable[[], bool],
    device: torch.device | None = None,
) -> dict[str, float] | None:
    """Greedy-decode each prompt; count answers reproduced exactly (up to a stop token)."""
    groups: dict[int, list[Probe]] = defaultdict(list)
    for p in items:
        groups[len(p.prompt)].append(p)
    was_training = model.training
    model.eval()
    hits = n = 0
    try:
        for _length, group in sorted(groups.items()):
            # Same-length prompts batch without padding, so no position-id subtleties.
            for i in range(0, len(group), batch_size):
                if should_stop():
                    return None
                chunk = group[i : i + batch_size]
                ids = torch.tensor([p.prompt for p in chunk], device=device)
                out = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    use_cache=True,
                    pad_token_id=tok.pad_token_id,
                    eos_token_id=list(chunk[0].stop) or None,
                )
                for row, p in zip(out[:, ids.size(1) :].tolist(), chunk):
                    hits += int(_answer(tok, row, p.stop) == p.want)
                    n += 1
    finally:
        model.train(was_training)
    return {"exact_match": hits / max(n, 1), "samples": n}
