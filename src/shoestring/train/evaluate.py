"""Held-out evaluation: loss and perplexity, and exact match by greedy decoding.

Both stop early (returning ``None``) when ``should_stop()`` becomes true, so a
preemption notice during a long eval is honoured within one batch. Neither
touches the global RNG, so evaluating never changes the training trajectory.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shoestring.train.data import IGNORE_INDEX, Example, Record, collate
from shoestring.train.device import to_device


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
            batch = to_device(collate(examples[i : i + batch_size], pad_id), device)
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


@torch.no_grad()
def exact_match(
    model: Any,
    tok: Any,
    records: Sequence[Record],
    max_new_tokens: int,
    batch_size: int,
    should_stop: Callable[[], bool],
    device: torch.device | None = None,
) -> dict[str, float] | None:
    """Greedy-decode each prompt; count completions reproduced exactly (up to EOS)."""
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    groups: dict[int, list[tuple[list[int], str]]] = defaultdict(list)
    for r in records:
        ids = bos + tok.encode(r.prompt or "", add_special_tokens=False)
        groups[len(ids)].append((ids, r.completion or ""))
    was_training = model.training
    model.eval()
    hits = n = 0
    try:
        for _length, items in sorted(groups.items()):
            # Same-length prompts batch without padding, so no position-id subtleties.
            for i in range(0, len(items), batch_size):
                if should_stop():
                    return None
                chunk = items[i : i + batch_size]
                ids = torch.tensor([c[0] for c in chunk], device=device)
                out = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    use_cache=True,
                    pad_token_id=tok.pad_token_id,
                    eos_token_id=tok.eos_token_id,
                )
                for row, (_ids, want) in zip(out[:, ids.size(1) :].tolist(), chunk):
                    if tok.eos_token_id in row:
                        row = row[: row.index(tok.eos_token_id)]
                    hits += int(tok.decode(row, skip_special_tokens=True) == want)
                    n += 1
    finally:
        model.train(was_training)
    return {"exact_match": hits / max(n, 1), "samples": n}
