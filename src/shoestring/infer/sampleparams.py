"""One shape for how a request is continued, for both kinds of input.

A ``{"prompt"}`` line takes the job's ``generate.*`` keys and an OpenAI batch request
its own body; both become one :class:`Sampling`, and :meth:`Sampling.choice` is the
one place a :class:`Choice` (what :func:`shoestring.infer.sampling.pick` reads) is
made from it. Imports no torch: the batch-file parser uses it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Choice:
    """How one request picks tokens."""

    temperature: float = 0.0  # 0: greedy (argmax; ties -> lowest id)
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int = 0  # the job's seed, or the request's own
    key: str = ""  # the request's identity (its custom_id, or "line:N")
    logprobs: int = -1  # -1: none; 0: the chosen token's logprob; k>0: also the top k


@dataclass(frozen=True)
class ResponseFormat:
    """The shape an answer must take (OpenAI's ``response_format``): any JSON object
    (``json_object``) or a JSON value valid under a JSON Schema (``json_schema``).

    The schema is kept as JSON text, so the value is hashable (requests with the same
    schema share its compiled grammar). Its keys keep the file's order: the order of
    ``properties`` is the order the answer writes them in, as OpenAI's does."""

    kind: Literal["json_object", "json_schema"]
    schema: str = '{"type": "object"}'
    name: str = ""  # json_schema.name (OpenAI requires it; it does not change the answer)

    @classmethod
    def of_schema(cls, schema: dict[str, Any], name: str) -> ResponseFormat:
        return cls("json_schema", json.dumps(schema), name)


@dataclass(frozen=True)
class Sampling:
    """A request's limit, sampling, stop strings and logprobs: an OpenAI batch body's
    fields (defaults as OpenAI's), or ``generate.*`` for ``{"prompt"}`` lines."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None  # None: the job's seed
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    response_format: ResponseFormat | None = None  # None: free text

    def choice(self, job_seed: int, key: str) -> Choice:
        """How the request picks its tokens. Draws are keyed by (seed, key, token index):
        without a seed of its own, ``key`` is the request's identity (its ``custom_id``,
        or ``line:N``) with the job's seed, so no two requests draw alike; with one, the
        key is empty, so repeated requests with the same seed and parameters get the
        same answer (OpenAI's promise for ``seed``)."""
        return Choice(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=job_seed if self.seed is None else self.seed,
            key=key if self.seed is None else "",
            logprobs=self.top_logprobs if self.logprobs else -1,
        )
