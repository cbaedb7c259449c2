"""A run's data: sources → tokenized examples (cached) → samples, eval examples, probes.

:class:`DataInputs` is the cheap part, done before anything is written or loaded:
find the sources and their content digests, read the chat template, parse the
held-out records, and parse the training records unless a committed tokenized
cache already exists for them (so a malformed file fails with ``file:line``
before a run directory exists). :func:`load_train_data` then maps the cache — or
builds it once (in parallel) and publishes it next to the checkpoints — and packs.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from shoestring.config import ConfigError
from shoestring.data.cache import CacheWriter, TokenCache, cache_key, open_or_build
from shoestring.data.chat import CHAT_SPANS, load_template
from shoestring.data.formats import ConcreteFormat, parse_record
from shoestring.data.preference import (
    PAIR_LAYOUT,
    pair_examples,
    preference_only,
    tokenize_pairs,
)
from shoestring.data.prompts import Prompt, tokenize_prompts
from shoestring.data.records import DataError, Example, Format, Record
from shoestring.data.sources import read_records, resolve_source, split_eval
from shoestring.data.specials import SPECIALS_POLICY
from shoestring.data.tokenize import TokenizeSpec, check_chat_ready, tokenize_records
from shoestring.train.builtin import BUILTIN_MODEL, BUILTIN_TASKS, builtin_records
from shoestring.train.config import FinetuneConfig, eval_fraction
from shoestring.train.data import SampleOrder
from shoestring.train.evaluate import Probe, probes
from shoestring.train.parallel import BatchPlan
from shoestring.train.rewards import check_fields
from shoestring.train.samples import (
    ExampleStore,
    PackedSamples,
    PaddedSamples,
    PairSamples,
    PromptSamples,
    Samples,
)

#: Files that decide how a model directory's tokenizer encodes and renders text.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
)


@dataclass(frozen=True)
class Origin:
    """Where records come from: a content digest (for the cache key) and a reader."""

    spec: str
    digest: str
    read: Callable[[], tuple[list[Record], Mapping[str, str]]]


def _builtin_origin(task: str, split: str, online: bool) -> Origin:
    rows = builtin_records(split, task)
    if online:  # GRPO: the prompts, the expected answer kept for the rewards
        rows = [{"prompt": r["prompt"], "answer": r["completion"]} for r in rows]
    digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()
    name = f"{task}[{split}]"
    fmt: ConcreteFormat = (
        "prompt" if online else "preference" if "chosen" in rows[0] else "prompt_completion"
    )
    return Origin(
        name,
        digest,
        lambda: (
            [parse_record(r, f"{name}:{i + 1}", fmt) for i, r in enumerate(rows)],
            {name: fmt},
        ),
    )


def origin(spec: str, split: str, cfg: FinetuneConfig, cache_dir: Path) -> Origin:
    online = cfg.train.objective == "grpo"
    if spec in BUILTIN_TASKS:
        return _builtin_origin(spec, split, online)
    key = "data.train" if split == "train" else "data.eval"
    source = resolve_source(spec, cache_dir / "sources", key=key)
    # GRPO reads prompt records, a shape ``auto`` never picks (it would take any
    # prompt/completion file for SFT's): asked for by the objective.
    fmt: Format = "prompt" if online else cfg.data.format
    return Origin(spec, source.digest, lambda: read_records(source, fmt))


def tokenizer_fingerprint(model_path: str) -> str:
    """Content hash of the tokenizer files of a model directory (the built-in one is code)."""
    if model_path == BUILTIN_MODEL:
        return BUILTIN_MODEL
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        p = Path(model_path).expanduser() / name
        if p.is_file():
            h.update(name.encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def token_spec(cfg: FinetuneConfig, template: str | None) -> TokenizeSpec:
    d = cfg.data
    return TokenizeSpec(d.max_length, d.loss_on, d.truncate, template)


def train_cache_key(
    cfg: FinetuneConfig, train: Origin, template: str | None, tokenizer_dir: str | None = None
) -> str:
    """``tokenizer_dir``: the resolved model folder when ``model.path`` is a Hub id or URL."""
    d = cfg.data
    pairs: dict[str, str | int] = (
        {} if cfg.train.objective == "sft" else {"preference_pairs": PAIR_LAYOUT}
    )
    return cache_key(
        {
            **pairs,
            "data": train.digest,
            "format": d.format,
            "tokenizer": tokenizer_fingerprint(tokenizer_dir or cfg.model.path),
            "template": hashlib.sha256((template or "").encode()).hexdigest(),
            "max_length": d.max_length,
            "loss_on": d.loss_on,
            "truncate": d.truncate,
            "specials": SPECIALS_POLICY,
            "chat_spans": CHAT_SPANS,
            "eval_fraction": str(eval_fraction(d.eval)),
            "seed": cfg.train.seed if eval_fraction(d.eval) else 0,
        }
    )


def cache_root(cache_dir: Path) -> Path:
    return cache_dir / "data"


@dataclass(frozen=True)
class DataInputs:
    """Checked before anything is written: sources, template, held-out records, and the
    training records themselves unless a tokenized cache for them is committed here."""

    train: Origin
    key: str
    template: str | None
    train_records: list[Record] | None
    eval_records: list[Record]
    formats: Mapping[str, str]

    @classmethod
    def prepare(
        cls, cfg: FinetuneConfig, cache_dir: Path, tokenizer_dir: str | None = None
    ) -> DataInputs:
        template = load_template(cfg.data.chat_template) if cfg.data.chat_template else None
        train = origin(cfg.data.train, "train", cfg, cache_dir)
        key = train_cache_key(cfg, train, template, tokenizer_dir)
        records: list[Record] | None = None
        formats: Mapping[str, str] = {}
        cached = cfg.data.cache and (cache_root(cache_dir) / key / "manifest.json").is_file()
        online = cfg.train.objective == "grpo"  # prompts are kept in memory, never cached
        if online or not cached or eval_fraction(cfg.data.eval) is not None:
            records, formats = train.read()
        eval_records = _eval_records(cfg, records, cache_dir)
        if records is not None and eval_fraction(cfg.data.eval) is not None:
            records, _ = split_eval(records, eval_fraction(cfg.data.eval) or 0, cfg.train.seed)
        preference_only([*(records or ()), *eval_records], cfg.train.objective)
        if online:
            check_fields(cfg.grpo.rewards, [*(records or ()), *eval_records])
        return cls(train, key, template, records, eval_records, formats)


def _eval_records(cfg: FinetuneConfig, train: list[Record] | None, cache_dir: Path) -> list[Record]:
    spec = cfg.data.eval
    fraction = eval_fraction(spec)
    if fraction is not None:
        assert train is not None
        return split_eval(train, fraction, cfg.train.seed)[1]
    if spec == "auto":
        spec = cfg.data.train if cfg.data.train in BUILTIN_TASKS else ""
    if not spec:
        return []
    try:
        float(spec)
    except ValueError:
        return origin(spec, "eval", cfg, cache_dir).read()[0]
    raise ConfigError(f"data.eval: a fraction must be between 0 and 1 (exclusive), got {spec}")


@dataclass(frozen=True)
class TrainData:
    """What the step and the evaluation read."""

    samples: Samples
    eval_examples: list[Example]
    probes: list[Probe]
    order: SampleOrder
    batch: BatchPlan
    samples_count: int  # tokenized training samples (before packing)
    summary: dict[str, Any]  # the ``data`` event's fields, logged after ``run_start``
    #: ``dpo.precompute_ref``: the reference log-probs of ``eval_examples`` (then cut to
    #: the pairs evaluation reads, see :mod:`shoestring.train.reflogps`).
    eval_ref: npt.NDArray[np.float64] | None = None
    #: ``train.objective grpo``: the held-out prompts (evaluation samples and scores them).
    eval_prompts: Sequence[Prompt] = ()


@dataclass(frozen=True)
class DataContext:
    """What loading needs from the run: where caches live and its stop flag."""

    cache_dir: Path
    remote: str | None
    should_stop: Callable[[], bool]
    tty: bool = False


def _fill(
    cfg: FinetuneConfig, inputs: DataInputs, tok: Any, ctx: DataContext
) -> Callable[[CacheWriter], dict[str, Any]]:
    def fill(writer: CacheWriter) -> dict[str, Any]:
        records, formats = (
            (inputs.train_records, inputs.formats)
            if inputs.train_records is not None
            else inputs.train.read()
        )
        spec = token_spec(cfg, inputs.template)
        check_chat_ready(tok, spec, any(r.kind == "chat" for r in records))
        if cfg.train.objective != "sft":
            pairs = tokenize_pairs(records, tok, spec, writer.add_many, ctx.should_stop)
            if not pairs.samples:
                raise DataError(f"{inputs.train.spec}: no pair is left after data.truncate")
            return {"stats": vars(pairs), "formats": formats, "records": len(records)}
        workers = cfg.data.workers or os.cpu_count() or 1
        _, stats = tokenize_records(
            records,
            tok,
            spec,
            workers=workers,
            progress=ctx.tty,
            should_stop=ctx.should_stop,
            sink=writer.add_many,
        )
        if not stats.samples:
            raise DataError(f"{inputs.train.spec}: no sample is left after data.truncate")
        return {"stats": vars(stats), "formats": formats, "records": len(records)}

    return fill


def _store(
    cfg: FinetuneConfig, inputs: DataInputs, tok: Any, ctx: DataContext
) -> tuple[ExampleStore, Sequence[int], dict[str, Any], Path | None]:
    """The tokenized samples, their lengths, how they were obtained, and where a packing
    plan is kept (beside the cache; None without one)."""
    fill = _fill(cfg, inputs, tok, ctx)
    if not cfg.data.cache:
        mem = _MemoryWriter()
        meta = fill(mem)  # type: ignore[arg-type]
        lengths = [len(e.input_ids) for e in mem.examples]
        return mem.examples, lengths, {**meta, "cache": "off"}, None
    store, status = open_or_build(cache_root(ctx.cache_dir), inputs.key, fill, remote=ctx.remote)
    plan = store.path / f"packing-{cfg.data.max_length}.npy"
    return store, store.lengths.tolist(), {**store.meta, "cache": status}, plan


class _MemoryWriter:
    """The cache writer's interface over a list (``data.cache false``)."""

    def __init__(self) -> None:
        self.examples: list[Example] = []

    def add(self, ex: Example) -> None:
        self.examples.append(ex)

    def add_many(self, exs: Sequence[Example]) -> None:
        self.examples.extend(exs)


