"""The prompt prefix that several sequences of a chunk share, found once per chunk.

Batch jobs often repeat a long prefix (a system prompt, few-shot examples,
instructions) before a short per-item question. The prefill pass computes such a
prefix once: at each layer its one row runs first, and its keys and values are
copied into the caches of the micro-batches that share it before they run that
layer on their suffixes only (:mod:`shoestring.infer.engine`,
:func:`shoestring.infer.kvcache.fill_from_prefix`). A sharing row is laid out as
``[prefix][left pad][suffix]`` with the mask 1/0/1, so the positions the engine
derives from the mask (its ``cumsum``) continue the prefix.

Which prefix: of every group of sequences with a common token prefix, the one that
saves the most prefill tokens, ``(sequences - 1) x prefix tokens``, at least
:data:`MIN_TOKENS` long and shared by at least :data:`MIN_SEQS` sequences. A
sequence's last prompt token is never shared: each row computes it, and its
logits are the row's first next-token choice, so every sharing row keeps a
suffix of at least one token. One prefix per chunk; a pure function of the
chunk's prompts, so a rerun of a chunk shares the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Fewest tokens worth sharing: below this the extra micro-batch costs more than it saves.
MIN_TOKENS = 32
#: Fewest sequences that share a prefix (one alone saves nothing).
MIN_SEQS = 2


@dataclass(frozen=True)
class SharedPrefix:
    """``tokens`` that every sequence in ``rows`` (indices into the chunk) starts with,
    each of them with at least one token more."""

    tokens: list[int]
    rows: list[int]

    def to_dict(self) -> dict[str, int]:
        """What the events record: the prefix's tokens and the sequences sharing it."""
        return {"tokens": len(self.tokens), "seqs": len(self.rows)}

    @property
    def saved(self) -> int:
        """Prefill tokens not computed thanks to sharing."""
        return (len(self.rows) - 1) * len(self.tokens)


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    k = 0
    while k < n and a[k] == b[k]:
        k += 1
    return k


def find_shared_prefix(
    prompts: list[list[int]], min_tokens: int = MIN_TOKENS, min_seqs: int = MIN_SEQS
) -> SharedPrefix | None:
    """The prefix of ``prompts`` whose sharing saves the most prefill tokens (ties: the
    longer prefix, then the earlier sequences), or None when no prefix of at least
    ``min_tokens`` is shared by ``min_seqs`` sequences.

    Sequences sharing a prefix are adjacent once sorted, so the candidates are the runs
    of the sorted order, each sharing the least common prefix of its neighbours."""
    heads = [p[:-1] for p in prompts]  # the last token is every row's own
    order = sorted(range(len(prompts)), key=lambda i: (heads[i], i))
    lcp = [_common(heads[a], heads[b]) for a, b in zip(order, order[1:])]
    best: tuple[int, int, int, int] | None = None  # (saved, length, first, last) in order
    for first in range(len(lcp)):
        length = lcp[first]
        for last in range(first + 1, len(order)):
            length = min(length, lcp[last - 1])
            if length < min_tokens:
                break
            if last - first + 1 >= min_seqs:
                saved = (last - first) * length
                if best is None or (saved, length) > (best[0], best[1]):
                    best = (saved, length, first, last)
    if best is None:
        return None
    _, length, first, last = best
    rows = sorted(order[first : last + 1])
    return SharedPrefix(list(prompts[rows[0]][:length]), rows)
