"""The memory plan: what a budget buys — job batch, micro-batch size, resident layers.

Everything here is arithmetic on the config, the model's unit sizes and the
input lengths, never on measurements, so the same command always gets the same
plan (and therefore the same numerics) after a restart.

Peak memory = runtime reserve + read-ahead ring + per-slot scratch
            + activations of one micro-batch + hidden states of the whole batch
            + KV cache of the whole batch + resident units + slack (1/32 of the
            budget, taken from the resident set only).
Batching is what turns streaming from hopeless into useful (each decode step
reads W bytes for B tokens), so the batch is sized first and resident units
take what is left. The batch is sized against a ring of the costliest unit; the
ring finally reserved holds the costliest *streamed* unit (none when every unit
is resident), and what a smaller ring frees goes to the resident set.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from shoestring.config import ConfigError


@dataclass(frozen=True)
class Plan:
    batch_size: int  # sequences per wave (= per committed chunk)
    micro_tokens: int  # padded tokens per forward call in prefill
    resident: tuple[int, ...]  # indices of units kept resident (largest first)
    depth: int  # read-ahead depth
    budget: int
    breakdown: dict[str, int]  # bytes per part, for the summary and run.json

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def activation_per_token(config: Any, seq_len: int, itemsize: int) -> int:
    """Peak temporaries of one decoder layer per token: the MLP's gate, up and product
    (3 x ffn) plus residual, norm and output (4 x hidden), plus a row of fp32
    attention scores per head (the math SDPA path materializes them)."""
    d = config.hidden_size
    ffn = getattr(config, "intermediate_size", 4 * d)
    return int((4 * d + 3 * ffn) * itemsize + config.num_attention_heads * seq_len * 4)


@dataclass(frozen=True)
class _Activations:
    """Peak activation bytes of one forward call over ``tokens`` tokens of ``batch``
    sequences: a layer's temporaries, plus the logits (fp32 and a log_softmax copy) of
    every scored position, or of one row a sequence when generating."""

    per_token: int
    logit_row: int
    new_tokens: int

    def bytes(self, tokens: int, batch: int) -> int:
        return (
            tokens * self.per_token + (tokens if self.new_tokens == 0 else batch) * self.logit_row
        )


@dataclass(frozen=True)
class _Costs:
    """Bytes each unit holds when resident (``held``) and in a ring slot (``slot``: raw
    bytes plus scratch), and the read-ahead depth."""

    held: list[int]
    slot: list[int]
    depth: int

    def ring(self, streamed: list[int]) -> int:
        """The read-ahead ring: depth + 1 slots of the costliest streamed unit (what
        the streamer allocates); nothing when every unit is resident."""
        if not streamed:
            return 0
        return (min(self.depth, len(streamed)) + 1) * max(self.slot[i] for i in streamed)

    def streamed(self, resident: list[int]) -> list[int]:
        return [i for i in range(len(self.held)) if i not in resident]


def _unit_costs(
    unit_bytes: list[int], unit_extra: list[int], raw_kept: list[bool] | None, depth: int
) -> _Costs:
    slot = [b + e for b, e in zip(unit_bytes, unit_extra)]
    keep = raw_kept if raw_kept is not None else [True] * len(unit_bytes)
    return _Costs([c if k else e for c, k, e in zip(slot, keep, unit_extra)], slot, depth)


def make_plan(
    *,
    budget: int,
    reserve: int,
    unit_bytes: list[int],
    unit_extra: list[int],
    kv_per_token: int,
    config: Any,
    itemsize: int,
    prompt_lens: list[int],
    new_tokens: int,
    want_batch: int,
    micro_tokens: int,
    depth: int,
    want_resident: int,
    pinned_batch: int | None = None,
    pinned_micro: int | None = None,
    raw_kept: list[bool] | None = None,
) -> Plan:
    """Size the job batch, then the prefill micro-batches, then the resident set.

    ``unit_extra[i]`` is the scratch unit ``i`` needs once read (its dequantized
    weights with compression): every ring slot needs the largest, and a resident
    unit keeps its own, and its raw bytes only where ``raw_kept[i]`` (some of its
    tensors are views into them; default: all). ``pinned_*`` come from a previous
    attempt of the same job (run.json): the numerics must not change on resume, so
    they are honoured or the plan fails.
    """
    longest = max(prompt_lens) if prompt_lens else 1
    seq = longest + new_tokens
    costs = _unit_costs(unit_bytes, unit_extra, raw_kept, depth)
    ring = costs.ring(list(range(len(unit_bytes))))  # before the resident set is known
    act = _Activations(
        activation_per_token(config, seq, itemsize), config.vocab_size * 8, new_tokens
    )
    per_seq = seq * kv_per_token + seq * config.hidden_size * itemsize
    room = budget - reserve - ring
    one = act.bytes(longest, 1)
    if room < per_seq + one:
        raise _too_small(budget, reserve, ring, one, per_seq)
    batch = _batch_size(int((room - one) // per_seq), want_batch, len(prompt_lens), pinned_batch)
    left = room - batch * per_seq
    micro = pinned_micro or _micro_tokens(act, micro_tokens, batch, longest, left)
    left -= act.bytes(micro, batch)
    # What the arithmetic above does not see (allocator fragmentation, per-thread
    # buffers, the stacking of KV caches after the prefill) measured tens of MB over a
    # 1.54 GB plan (docs/inference.md); only the resident set pays for the margin, so
    # batch and micro sizes (the numerics) do not depend on it.
    slack = budget // 32
    resident, ring = _resident_and_ring(unit_bytes, costs, left - slack + ring, want_resident)
    parts = {
        "runtime": reserve,
        "read_ahead": ring,
        "activations": act.bytes(micro, batch),
        "kv_and_hidden": batch * per_seq,
        "resident": sum(costs.held[i] for i in resident),
        "slack": slack,
    }
    return Plan(batch, micro, tuple(sorted(resident)), depth, budget, parts)


def _too_small(budget: int, reserve: int, ring: int, act: int, per_seq: int) -> ConfigError:
    need = reserve + ring + per_seq + act
    return ConfigError(
        f"memory.budget: {budget / 1e9:.2f} GB is too small for this model "
        f"and input: one sequence needs {need / 1e9:.2f} GB (runtime "
        f"{reserve / 1e9:.2f} + read-ahead {ring / 1e9:.2f} + activations "
        f"{act / 1e9:.3f} + KV {per_seq / 1e9:.3f}); lower "
        "memory.prefetch_depth or raise the budget"
    )


def _batch_size(fits: int, want: int, n_seqs: int, pinned: int | None) -> int:
    """The job batch: what is wanted, capped by the input and by what ``fits``; or the
    pinned one, if it still fits."""
    if pinned is None:
        return min(want, max(n_seqs, 1), fits)
    if pinned > fits:
        raise ConfigError(
            f"memory.budget: this job was started with a batch of "
            f"{pinned} sequences (see run.json) and the new budget "
            f"fits only {fits}; resume with the original budget"
        )
    return pinned


def _micro_tokens(act: _Activations, want: int, batch: int, longest: int, left: int) -> int:
    """Prefill tokens per forward call: ``want``, cut by quarters until its activations
    fit in ``left``, but never below the longest prompt."""
    micro = min(want, batch * longest)
    while micro > longest and act.bytes(micro, batch) > left:
        micro = max(longest, micro * 3 // 4)
    return max(micro, longest)


def _resident_and_ring(
    unit_bytes: list[int], costs: _Costs, room: int, want: int
) -> tuple[list[int], int]:
    """The resident set that saves the most bytes per pass, and the ring its streamed
    units need, together within ``room`` (``want`` as in :func:`_resident_set`).

    The ring holds the costliest streamed unit, so keeping the ``k`` costliest units
    resident shrinks it (a large embedding: by ``depth`` + 1 of them). Each ``k`` is
    tried, the room left filled largest first; ``k`` = 0 is the plain largest-first set."""
    by_cost = sorted(range(len(unit_bytes)), key=lambda i: (-costs.slot[i], -i))
    best: tuple[int, list[int], int] = (-1, [], costs.ring(by_cost))
    for k in range(len(by_cost) + 1):
        if want >= 0 and k > want:
            break
        forced, rest = by_cost[:k], by_cost[k:]
        spare = room - costs.ring(rest) - sum(costs.held[i] for i in forced)
        if spare < 0:
            continue
        more = _resident_set(unit_bytes, costs.held, spare, want - k if want > 0 else want, rest)
        resident = sorted(forced + more, key=lambda i: (-unit_bytes[i], -i))
        saved = sum(unit_bytes[i] for i in resident)
        if saved > best[0]:
            best = (saved, resident, costs.ring(costs.streamed(resident)))
    return best[1], best[2]


def _resident_set(
    unit_bytes: list[int], held: list[int], left: int, want: int, candidates: list[int]
) -> list[int]:
    """Of ``candidates``, the units kept resident, largest first (ties: later first),
    while they fit in ``left`` (``want`` -1: as many as fit; 0: none; n: at most n)."""
    resident: list[int] = []
    if want == 0:
        return resident
    for i in sorted(candidates, key=lambda i: (-unit_bytes[i], -i)):
        if want > 0 and len(resident) >= want:
            break
        if held[i] <= left:
            left -= held[i]
            resident.append(i)
    return resident