def _samples(
    cfg: FinetuneConfig, store: ExampleStore, lengths: Sequence[int], plan: Path | None
) -> Samples:
    """Pairs (dpo, orpo), packed rows (data.packing) or padded samples."""
    if cfg.train.objective != "sft":
        return PairSamples(store)
    if cfg.data.packing:
        return PackedSamples.pack(
            store,
            lengths,
            cfg.data.max_length,
            flatten=cfg.model.attn_implementation == "flash_attention_2",
            saved=plan,
        )
    return PaddedSamples(store)


def _prompt_data(
    cfg: FinetuneConfig, inputs: DataInputs, batch: BatchPlan, tok: Any, ctx: DataContext
) -> TrainData:
    """GRPO's prompts, tokenized in memory (a prompt set is small next to its rollouts)."""
    t0 = time.perf_counter()
    records = inputs.train_records or []
    spec = token_spec(cfg, inputs.template)
    check_chat_ready(tok, spec, any(r.kind == "chat" for r in records))
    prompts, stats = tokenize_prompts(
        records, tok, inputs.template, cfg.data.max_length, ctx.should_stop
    )
    if not prompts:
        raise DataError(
            f"{inputs.train.spec}: no prompt fits data.max_length={cfg.data.max_length}"
        )
    held_out, _ = tokenize_prompts(inputs.eval_records, tok, inputs.template, cfg.data.max_length)
    lengths = [len(p.ids) for p in prompts]
    meta = {"stats": vars(stats), "formats": inputs.formats, "cache": "off"}
    samples = PromptSamples(prompts)
    summary = _data_summary(inputs, meta, len(prompts), len(prompts), sum(lengths), t0)
    order = SampleOrder(len(samples), cfg.train.seed)
    return TrainData(samples, [], [], order, batch, len(prompts), summary, eval_prompts=held_out)


