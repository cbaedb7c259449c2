"""Structured output: answers held to a JSON Schema, token by token.

An OpenAI batch request's ``response_format`` (``json_object`` or ``json_schema``,
:class:`~shoestring.infer.sampleparams.ResponseFormat`) is compiled by llguidance,
the grammar engine vLLM and llama.cpp use, against the model's tokenizer. Before
each token is chosen, the request's matcher says which tokens keep the answer a
valid prefix, and every other token's logit becomes -inf: greedy decoding takes
the best allowed token, sampling draws among the allowed ones (and logprobs are
those of that renormalised distribution, as vLLM reports them under a grammar).
The answer ends the moment the grammar is complete (finish ``stop``), without
the extra pass an end token would cost, a whole read of the weights when they are
streamed. A length limit can still cut an answer short (finish ``length``, its
JSON incomplete), as OpenAI does.

Exact resume: a matcher's state is a pure function of the tokens it consumed, and
a :class:`Constraint` catches up from the generated tokens it is shown, so a chunk
resumed from its saved state (or recomputed) replays them into fresh matchers;
nothing of llguidance is saved.

Whitespace: JSON is compiled compact, with no whitespace between items
(``{"a":1,"b":[2,3]}``; llguidance's ``whitespace_flexible: false``). Every token is
a pass over the weights, and a small model given free whitespace can loop on it
until its limit. A schema may choose otherwise with llguidance's own
``x-guidance`` key.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from shoestring.config import ConfigError
from shoestring.infer.sampleparams import ResponseFormat

INSTALL_HINT = "pip install 'shoestring[structured]' (or: pip install llguidance)"
#: JSON compile options applied before a schema's own ``x-guidance``.
COMPACT = {"whitespace_flexible": False}


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
    except ImportError:
        raise ConfigError(f"response_format needs llguidance: {INSTALL_HINT}") from None
    return llguidance


def read_schema_file(
    path: str, key: str = "--json-schema (generate.json_schema)"
) -> ResponseFormat:
    """The JSON Schema file a job's own lines are held to; a file that cannot be read
    or is not a JSON object fails here, naming ``key``, the file and the line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{key}: cannot read {path}: {e}") from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{key}: {path}:{e.lineno}:{e.colno}: not JSON: {e.msg}") from None
    if not isinstance(schema, dict):
        raise ConfigError(f"{key}: {path}: a JSON Schema is an object, got {type(schema).__name__}")
    return ResponseFormat.of_schema(schema, path)  # named by its file


class Grammars:
    """Compiles response formats for one tokenizer; holds a chunk's answers to them.

    ``vocab_size`` is the width of the model's logits (config ``vocab_size``, often
    padded past the tokenizer's last id); ``eos_ids`` are the tokens that may end an
    answer once its grammar accepts (the end-of-turn tokens of a chat template too).
    Masks of a pass are computed together by llguidance's executor, on its own threads
    with the GIL released.
    """

    def __init__(self, tok: Any, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self._llg = _llguidance()
        try:
            self._tok = self._llg.hf.from_tokenizer(
                tok, n_vocab=vocab_size, eos_token=sorted(eos_ids) or None
            )
        except ValueError as e:  # a slow (Python) tokenizer
            raise ConfigError(
                f"response_format: llguidance cannot use this tokenizer: {e}"
            ) from None
        self.vocab_size = vocab_size
        self._words = (int(self._tok.vocab_size) + 31) // 32  # int32 words per mask
        self._executor = self._llg.LLExecutor()
        self._compiled: dict[ResponseFormat, str] = {}

    def compile(self, fmt: ResponseFormat) -> str:
        """The grammar of ``fmt``; ValueError with llguidance's reason when the schema
        is not valid JSON Schema or uses what llguidance does not support."""
        if fmt not in self._compiled:
            matcher = self._llg.LLMatcher
            grammar = matcher.grammar_from_json_schema(fmt.schema, defaults=COMPACT)
            error = matcher.validate_grammar(grammar, self._tok)
            if error:
                raise ValueError(error)
            self._compiled[fmt] = grammar
        return self._compiled[fmt]

    def held(self, grammars: Sequence[str | None]) -> HeldAnswers:
        """Sequence i held to ``grammars[i]`` (None: free), each by a fresh matcher."""
        matchers = [
            Constraint(self._llg.LLMatcher(self._tok, g, log_level=0)) if g else None
            for g in grammars
        ]
        return HeldAnswers(self, matchers)

    def masks(self, held: Sequence[Constraint], width: int) -> npt.NDArray[np.bool_]:
        """Which of ``width`` token ids may come next, one row per constraint.

        A mask is 32-bit little-endian words, token t at bit t % 32 of word t // 32:
        its bytes unpacked least significant bit first are the tokens in order. numpy
        unpacks them in one thread; torch's element-wise ops start its intra-op
        threads, which on a busy 2-core machine took 35 ms a row instead of 0.2 ms
        (a 128k vocabulary, measured 2026-12-06)."""
        packed = np.zeros((len(held), self._words), dtype=np.int32)
        pairs = [(c.matcher, r) for r, c in enumerate(held)]
        self._llg.numpy.fill_next_token_bitmask_par(self._executor, pairs, packed)
        count = min(width, self._words * 32)
        bits = np.unpackbits(packed.view(np.uint8), axis=1, count=count, bitorder="little")
        if count < width:  # logits wider than the tokenizer: those ids are never allowed
            bits = np.pad(bits, ((0, 0), (0, width - count)))
        return bits.view(np.bool_)


class HeldAnswers:
    """The sequences of a chunk and what holds each (a :class:`Constraint`, or None)."""

    def __init__(self, grammars: Grammars, constraints: list[Constraint | None]) -> None:
        self._grammars = grammars
        self._constraints = constraints

    def allowed(
        self, rows: Sequence[int], tokens: Sequence[Sequence[int]], width: int
    ) -> npt.NDArray[np.bool_] | None:
        """Row r: which tokens may follow sequence ``rows[r]``'s ``tokens[r]`` (every
        token for a free sequence); None when no row is held."""
        held = [(r, c) for r, i in enumerate(rows) if (c := self._constraints[i]) is not None]
        if not held:
            return None
        for r, c in held:
            c.catch_up(tokens[r])
        allowed = np.ones((len(rows), width), dtype=np.bool_)
        allowed[[r for r, _ in held]] = self._grammars.masks([c for _, c in held], width)
        return allowed

    def complete(self, i: int, tokens: Sequence[int]) -> bool:
        """Has sequence ``i`` (``tokens`` so far) completed its grammar? (False: free)"""
        c = self._constraints[i]
        if c is None:
            return False
        c.catch_up(tokens)
        return bool(c.matcher.is_stopped())


class Constraint:
    """One answer's matcher, kept in step with the answer's tokens."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self._seen = 0  # tokens consumed

    def catch_up(self, tokens: Sequence[int]) -> None:
        """Consume the tokens generated since the last call (all of them, replayed,
        when the generation started over)."""
        if len(tokens) < self._seen:
            self.matcher.reset()
            self._seen = 0
        new = list(tokens[self._seen :])
        if new and not self.matcher.consume_tokens(new):
            raise RuntimeError(f"a generated token broke its grammar: {self.matcher.get_error()}")
        self._seen = len(tokens)
        if self.matcher.is_error():
            raise RuntimeError(f"structured output failed: {self.matcher.get_error()}")
