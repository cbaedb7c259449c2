"""The memory plan: what a budget buys — job batch, micro-batch size, resident layers.

Everything here is arithmetic on the config, the model's unit sizes, the input
lengths and the runtime the job measured when it planned (``reserve``), never on
measurements taken while it runs, so the same command gets the same plan.

Peak memory = runtime (the process as it plans, plus what the first pass sets up)
            + read-ahead ring (``depth`` + 1 slots, see below) + what preparing one
            unit needs on top of its slot (dequantization row blocks, an adapter's
            ``B @ A`` row blocks)
            + activations of one forward call (a layer's temporaries with the KV
            cache handling of one layer, or the head's logits) + hidden states of
            the whole batch + KV cache of the whole batch + resident units
            + slack (1/32 of the budget).
Batching is what turns streaming from hopeless into useful (each decode step
reads W bytes for B tokens), so the batch is sized first, within the budget less
the slack, and resident units take what is left. The batch is sized against a
ring of the costliest unit; the ring finally reserved holds the costliest
*streamed* unit (none when every unit is resident), and what a smaller ring frees
goes to the resident set. Reading a resident unit that is rebuilt in scratch (cast
or dequantized) holds its raw bytes for a moment at start; the resident set leaves
room for that too.

Where a unit is prepared (:data:`~shoestring.infer.stream.PrepareAt`) decides what a
slot holds. ``"ahead"`` (the reader prepares it, overlapping compute): each slot holds
a unit's raw bytes *and* its scratch (dequantized weights, casts to the compute dtype).
``"on_compute"`` (the consumer prepares it just before compute): each slot holds raw
bytes only, plus one scratch set for the whole ring. With compression the scratch is
the larger part (an int8 layer dequantized to fp32 is 4x its bytes as read), so only
``"on_compute"`` lets a compressed model stream in less memory than the exact one. The
plan prefers ``"ahead"`` and takes ``"on_compute"`` only where it buys a larger batch
(or any at all); the tensors are the same either way, so the choice is not pinned.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, get_args

from shoestring.config import ConfigError
from shoestring.infer.config import MemoryConfig
from shoestring.infer.ledger import Pinned
from shoestring.infer.prefix import MIN_SEQS, MIN_TOKENS
from shoestring.infer.stream import PrepareAt

#: A first attempt's: nothing pinned yet.
NOTHING_PINNED = Pinned()


@dataclass(frozen=True)
class Budget:
    """``memory.budget`` in bytes, and the part of it the process itself takes."""

    total: int
    runtime: int  # measured as the job plans (or memory.runtime_reserve, if larger)


@dataclass(frozen=True)
class Needs:
    """What the weights take in memory, per unit, beyond the runtime."""

    read: list[int]  # bytes streamed
    extra: list[int]  # slot scratch: dequantized weights, casts to the compute dtype
    prepare: list[int] = field(default_factory=list)  # temporaries while it is prepared
    build: int = 0  # writing a copy of the layers, at its peak (0: nothing to write)
    #: per unit: whether a resident unit keeps its raw bytes once prepared (None: all do)
    raw_kept: list[bool] | None = None
    #: per unit: which scratch buffers it prepares into (embed, the decoder layers, head):
    #: a ring slot keeps each kind's buffers for the next unit of that kind, so a slot
    #: holds every kind's at once (None: all units one kind)
    kinds: list[str] | None = None


@dataclass(frozen=True)
class ModelShape:
    """The model as the plan sees it: its config (hidden, ffn, heads, vocab), the compute
    dtype's size and the KV cache's bytes per token (see
    :func:`shoestring.infer.engine.kv_bytes_per_token` and ``kv_scratch_per_token``)."""

    config: Any
    itemsize: int
    kv_per_token: int  # 0: no KV cache (scoring)
    kv_scratch_per_token: int = 0


@dataclass(frozen=True)
class Lengths:
    """The input as the plan sees it: every sequence's prompt length, the most tokens any
    generates, and whether some sequence samples or wants logprobs."""

    prompts: list[int]
    new_tokens: int
    sampling: bool = False


@dataclass(frozen=True)
class StreamPlan:
    batch_size: int  # sequences per wave (= per committed chunk)
    micro_tokens: int  # padded tokens per forward call in prefill
    resident: tuple[int, ...]  # indices of units kept resident (largest first)
    depth: int  # read-ahead depth
    budget: int
    breakdown: dict[str, int]  # bytes per part, for the summary and run.json
    prepare_at: PrepareAt = "ahead"  # where units are prepared (module docstring)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def activation_per_token(config: Any, seq_len: int, itemsize: int) -> int:
    """Peak temporaries of one decoder layer per token: the MLP's gate, up and product
    (3 x ffn) plus residual, norm and output (4 x hidden), plus a row of fp32
    attention scores per head (the math SDPA path materializes them)."""
    d = config.hidden_size
    ffn = getattr(config, "intermediate_size", 4 * d)
    return int((4 * d + 3 * ffn) * itemsize + config.num_attention_heads * seq_len * 4)


def logit_bytes(itemsize: int, generating: bool, sampling: bool) -> int:
    """Bytes per vocabulary entry of one row of logits at the head: the lm_head's output
    and its fp32 copy; scoring adds a log_softmax; sampling (or logprobs) adds the
    float32 copies of ``sampling.pick`` (the busy and sampled rows, the tempered
    logits, their full-vocabulary rows and log_softmax: 5 x 4 bytes)."""
    if not generating:
        return max(itemsize + 4, 8)
    return 24 if sampling else itemsize + 4


@dataclass(frozen=True)
class _Activations:
    """Peak bytes of one forward call: a layer's temporaries over its tokens, with one
    layer's KV cache handled at once per sequence (``kv_scratch``: the copy its
    update concatenates into, or an 8-bit cache's dequantized K/V), or the head's
    logits (one row a sequence when generating, every scored position of one
    sequence when scoring), whichever is larger: the head runs after the layers."""

    per_token: int
    kv_scratch: int  # per sequence
    logit_row: int
    generating: bool
    longest: int

    def bytes(self, tokens: int, batch: int) -> int:
        if self.generating:  # decode feeds every sequence of the batch in one call
            layer = max(tokens, batch) * self.per_token + batch * self.kv_scratch
            return max(layer, batch * self.logit_row)
        return max(tokens * self.per_token, self.longest * self.logit_row)


@dataclass(frozen=True)
class _Costs:
    """Bytes each unit holds when resident (``held``), as read (``read``), as scratch
    once prepared (``scratch``: its kind's buffers, ``kinds``), and for a moment while it
    is read as a resident unit whose raw bytes are then dropped (``load``: those raw
    bytes; 0 when they are kept)."""

    held: list[int]
    read: list[int]
    scratch: list[int]
    load: list[int]
    depth: int
    at: PrepareAt
    kinds: list[str]

    def ring(self, streamed: list[int]) -> int:
        """The read-ahead ring: depth + 1 slots (what the streamer allocates: each a raw
        buffer for the largest streamed unit, and ``"ahead"`` its scratch buffers), plus,
        prepared ``"on_compute"``, the one scratch set they share; nothing when every
        unit is resident."""
        if not streamed:
            return 0
        return self._slots(streamed) * self.slot_bytes(streamed) + self.shared(streamed)

    def _slots(self, streamed: list[int]) -> int:
        return min(self.depth, len(streamed)) + 1

    def slot_bytes(self, streamed: list[int]) -> int:
        """One slot: the largest unit as read, and ``"ahead"`` the scratch it keeps."""
        raw = max(self.read[i] for i in streamed)
        return raw + (self._scratch_set(streamed) if self.at == "ahead" else 0)

    def _scratch_set(self, streamed: list[int]) -> int:
        """A scratch set serving ``streamed``: each kind's largest (its buffers are
        reused by the next unit of that kind, and kept while other kinds pass)."""
        most: dict[str, int] = {}
        for i in streamed:
            most[self.kinds[i]] = max(most.get(self.kinds[i], 0), self.scratch[i])
        return sum(most.values())

    def shared(self, streamed: list[int]) -> int:
        """The scratch set the ring shares (``"on_compute"``; 0 ``"ahead"``)."""
        if self.at == "ahead" or not streamed:
            return 0
        return self._scratch_set(streamed)

    def holds(self, streamed: list[int]) -> str:
        """What the ring holds, in words (for the refusal)."""
        slots, raw = self._slots(streamed), self.slot_bytes(streamed)
        if self.at == "on_compute":
            return (
                f"the read-ahead holds {slots} units as read ({_mb(raw)} MB each, "
                f"compressed where compression is on) and one unit dequantized or cast to "
                f"the compute dtype just before it computes ({_mb(self.shared(streamed))} MB)"
            )
        if not any(self.scratch[i] for i in streamed):
            return f"the read-ahead holds {slots} units as read ({_mb(raw)} MB each)"
        return (
            f"the read-ahead holds {slots} units ({_mb(raw)} MB each), each as read and "
            "as prepared (dequantized or cast to the compute dtype) ahead of compute"
        )

    def streamed(self, resident: list[int]) -> list[int]:
        return [i for i in range(len(self.held)) if i not in resident]

    def starting(self, resident: list[int]) -> int:
        """Peak while the resident units are read at start (nothing else is yet)."""
        return sum(self.held[i] for i in resident) + max(
            (self.load[i] for i in resident), default=0
        )


def _unit_costs(needs: Needs, depth: int, at: PrepareAt) -> _Costs:
    unit_bytes, unit_extra = needs.read, needs.extra
    raw_kept = needs.raw_kept
    keep = raw_kept if raw_kept is not None else [True] * len(unit_bytes)
    held = [b + e if k else e for b, k, e in zip(unit_bytes, keep, unit_extra)]
    load = [0 if k else b for b, k in zip(unit_bytes, keep)]
    kinds = needs.kinds or [""] * len(unit_bytes)
    return _Costs(held, list(unit_bytes), list(unit_extra), load, depth, at, kinds)


@dataclass(frozen=True)
class _Fixed:
    """What the plan takes before the batch: runtime, one unit's preparation, slack."""

    budget: int
    runtime: int
    prepare: int
    prefix: int = 0  # a shared prompt prefix computed in the prefill (:func:`prefix_bytes`)

    @property
    def slack(self) -> int:
        # What the arithmetic does not see (allocator fragmentation, per-thread
        # buffers); reserved even when the batch fills the budget.
        return self.budget // 32

    @property
    def room(self) -> int:
        return self.budget - self.runtime - self.prepare - self.prefix - self.slack


