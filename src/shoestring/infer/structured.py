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
    """Compiles response formats for one tokenizer; makes one matcher per answer.

    ``vocab_size`` is the width of the model's logits (config ``vocab_size``, often
    padded past the tokenizer's last id); ``eos_ids`` are the tokens that may end an
    answer once its grammar accepts (the end-of-turn tokens of a chat template too).
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

    def constraint(self, grammar: str) -> Constraint:
        return Constraint(self._llg.LLMatcher(self._tok, grammar, log_level=0))


class Constraint:
    """One answer's matcher, kept in step with the answer's tokens."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher
        self._seen = 0  # tokens consumed

    def _catch_up(self, tokens: Sequence[int]) -> None:
        if len(tokens) < self._seen:  # a chunk started over: replay from the start
            self._matcher.reset()
            self._seen = 0
        new = list(tokens[self._seen :])
        if new and not self._matcher.consume_tokens(new):
            raise RuntimeError(f"a generated token broke its grammar: {self._matcher.get_error()}")
        self._seen = len(tokens)
        if self._matcher.is_error():
            raise RuntimeError(f"structured output failed: {self._matcher.get_error()}")

    def allowed(self, tokens: Sequence[int], width: int) -> npt.NDArray[np.bool_]:
        """Which of ``width`` token ids may follow ``tokens``.

        The bitmask is 32-bit little-endian words, token t at bit t % 32 of word
        t // 32: its bytes unpacked least significant bit first are the tokens in
        order. numpy unpacks them in one thread: torch's element-wise ops start its
        intra-op threads, which on a busy 2-core machine took 35 ms a row instead
        of 0.2 ms (a 118k vocabulary, measured 2026-12-06)."""
        self._catch_up(tokens)
        packed = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(packed, count=min(width, packed.size * 8), bitorder="little")
        if bits.size < width:
            bits = np.concatenate([bits, np.zeros(width - bits.size, dtype=np.uint8)])
        return bits.view(np.bool_)

    def complete(self, tokens: Sequence[int]) -> bool:
        """Has the answer ``tokens`` ended its grammar (nothing more may follow)?"""
        self._catch_up(tokens)
        return bool(self._matcher.is_stopped())
