"""Records → examples (token ids and labels), truncated to ``data.max_length``.

Three kinds of record: ``text`` (loss on every token after the tokenizer's own prefix),
``pair`` (loss on the completion and EOS) and ``chat`` (rendered by the chat template;
loss per ``data.loss_on``, see :mod:`shoestring.data.chat`). Which special tokens
surround text and pairs is :mod:`shoestring.data.specials`' policy, the one eval and
inference follow: for a tokenizer that adds BOS itself (Llama) text and pairs give
exactly the ids and labels the trainer has always given.

Records are tokenized in chunks with batch encoding; ``workers > 1`` spreads the
chunks of a large dataset over a pool of spawned processes. The result is the same for
any number of workers.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from shoestring.data.chat import encode_with_offsets, label_tokens, render_chats, require_fast
from shoestring.data.records import (
    IGNORE_INDEX,
    DataError,
    Example,
    LossOn,
    Record,
    Truncate,
)
from shoestring.data.specials import Specials, encode_many, specials
from shoestring.proc import die_with_parent

#: Records per unit of work: ``should_stop`` is polled and progress shown per chunk.
CHUNK = 1024
#: Fewer records than this are tokenized in this process: a worker is a fresh interpreter
#: that imports the tokenizer's library first. Where a pool starts to pay on 2 cores:
#: benchmarks/tokenize_pool.py (benchmarks/README.md).
MIN_PARALLEL_RECORDS = 16 * CHUNK
#: A text piece (a text, a prompt, a completion, a rendered conversation) of at most this
#: many characters per token of ``data.max_length`` (+ :data:`SLACK`) is tokenized whole.
CHARS_PER_TOKEN = 8
#: Tokens past ``data.max_length`` that a cut piece must still give, so that the place of
#: the cut cannot change the tokens truncation keeps.
SLACK = 64


@dataclass(frozen=True)
class TokenizeSpec:
    """How records become examples (the ``data.*`` settings that matter here)."""

    max_length: int
    loss_on: LossOn = "assistant"
    truncate: Truncate = "right"
    #: Jinja source overriding the tokenizer's template (``data.chat_template``, already read).
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if self.max_length < 1:
            raise ValueError(f"data.max_length must be at least 1, got {self.max_length}")


@dataclass
class TokenizeStats:
    """What tokenizing did: kept samples, truncated and dropped ones, token counts."""

    samples: int = 0
    truncated: int = 0
    dropped: int = 0
    tokens: int = 0
    label_tokens: int = 0
    kinds: dict[str, int] = field(default_factory=dict)  # "text" / "pair" / "chat" → records

    def add(self, other: TokenizeStats) -> None:
        self.samples += other.samples
        self.truncated += other.truncated
        self.dropped += other.dropped
        self.tokens += other.tokens
        self.label_tokens += other.label_tokens
        for kind, n in other.kinds.items():
            self.kinds[kind] = self.kinds.get(kind, 0) + n


ChunkResult = tuple[list[Example], TokenizeStats]
#: A conversation's token ids and each token's ``(start, end)`` characters.
Encoding = tuple[list[int], np.ndarray]
E = TypeVar("E")
ChunkResults = Generator[ChunkResult, None, None]


# --------------------------------------------------------------------------- long pieces
#
# Tokenizing a 50 MB line whole takes ~10 GB (ids, offsets and the tokenizer's own
# structures per character) to keep 2048 of its tokens. A piece longer than
# CHARS_PER_TOKEN * (max_length + SLACK) characters is tokenized in growing cuts instead
# — its first characters (its last ones for data.truncate=left), doubled until the cut
# gives max_length + SLACK tokens or is the whole piece. A piece that short of tokens is
# tokenized whole, as before; a longer one is over max_length however it ends, and
# truncation keeps tokens that lie SLACK tokens before the cut. Memory per record is
# then bounded by max_length, not by the record.


def _first_cut(spec: TokenizeSpec) -> int:
    return CHARS_PER_TOKEN * (spec.max_length + SLACK)


def _bounded(
    text: str, spec: TokenizeSpec, encode_one: Callable[[str], E], size: Callable[[E], int]
) -> tuple[E, int]:
    """``encode_one`` of ``text``, or of the shortest doubling cut of it that gives
    ``max_length + SLACK`` tokens (``size`` counts them); and where in ``text`` the
    encoded part starts."""
    want, n = spec.max_length + SLACK, _first_cut(spec)
    while n < len(text):
        start = len(text) - n if spec.truncate == "left" else 0
        encoded = encode_one(text[start : start + n])
        if size(encoded) >= want:
            return encoded, start
        n *= 2
    return encode_one(text), 0


def ids_within(
    text: str, encode_one: Callable[[str], list[int]], max_tokens: int
) -> list[int] | None:
    """``encode_one(text)`` when it gives at most ``max_tokens`` ids, else None. A text
    too long to matter whole is judged by doubling cuts of its start, as training's rule
    above judges it, so the memory spent is bounded by ``max_tokens``, not by the text."""
    n = CHARS_PER_TOKEN * (max_tokens + SLACK)
    while n < len(text):
        if len(encode_one(text[:n])) >= max_tokens + SLACK:
            return None
        n *= 2
    ids = encode_one(text)
    return ids if len(ids) <= max_tokens else None


def _encode_pieces(tok: Any, texts: list[str], spec: TokenizeSpec) -> list[list[int]]:
    """:func:`encode_many`, the pieces too long to matter whole cut first."""
    limit = _first_cut(spec)
    whole = iter(encode_many(tok, [t for t in texts if len(t) <= limit]))
    return [
        next(whole)
        if len(t) <= limit
        else _bounded(t, spec, lambda c: encode_many(tok, [c])[0], len)[0]
        for t in texts
    ]


def _encode_chats(tok: Any, texts: list[str], spec: TokenizeSpec) -> list[Encoding]:
    """:func:`encode_with_offsets` per rendered conversation (offsets into the whole
    text), the conversations too long to matter whole cut first."""
    limit = _first_cut(spec)
    whole = iter(encode_with_offsets(tok, [t for t in texts if len(t) <= limit]))
    out: list[Encoding] = []
    for t in texts:
        if len(t) > limit:
            (ids, offsets), start = _bounded(
                t, spec, lambda c: next(iter(encode_with_offsets(tok, [c]))), lambda e: len(e[0])
            )
            out.append((ids, offsets + start))
        else:
            out.append(next(whole))
    return out


# --------------------------------------------------------------------------- one chunk


def _plain_pieces(r: Record) -> list[str]:
    return [r.text] if r.text is not None else [r.prompt or "", r.completion or ""]


def _plain_example(r: Record, pieces: Iterator[list[int]], sp: Specials) -> Example:
    """``prefix + text + EOS`` (loss after the prefix) or ``prefix + prompt + completion
    + EOS`` (loss on completion and EOS); see :mod:`shoestring.data.specials`."""
    end = sp.ending()
    if r.text is not None:
        ids = sp.prompt(next(pieces)) + end
        labels = [IGNORE_INDEX] * len(sp.prefix) + ids[len(sp.prefix) :]
        return Example(ids, labels)
    prompt = sp.prompt(next(pieces))
    completion = next(pieces) + end
    return Example(prompt + completion, [IGNORE_INDEX] * len(prompt) + completion)


def _chat_examples(records: Sequence[Record], tok: Any, spec: TokenizeSpec) -> Iterator[Example]:
    if not records:
        return iter(())
    require_fast(tok)
    rendered = render_chats(records, tok, spec)
    encoded = _encode_chats(tok, [c.text for c in rendered], spec)
    return (
        Example(ids, label_tokens(ids, offsets, c.spans))
        for (ids, offsets), c in zip(encoded, rendered, strict=True)
    )


def _untruncated(records: Sequence[Record], tok: Any, spec: TokenizeSpec) -> list[Example]:
    """Examples of a chunk in order, encoded in one batch per kind of record."""
    plain = [r for r in records if r.kind != "chat"]
    pieces = iter(_encode_pieces(tok, [p for r in plain for p in _plain_pieces(r)], spec))
    chats = _chat_examples([r for r in records if r.kind == "chat"], tok, spec)
    sp = specials(tok) if plain else Specials((), (), None)
    return [next(chats) if r.kind == "chat" else _plain_example(r, pieces, sp) for r in records]


def _fit(r: Record, ex: Example, spec: TokenizeSpec) -> tuple[Example | None, bool]:
    """Apply ``data.truncate``; ``(None, ...)`` when the sample is dropped."""
    limit = spec.max_length
    over = len(ex.input_ids) > limit
    if over and spec.truncate == "drop":
        return None, True
    if over:
        keep = slice(None, limit) if spec.truncate == "right" else slice(-limit, None)
        ex = Example(ex.input_ids[keep], ex.labels[keep])
    if all(x == IGNORE_INDEX for x in ex.labels[1:]):
        if spec.truncate == "drop":
            return None, over
        hint = "prompt too long?" if spec.truncate == "right" else "answer too short?"
        raise DataError(
            f"{r.source}: nothing to learn after truncation to data.max_length={limit} ({hint})"
        )
    return ex, over


def tokenize_record(r: Record, tok: Any, spec: TokenizeSpec) -> tuple[Example | None, bool]:
    """One record → ``(example, was over max_length)``; the example is ``None`` when
    ``data.truncate=drop`` drops it."""
    return _fit(r, _untruncated([r], tok, spec)[0], spec)


def _tokenize_chunk(records: Sequence[Record], tok: Any, spec: TokenizeSpec) -> ChunkResult:
    out: list[Example] = []
    stats = TokenizeStats()
    for r, ex in zip(records, _untruncated(records, tok, spec), strict=True):
        stats.kinds[r.kind] = stats.kinds.get(r.kind, 0) + 1
        fitted, over = _fit(r, ex, spec)
        if fitted is None:
            stats.dropped += 1
            continue
        out.append(fitted)
        stats.samples += 1
        stats.truncated += int(over)
        stats.tokens += len(fitted.input_ids)
        stats.label_tokens += sum(1 for x in fitted.labels[1:] if x != IGNORE_INDEX)
    return out, stats


# --------------------------------------------------------------------------- many chunks


def _chunk_bounds(n: int) -> list[tuple[int, int]]:
    return [(start, min(start + CHUNK, n)) for start in range(0, n, CHUNK)]


def _sequential(records: Sequence[Record], tok: Any, spec: TokenizeSpec) -> ChunkResults:
    for start, end in _chunk_bounds(len(records)):
        yield _tokenize_chunk(records[start:end], tok, spec)


def _caught_signals() -> tuple[int, ...]:
    """The signals this process handles in Python: its preemption notices, Ctrl-C (not
    SIGCHLD, which ignored would change how a process's children are reaped)."""
    caught = (s for s in signal.valid_signals() if callable(signal.getsignal(s)))
    return tuple(s for s in caught if s != signal.SIGCHLD)


@contextmanager
def _blocked(signums: tuple[int, ...]) -> Iterator[None]:
    """This thread does not take ``signums`` inside (the kernel gives them to another
    thread, or holds them until the end); children started inside begin with them
    blocked, as CPython's resource tracker starts."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signums)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


#: Set once in each pool worker process by ``_start_worker``; the parent never sets it.
_WORKER_JOB: list[tuple[Any, TokenizeSpec]] = []


def _start_worker(tok: Any, spec: TokenizeSpec, parent: int, notices: tuple[int, ...]) -> None:
    """A notice sent to the whole job (Slurm signals every process of a step, a terminal
    every process of its group) is the parent's to act on: a worker that died of it would
    turn a clean preemption stop into a broken pool. Born with them blocked, a worker
    ignores them before it unblocks them."""
    die_with_parent(parent)  # a killed trainer must not leave workers behind
    for signum in notices:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, notices)
    _WORKER_JOB[:] = [(tok, spec)]


def _worker_chunk(records: Sequence[Record]) -> ChunkResult:
    tok, spec = _WORKER_JOB[0]
    return _tokenize_chunk(records, tok, spec)


def _parallel(
    records: Sequence[Record], tok: Any, spec: TokenizeSpec, workers: int
) -> ChunkResults:
    """Chunks over a process pool, results in record order. Workers are spawned fresh,
    never forked: the trainer has threads (watchers, torch's pool, a tracker's), and a
    child forked from a threaded process can inherit a lock some thread held at the fork
    and crash or hang (Python 3.12 warns of it; seen here as a worker dying of a
    signal). Each worker gets the tokenizer once; each chunk travels with its task."""
    notices = _caught_signals()
    chunks = (records[start:end] for start, end in _chunk_bounds(len(records)))
    pool = ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_start_worker,
        initargs=(tok, spec, os.getpid(), notices),
    )
    try:
        with _blocked(notices):  # the workers start in map()
            results = pool.map(_worker_chunk, chunks)
        yield from results
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _pool_size(n_records: int, workers: int) -> int:
    if n_records < MIN_PARALLEL_RECORDS:
        return 1
    return min(workers, len(_chunk_bounds(n_records)))


def tokenize_records(
    records: Sequence[Record],
    tok: Any,
    spec: TokenizeSpec,
    *,
    workers: int = 1,
    progress: bool = False,
    should_stop: Callable[[], bool] = lambda: False,
    sink: Callable[[list[Example]], None] | None = None,
) -> tuple[list[Example], TokenizeStats]:
    """All records → examples, in record order, the same for any ``workers``.

    ``should_stop`` is polled between chunks (``InterruptedError`` when it says so);
    ``progress`` shows a bar on stderr. With a ``sink`` (e.g. a cache writer's
    ``add_many``) each chunk's examples go there as they come and none are returned,
    so memory does not grow with the data.
    """
    from tqdm import tqdm

    pool_size = _pool_size(len(records), workers)
    results = (
        _parallel(records, tok, spec, pool_size)
        if pool_size > 1
        else _sequential(records, tok, spec)
    )
    examples: list[Example] = []
    stats = TokenizeStats()
    bar = tqdm(
        total=len(records),
        desc="tokenizing",
        unit=" samples",
        file=sys.stderr,
        disable=not progress,
    )
    with closing(results), bar:
        while True:
            if should_stop():
                raise InterruptedError("preempted while tokenizing")
            chunk = next(results, None)
            if chunk is None:
                break
            if sink is None:
                examples += chunk[0]
            else:
                sink(chunk[0])
            stats.add(chunk[1])
            bar.update(sum(chunk[1].kinds.values()))
    return examples, stats


# --------------------------------------------------------------------------- checks


def check_chat_ready(tok: Any, spec: TokenizeSpec, needs_chat: bool) -> None:
    """Before any model is loaded: conversations need a chat template and offsets."""
    if not needs_chat:
        return
    if spec.chat_template is None and not getattr(tok, "chat_template", None):
        name = getattr(tok, "name_or_path", "") or "the model"
        raise DataError(
            f"the training data has conversations (messages), but the tokenizer of {name} "
            "has no chat template (a base model?); set data.chat_template FILE to a Jinja "
            "chat template, e.g. the instruct model's"
        )
    require_fast(tok)