def prefix_bytes(shape: ModelShape, lengths: Lengths, memory: MemoryConfig) -> int:
    """What computing a shared prompt prefix once holds during a prefill, beyond what the
    batch holds anyway: the prefix row's hidden states and one layer's keys and values
    (each layer's are dropped once copied into the sharing rows, whose caches are as
    large as without sharing), at most the longest prompt less its last token. 0 where
    nothing can be shared: ``memory.share_prefix`` off, scoring, one sequence, prompts
    shorter than :data:`~shoestring.infer.prefix.MIN_TOKENS`."""
    longest = max(lengths.prompts, default=0) - 1
    if memory.share_prefix == "off" or not shape.kv_per_token or longest < MIN_TOKENS:
        return 0
    if len(lengths.prompts) < MIN_SEQS:
        return 0
    config = shape.config
    per_layer = shape.kv_per_token // config.num_hidden_layers
    return int(longest * (config.hidden_size * shape.itemsize + per_layer))


def make_plan(
    budget: Budget,
    needs: Needs,
    shape: ModelShape,
    lengths: Lengths,
    memory: MemoryConfig,
    pinned: Pinned = NOTHING_PINNED,
) -> StreamPlan:
    """Size the job batch, then the prefill micro-batches, then the resident set.

    ``needs.extra[i]``: the scratch unit ``i`` needs once read (dequantized or cast
    weights); a resident unit keeps its raw bytes only where ``needs.raw_kept[i]``.
    ``needs.prepare[i]``: what preparing it takes on top, for a moment. ``memory``: the
    wanted batch, micro-batch tokens, read-ahead depth and resident units. ``pinned``:
    from an earlier attempt (run.json), honoured or the plan fails (the numerics must
    not change).
    """
    prompt_lens, depth = lengths.prompts, memory.prefetch_depth
    longest = max(prompt_lens) if prompt_lens else 1
    act, per_seq = _per_call_and_per_seq(shape, longest, lengths)
    fixed = _Fixed(
        budget.total,
        budget.runtime,
        max(needs.prepare or [0], default=0),
        prefix_bytes(shape, lengths, memory),
    )
    want_batch, pinned_batch = memory.batch_size, pinned.batch_size
    sizing = _Sizing(act, per_seq, longest, fixed, pinned_batch or want_batch, pinned_batch)
    options = [_unit_costs(needs, depth, at) for at in get_args(PrepareAt)]
    costs, fits = _where_to_prepare(sizing, options, len(prompt_lens))
    ring = costs.ring(list(range(len(needs.read))))  # before the resident set is known
    room = fixed.room - ring
    batch = _batch_size(fits, want_batch, len(prompt_lens), pinned_batch)
    left = room - batch * per_seq
    micro = pinned.micro_tokens or _micro_tokens(
        act, memory.micro_batch_tokens, batch, longest, left
    )
    left -= act.bytes(micro, batch)
    resident, ring = _resident_and_ring(needs.read, costs, left + ring, fixed.room, memory.resident)
    parts = {
        "runtime": budget.runtime,
        "read_ahead": ring,
        "prepare": fixed.prepare,
        "activations": act.bytes(micro, batch),
        "kv_and_hidden": batch * per_seq,
        "shared_prefix": fixed.prefix,
        "resident": sum(costs.held[i] for i in resident),
        "slack": fixed.slack,
    }
    resident_units = tuple(sorted(resident))
    return StreamPlan(batch, micro, resident_units, depth, budget.total, parts, costs.at)


