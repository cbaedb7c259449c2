"""Generation and likelihood scoring over a job batch, on the streaming engine.

Sequences are sorted by length (longest first, stable) and grouped into
micro-batches of at most ``micro_tokens`` prompt tokens, left-padded to the
group's longest. Every pass moves all micro-batches through a unit before the
next unit is read. The grouping depends only on the inputs and ``micro_tokens``,
so the same job always computes the same numbers.

Each sequence has its own length limit, end tokens, stop strings, way of
choosing tokens (greedy or sampled, :mod:`shoestring.infer.sampling`) and, if it
asked for one, response format (:mod:`shoestring.infer.structured`); a sequence
that ends leaves its micro-batch at once (:mod:`shoestring.infer.compact`), so the
passes that follow compute only the sequences still running.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers.cache_utils import DynamicLayer

from shoestring.infer.compact import drop_finished
from shoestring.infer.engine import MicroBatch, PassStopped, StreamingCausalLM
from shoestring.infer.kvcache import Int8KVLayer, merge_left_padded
from shoestring.infer.prefix import SharedPrefix, find_shared_prefix
from shoestring.infer.sampleparams import Choice
from shoestring.infer.sampling import Pick, StopStrings, pick
from shoestring.infer.structured import HeldAnswers

#: Why a sequence ended: an end token, a stop string, or its length limit.
Finish = Literal["eos", "stop", "length"]


@dataclass
class Generated:
    tokens: list[int]
    finish: Finish
    logprobs: list[float] = field(default_factory=list)  # per token, when asked for
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # alternatives per token


@dataclass(frozen=True)
class Rules:
    """How each sequence of a chunk continues and when it ends (lists: per sequence)."""

    limits: list[int]  # most new tokens
    eos_ids: frozenset[int] = frozenset()
    choices: list[Choice] | None = None  # None: greedy, no logprobs
    stops: list[StopStrings | None] | None = None
    held: HeldAnswers | None = None  # sequences held to a response format

    @classmethod
    def uniform(cls, n: int, max_new_tokens: int, eos_ids: set[int]) -> Rules:
        return cls([max_new_tokens] * n, frozenset(eos_ids))

    def ended(self, i: int, g: Generated, token: int) -> Finish | None:
        """Why sequence ``i`` ends after ``token`` (already appended), if it does."""
        if token in self.eos_ids:
            return "eos"
        stops = self.stops[i] if self.stops is not None else None
        if stops is not None and stops.hit(g.tokens):
            return "stop"
        if self.held is not None and self.held.complete(i, g.tokens):
            return "stop"
        return "length" if len(g.tokens) >= self.limits[i] else None

    def hold(self, logits: torch.Tensor, rows: list[int], out: list[Generated]) -> None:
        """Set to -inf, in place, the logits of every token that the response format
        of row r's sequence ``rows[r]`` does not allow next (one masked fill)."""
        if self.held is None:
            return
        allowed = self.held.allowed(rows, [out[i].tokens for i in rows], logits.shape[1])
        if allowed is not None:
            barred = torch.from_numpy(~allowed).to(logits.device)
            logits.masked_fill_(barred, float("-inf"))


