"""The memory budget, parsed once, and the two passes of the memory plan.

A job with ``compress.scheme`` writes a compressed copy of the decoder layers before
it runs; a budget too small must be refused before that is written. So the plan is
made twice, on the same budget, model shape, input lengths and settings:

1. :func:`predicted_plan`: on the copy's *predicted* unit sizes, with writing the copy
   checked against the budget; refuses before anything is read or written.
2. :func:`real_plan`: once the weights are set up (the copy written, an adapter's
   hook in place), on the *real* unit sizes, with the process's runtime measured again.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoestring.infer.config import MemoryConfig, parse_size
from shoestring.infer.engine import StreamingCausalLM, kv_bytes_per_token, kv_scratch_per_token
from shoestring.infer.ledger import Pinned
from shoestring.infer.plan import (
    Budget,
    Lengths,
    ModelShape,
    Needs,
    StreamPlan,
    check_setup,
    make_plan,
)
from shoestring.infer.report import current_rss
from shoestring.infer.work import Work

#: What the process adds once its passes run, beyond the plan's buffers and its RSS
#: when it planned: the kernels' first use (oneDNN primitives, OpenMP), masks and
#: rotary tables, allocator slack. Measured 7-19 MB over six modes of a 122 MB model,
#: with 1 and 2 threads (docs/inference.md).
FIRST_PASS_BYTES = 32 << 20
#: The measured runtime is rounded up to this, so a rerun plans the same from it.
_RUNTIME_GRAIN = 8 << 20


@dataclass(frozen=True)
class MemoryBudget:
    """``memory.budget`` and ``memory.runtime_reserve``, parsed once."""

    total: int
    least_runtime: int | None  # a size given for memory.runtime_reserve (None: auto)

    @classmethod
    def parse(cls, memory: MemoryConfig) -> MemoryBudget:
        reserve = memory.runtime_reserve
        return cls(parse_size(memory.budget), None if reserve == "auto" else parse_size(reserve))

    def measured(self) -> Budget:
        """The budget with its runtime part measured now: the process's RSS (interpreter,
        torch, the tokenizer and tokenized input, the model skeleton, an adapter) plus
        :data:`FIRST_PASS_BYTES`, rounded up; a ``memory.runtime_reserve`` size only
        raises it."""
        measured = -(-(current_rss() + FIRST_PASS_BYTES) // _RUNTIME_GRAIN) * _RUNTIME_GRAIN
        if self.least_runtime is not None:
            measured = max(measured, self.least_runtime)
        return Budget(self.total, measured)


@dataclass(frozen=True)
class Planner:
    """What both passes of the plan share: the budget, the model's shape, the input's
    lengths, the memory settings and what an earlier attempt pinned."""

    budget: MemoryBudget
    shape: ModelShape
    lengths: Lengths
    memory: MemoryConfig
    pinned: Pinned

    @classmethod
    def of(
        cls,
        memory: MemoryConfig,
        engine: StreamingCausalLM,
        work: Work,
        generating: bool,
        pinned: Pinned,
    ) -> Planner:
        """The model's shape (compute dtype, KV cache bytes at ``memory.kv_bits``) and
        the input's lengths, read once for both passes."""
        new = work.most_new_tokens if generating else 0
        dtype, bits = engine.dtype, memory.kv_bits
        shape = ModelShape(
            engine.config,
            dtype.itemsize,
            kv_bytes_per_token(engine.config, dtype, bits) if new else 0,
            kv_scratch_per_token(engine.config, dtype, bits),
        )
        lengths = Lengths(
            [len(s) for seqs in work.seqs for s in seqs] or [1],  # (all errors)
            new,
            work.samples,
        )
        return cls(MemoryBudget.parse(memory), shape, lengths, memory, pinned)

    def plan(self, needs: Needs) -> tuple[Budget, StreamPlan]:
        budget = self.budget.measured()
        return budget, make_plan(budget, needs, self.shape, self.lengths, self.memory, self.pinned)


def predicted_plan(planner: Planner, predicted: Needs) -> StreamPlan:
    """The plan on the weights' predicted sizes, with writing the compressed copy checked
    too: a budget too small for either is refused before the copy is written."""
    budget, plan = planner.plan(predicted)
    check_setup(budget, predicted.build)
    return plan


def real_plan(planner: Planner, needs: Needs) -> StreamPlan:
    """The plan the job runs with: on the weights as set up, the runtime measured again."""
    return planner.plan(needs)[1]