@dataclass(frozen=True)
class _Sizing:
    """What sizing the batch takes: one forward call's activations, each sequence's KV
    cache and hidden states, the longest prompt, the fixed parts, the most sequences
    wanted (or pinned: then the slack may be used too, a rerun's measured runtime can
    differ a little)."""

    act: _Activations
    per_seq: int
    longest: int
    fixed: _Fixed
    most: int
    pinned: int | None

    def fits(self, costs: _Costs, units: int) -> int:
        """The largest batch that fits beside a ring of ``costs`` (0: not one)."""
        room = self.fixed.room - costs.ring(list(range(units)))
        if self.pinned is not None:
            room += self.fixed.slack
        return _most_that_fit(self.act, self.per_seq, self.longest, room, self.most)


def _where_to_prepare(sizing: _Sizing, options: list[_Costs], n_seqs: int) -> tuple[_Costs, int]:
    """Of ``options`` (one per place to prepare, ``"ahead"`` first), the one whose ring
    leaves room for the largest batch, and that batch before it is capped; ties go to
    the first (overlap). Refuses when not one sequence fits beside the smallest ring."""
    units = len(options[0].held)
    everything = list(range(units))
    least = min(options, key=lambda c: c.ring(everything))
    one = sizing.per_seq + sizing.act.bytes(sizing.longest, 1)
    if sizing.fixed.room - least.ring(everything) < one:
        raise _too_small(sizing.fixed, least, everything, one - sizing.per_seq, sizing.per_seq)
    best, best_fits = options[0], sizing.fits(options[0], units)
    for costs in options[1:]:
        fits = sizing.fits(costs, units)
        if min(fits, max(n_seqs, 1)) > min(best_fits, max(n_seqs, 1)):
            best, best_fits = costs, fits
    return best, best_fits