def group(lengths: list[int], micro_tokens: int) -> list[list[int]]:
    """Indices grouped longest-first so each group's padded size stays <= micro_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= micro_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), t), dtype=torch.long)
    for r, s in enumerate(seqs):
        if s:
            ids[r, t - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[r, t - len(s) :] = 1
    return ids, mask


@dataclass
class GenState:
    """Where a chunk's generation stands between passes: everything the next pass needs.

    Consistent after every completed pass (``step`` of them), which is where the job
    saves it when asked to stop (:mod:`shoestring.infer.partial`)."""

    groups: list[list[int]]  # sequence indices per micro-batch
    mbs: list[MicroBatch]  # next tokens, masks and KV caches per micro-batch
    out: list[Generated]
    done: list[bool]
    step: int = 0  # passes completed (0: prefill still to do)
    prefix: SharedPrefix | None = None  # what its prefill shares (None: nothing)


def start(
    engine: StreamingCausalLM,
    prompts: list[list[int]],
    *,
    pad_id: int,
    micro_tokens: int,
    share_prefix: bool = True,
) -> GenState:
    """The state before the prefill: prompts grouped and left-padded, empty caches.

    With ``share_prefix`` (where the engine can: :meth:`StreamingCausalLM.shares_prefix`),
    the prefix that saves the most prefill tokens (:mod:`shoestring.infer.prefix`) is
    computed once: the sequences sharing it are grouped by their suffixes, laid out as
    ``[prefix][left pad][suffix]`` (mask 1/0/1) with only the suffix fed; the others as
    before."""
    shared = find_shared_prefix(prompts) if share_prefix and engine.shares_prefix() else None
    rows = set(shared.rows) if shared is not None else set()
    groups, mbs = _micro_batches(
        engine, prompts, [i for i in range(len(prompts)) if i not in rows], pad_id, micro_tokens
    )
    if shared is not None:
        n = len(shared.tokens)
        prefix = MicroBatch(
            torch.tensor([shared.tokens]), torch.ones(1, n, dtype=torch.long), engine.new_cache()
        )
        suffixes = [p[n:] if i in rows else [] for i, p in enumerate(prompts)]
        more, sharing = _micro_batches(engine, suffixes, shared.rows, pad_id, micro_tokens)
        for mb in sharing:
            ones = torch.ones(mb.attention_mask.shape[0], n, dtype=torch.long)
            mb.attention_mask, mb.prefix = torch.cat([ones, mb.attention_mask], dim=1), prefix
        groups, mbs = groups + more, mbs + sharing
    out = [Generated([], "length") for _ in prompts]
    return GenState(groups, mbs, out, [False] * len(prompts), prefix=shared)


def _micro_batches(
    engine: StreamingCausalLM,
    seqs: list[list[int]],
    rows: list[int],
    pad_id: int,
    micro_tokens: int,
) -> tuple[list[list[int]], list[MicroBatch]]:
    """``seqs[i]`` for ``i`` in ``rows``, grouped (indices into ``seqs``) and left-padded,
    each group with an empty cache."""
    groups = [[rows[j] for j in g] for g in group([len(seqs[i]) for i in rows], micro_tokens)]
    mbs = []
    for g in groups:
        ids, mask = _left_pad([seqs[i] for i in g], pad_id)
        mbs.append(MicroBatch(ids, mask, cache=engine.new_cache()))
    return groups, mbs


def generate(
    engine: StreamingCausalLM,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_ids: set[int],
    pad_id: int,
    micro_tokens: int,
    on_pass: Callable[[], None] = lambda: None,
) -> list[Generated]:
    """Greedy continuation of every prompt: one prefill pass, then one pass per token."""
    state = start(engine, prompts, pad_id=pad_id, micro_tokens=micro_tokens)
    rules = Rules.uniform(len(prompts), max_new_tokens, eos_ids)
    return generate_from(engine, state, rules=rules, pad_id=pad_id, on_pass=on_pass)


def generate_from(
    engine: StreamingCausalLM,
    state: GenState,
    *,
    rules: Rules,
    pad_id: int,
    on_pass: Callable[[], None] = lambda: None,
    stop: Callable[[], bool] | None = None,
) -> list[Generated]:
    """Continue every sequence of ``state`` by ``rules``: a prefill pass (if not done
    yet), then one pass per token until every sequence has ended. ``on_pass`` runs
    after each pass, with ``state`` complete for it (it may raise to stop; the state can
    then be saved and generation resumed from it).

    ``stop`` is asked between the units of a pass: a pass can take a minute on a big
    model, more than a 30 s preemption notice. When it says yes, the pass is abandoned,
    the caches are cut back to where the pass began, and :class:`PassStopped` is
    raised with ``state`` as after the last complete pass. Caches that cannot be cut
    back (a sliding window that already dropped its oldest token) are never stopped
    mid-pass; the pass then ends normally."""
    for i, g in enumerate(state.out):  # a limit of 0 (or a state saved at its end)
        if not state.done[i] and len(g.tokens) >= rules.limits[i]:
            state.done[i], g.finish = True, "length"
    while not all(state.done):
        marks = _cache_marks(state.mbs) if stop is not None else None
        try:
            picks = engine.forward_pass(
                state.mbs, _chooser(engine, state, rules), stop if marks is not None else None
            )
        except PassStopped:
            assert marks is not None
            _cut_back(state.mbs, marks)
            raise
        _advance(engine, state, rules, picks, pad_id)
        on_pass()
    return state.out


def _chooser(
    engine: StreamingCausalLM, state: GenState, rules: Rules
) -> Callable[[MicroBatch, torch.Tensor], list[Pick]]:
    """The pass's head: each running row's next token, chosen by its sequence's rule."""
    groups = iter(state.groups)

    def head(mb: MicroBatch, h: torch.Tensor) -> list[Pick]:
        g = next(groups)
        logits = engine.logits(h[:, -1, :])
        rules.hold(logits, g, state.out)
        if rules.choices is None:
            return [Pick(int(t)) for t in logits.argmax(-1).cpu()]
        return pick(logits, [rules.choices[i] for i in g], [len(state.out[i].tokens) for i in g])

    return head


def _advance(
    engine: StreamingCausalLM,
    state: GenState,
    rules: Rules,
    picks: list[list[Pick]],
    pad_id: int,
) -> None:
    """Record the pass's tokens, end the sequences that are done, feed the rest their
    token, and drop the ended ones from their micro-batches."""
    out, done = state.out, state.done
    for g, mb, row in zip(state.groups, state.mbs, picks):
        for i, p in zip(g, row):
            if done[i]:
                continue  # a row that could not leave its micro-batch
            out[i].tokens.append(p.token)
            if p.logprob is not None:
                out[i].logprobs.append(p.logprob)
                out[i].top.append(list(p.top))
            why = rules.ended(i, out[i], p.token)
            if why is not None:
                done[i], out[i].finish = True, why
        mb.input_ids = torch.tensor([[pad_id if done[i] else p.token] for i, p in zip(g, row)])
        mb.attention_mask = torch.cat(
            [mb.attention_mask, torch.ones((len(g), 1), dtype=torch.long)], dim=1
        )
    state.groups, state.mbs = drop_finished(state.groups, state.mbs, done)
    if state.step == 0:
        state.groups, state.mbs = _merge_for_decode(engine, state.groups, state.mbs)
    state.step += 1