def load_train_data(
    cfg: FinetuneConfig, inputs: DataInputs, batch: BatchPlan, tok: Any, ctx: DataContext
) -> TrainData:
    if cfg.train.objective == "grpo":
        return _prompt_data(cfg, inputs, batch, tok, ctx)
    t0 = time.perf_counter()
    store, lengths, meta, plan = _store(cfg, inputs, tok, ctx)
    preference = cfg.train.objective != "sft"
    samples = _samples(cfg, store, lengths, plan)
    spec = token_spec(cfg, inputs.template)
    if inputs.eval_records:
        check_chat_ready(tok, spec, any(r.kind == "chat" for r in inputs.eval_records))
    held_out = replace(spec, truncate="drop")
    eval_examples = (
        pair_examples(inputs.eval_records, tok, held_out)
        if preference
        else tokenize_records(inputs.eval_records, tok, held_out)[0]
    )
    summary = _data_summary(inputs, meta, len(lengths), len(samples), sum(lengths), t0)
    return TrainData(
        samples,
        eval_examples,
        []
        if preference
        else probes(inputs.eval_records, tok, inputs.template, cfg.data.max_length),
        SampleOrder(len(samples), cfg.train.seed),
        batch,
        len(lengths),
        summary,
    )


def _data_summary(
    inputs: DataInputs,
    meta: dict[str, Any],
    samples: int,
    rows: int,
    tokens: int,
    t0: float,
) -> dict[str, Any]:
    stats = meta.get("stats", {})
    return dict(
        source=inputs.train.spec,
        formats=meta.get("formats", inputs.formats),
        cache=meta.get("cache"),
        cache_key=inputs.key,
        samples=samples,
        rows=rows,
        tokens=tokens,
        truncated=stats.get("truncated", 0),
        dropped=stats.get("dropped", 0),
        eval_samples=len(inputs.eval_records),
        seconds=round(time.perf_counter() - t0, 3),
    )


__all__ = ["DataInputs", "TrainData", "DataContext", "load_train_data", "TokenCache"]