def _per_call_and_per_seq(
    shape: ModelShape, longest: int, lengths: Lengths
) -> tuple[_Activations, int]:
    """The activations of one forward call, and what each sequence of the batch holds
    (KV cache and hidden states at its longest)."""
    new_tokens, config, itemsize = lengths.new_tokens, shape.config, shape.itemsize
    seq = longest + new_tokens
    act = _Activations(
        activation_per_token(config, seq, itemsize),
        seq * shape.kv_scratch_per_token if new_tokens else 0,
        config.vocab_size * logit_bytes(itemsize, new_tokens > 0, lengths.sampling),
        new_tokens > 0,
        longest,
    )
    return act, seq * shape.kv_per_token + seq * config.hidden_size * itemsize


def _most_that_fit(act: _Activations, per_seq: int, longest: int, room: int, most: int) -> int:
    """The largest batch (at most ``most``) whose KV cache, hidden states and smallest
    micro-batch's activations fit in ``room``; 0 if not even one does."""
    lo, hi = 0, max(most, 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mid * per_seq + act.bytes(longest, mid) <= room:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _too_small(
    fixed: _Fixed, costs: _Costs, streamed: list[int], act: int, per_seq: int
) -> ConfigError:
    ring = costs.ring(streamed)
    need = fixed.runtime + ring + fixed.prepare + fixed.prefix + act + per_seq + fixed.slack
    # At depth 1 the ring is the unit being computed and the one being read: the least
    # that streams at all (the largest unit twice: the embedding or head of a big vocab).
    fix = (
        "lower memory.prefetch_depth or raise the budget"
        if costs.depth > 1
        else f"raise the budget to {need / 1e9:.2f} GB (memory.prefetch_depth is already 1)"
    )
    prefix = f"{_mb(fixed.prefix)} MB a shared prompt prefix + " if fixed.prefix else ""
    return ConfigError(
        f"memory.budget: {fixed.budget / 1e9:.2f} GB is too small for this model "
        f"and input: one sequence needs {need / 1e9:.2f} GB ({_mb(fixed.runtime)} MB "
        f"runtime + {_mb(ring)} MB read-ahead + {_mb(fixed.prepare)} MB preparing a unit "
        f"+ {_mb(act)} MB activations + {_mb(per_seq)} MB KV cache and hidden states + "
        f"{prefix}{_mb(fixed.slack)} MB slack; {costs.holds(streamed)}); {fix}"
    )


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f}"


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
    unit_bytes: list[int], costs: _Costs, room: int, start_room: int, want: int
) -> tuple[list[int], int]:
    """The resident set that saves the most bytes per pass, and the ring its streamed
    units need, together within ``room`` (``want`` as in :func:`_resident_set`), and
    read at start within ``start_room``.

    Each ring slot's raw buffer holds the largest streamed unit, so keeping the ``k``
    largest units resident shrinks it (a large embedding: by ``depth`` + 1 of them).
    Each ``k`` is tried, the room left filled largest first; ``k`` = 0 is the plain
    largest-first set."""
    by_cost = sorted(range(len(unit_bytes)), key=lambda i: (-costs.read[i], -i))
    best: tuple[int, list[int], int] = (-1, [], costs.ring(by_cost))
    for k in range(len(by_cost) + 1):
        if want >= 0 and k > want:
            break
        forced, rest = by_cost[:k], by_cost[k:]
        spare = room - costs.ring(rest) - sum(costs.held[i] for i in forced)
        if spare < 0 or costs.starting(forced) > start_room:
            continue
        more = _resident_set(unit_bytes, costs.held, spare, want - k if want > 0 else want, rest)
        resident = sorted(forced + more, key=lambda i: (-unit_bytes[i], -i))
        while costs.starting(resident) > start_room:
            resident.pop()  # the smallest: a raw buffer read at start does not fit
        ring = costs.ring(costs.streamed(resident))
        saved = sum(unit_bytes[i] for i in resident)
        if saved > best[0] and ring + sum(costs.held[i] for i in resident) <= room:
            best = (saved, resident, ring)
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


def check_setup(budget: Budget, build: int) -> None:
    """Refuse a budget that cannot hold writing the copy of the layers, compressed or
    decoded (``build`` bytes at its peak, beyond the runtime), with the slack."""
    total, reserve = budget.total, budget.runtime
    need = reserve + build + total // 32
    if build and need > total:
        raise ConfigError(
            f"memory.budget: {total / 1e9:.2f} GB is too small to write the copy of this "
            f"model's layers: it needs {need / 1e9:.2f} GB ({_mb(reserve)} MB runtime "
            f"+ {_mb(build)} MB for one layer read, rebuilt and written + "
            f"{_mb(total // 32)} MB slack); raise the budget"
        )