def _cache_marks(mbs: list[MicroBatch]) -> list[list[int]] | None:
    """Per micro-batch and cache layer, the stored length before a pass; None when some
    layer could not be cut back to it (a layer kind that drops or rewrites old tokens,
    such as a sliding window)."""
    marks = []
    for mb in mbs:
        if mb.cache is None or any(
            type(layer) not in (DynamicLayer, Int8KVLayer) for layer in mb.cache.layers
        ):
            return None
        marks.append([layer.get_seq_length() for layer in mb.cache.layers])
    return marks


def _cut_back(mbs: list[MicroBatch], marks: list[list[int]]) -> None:
    for mb, row in zip(mbs, marks):
        for layer, n in zip(mb.cache.layers, row):
            layer.crop(n - layer.get_seq_length())


def _merge_for_decode(
    engine: StreamingCausalLM, groups: list[list[int]], mbs: list[MicroBatch]
) -> tuple[list[list[int]], list[MicroBatch]]:
    """After the prefill, one micro-batch for all sequences.

    Micro-batches bound prefill activations; a decode pass feeds one token per
    sequence, so its activations are small, and one GEMM over all rows reads each
    weight from RAM once instead of once per group (on one CPU thread, several
    small GEMMs cost clearly more than one of all their rows; measured:
    docs/inference.md, benchmarks/README.md). The merged cache is left-padded to
    the longest group, which the plan already budgets (every sequence at the
    longest prompt). Sliding-window caches, and CUDA's offloaded cache (not yet
    measured), keep their groups.
    """
    if len(mbs) < 2 or engine.device.type != "cpu":
        return groups, mbs
    cache = merge_left_padded([mb.cache for mb in mbs], engine.new_cache())
    if cache is None:
        return groups, mbs
    width = max(mb.attention_mask.shape[1] for mb in mbs)
    mask = torch.cat(
        [
            torch.nn.functional.pad(mb.attention_mask, (width - mb.attention_mask.shape[1], 0))
            for mb in mbs
        ]
    )
    ids = torch.cat([mb.input_ids for mb in mbs])
    return [[i for g in groups for i in g]], [MicroBatch(ids, mask, cache=cache)]


@dataclass
class Scored:
    logprob: float  # sum of log p(completion token | prefix), natural log
    tokens: int  # completion tokens scored
    greedy: bool  # every completion token is the argmax


def score(
    engine: StreamingCausalLM,
    seqs: list[tuple[list[int], int]],
    *,
    pad_id: int,
    micro_tokens: int,
    on_pass: Callable[[], None] = lambda: None,
) -> list[Scored]:
    """Log-likelihood of ``tokens[start:]`` given ``tokens[:start]`` for each (tokens, start).

    One prefill pass, no KV cache; the last token is not fed (nothing follows it to
    predict), so a sequence may be one token longer than the model's context, as
    lm-eval's ``hf`` backend scores it. The lm_head runs only on the positions that
    predict a completion token."""
    fed = [toks[:-1] for toks, _ in seqs]
    groups = group([len(f) for f in fed], micro_tokens)
    mbs = [MicroBatch(*_left_pad([fed[i] for i in g], pad_id)) for g in groups]

    def head(mb: MicroBatch, h: torch.Tensor, g: list[int]) -> list[Scored]:
        t = h.shape[1]
        res = []
        for r, i in enumerate(g):
            toks, start = seqs[i]
            n = len(toks)
            off = t - (n - 1)
            pos = torch.arange(off + start - 1, off + n - 1, device=h.device)
            logp = torch.log_softmax(engine.logits(h[r, pos]), dim=-1)
            target = torch.tensor(toks[start:], device=h.device)
            lp = logp.gather(-1, target[:, None])[:, 0]
            res.append(
                Scored(float(lp.double().sum()), n - start, bool((logp.argmax(-1) == target).all()))
            )
        return res

    it = iter(groups)
    results = engine.forward_pass(mbs, lambda mb, h: head(mb, h, next(it)))
    on_pass()
    out: list[Scored | None] = [None] * len(seqs)
    for g, res in zip(groups, results):
        for i, s in zip(g, res):
            out[i] = s
    return [s for s in out if s is not None]


def prompt_logits(engine: StreamingCausalLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """fp32 logits at every position of each prompt, one micro-batch per prompt (no
    padding): what a check against an in-memory reference model compares."""
    mbs = [MicroBatch(torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long)) for p in prompts]
    return engine.forward_pass(mbs, lambda mb, h: engine.logits(h)[0])
