"""lm-eval's ``LM`` answered by streamed inference jobs (imports lm-eval: load lazily).

Tokenization is lm-eval's own (:class:`~lm_eval.api.model.TemplateLM`, the split its
``hf`` backend makes): each ``(context, continuation)`` pair reaches the score job
as token ids, so a likelihood is the one the ``hf`` backend computes on the same
tokens, and so does each generation's context (as token ids), cut from the left to
leave room for its ``max_gen_toks`` as the ``hf`` backend cuts it. Generation is
greedy with the request's stop strings, the text cut as the ``hf`` backend cuts it.
A pair longer than the model's context loses context tokens from
the left, down to context + 1 tokens (the last one is scored, never fed), as the
``hf`` backend cuts it. Rolling log-likelihood (perplexity tasks) scores the ``hf``
backend's windows (:func:`lm_eval.utils.get_rolling_token_windows`, disjoint, over the
model's context) in the call's one score job and sums each document's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from shoestring.evaluate.jobs import Batch, InferJobs, Refused
from shoestring.infer.batchapi import MAX_STOP

#: lm-eval's default ``max_gen_toks`` (its ``hf`` backend's).
DEFAULT_MAX_GEN_TOKS = 256

#: The context lm-eval's ``hf`` backend assumes when the model's config names none.
DEFAULT_MAX_LENGTH = 2048

#: Generation keys that change nothing when decoding greedily.
GREEDY_NEUTRAL = frozenset({"do_sample", "temperature", "top_p", "top_k", "num_beams"})


class StreamedLM(TemplateLM):  # type: ignore[misc]  # lm-eval is untyped
    """Every ``loglikelihood`` call is one score job, every ``generate_until`` call one
    generate job, over all the call's requests (the weights stream once per pass)."""

    backend = "causal"

    def __init__(self, jobs: InferJobs, tokenizer: Any, context: int | None) -> None:
        super().__init__()
        self.jobs = jobs
        self.tokenizer = tokenizer
        self.context = context

    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return int(bos if bos is not None else self.tokenizer.eos_token_id)

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **_: Any
    ) -> list[int]:
        """As the ``hf`` backend encodes: the tokenizer's own specials unless told, and
        none in front of a text that already starts with BOS."""
        if add_special_tokens is None and string.startswith(
            self.tokenizer.decode(self.prefix_token_id)
        ):
            add_special_tokens = False
        kwargs = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return list(self.tokenizer.encode(string, **kwargs))

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], **_: Any
    ) -> list[tuple[float, bool]]:
        lines = [self._score_line(ctx, cont) for _pair, ctx, cont in requests]
        out = self.jobs.run(Batch("score", lines))
        return [(float(o["logprob"]), bool(o["greedy"])) for o in out]

    @property
    def max_length(self) -> int:
        return self.context if self.context is not None else DEFAULT_MAX_LENGTH

    def _score_line(self, ctx: list[int], cont: list[int]) -> dict[str, Any]:
        """The pair as the ``hf`` backend feeds it: its last ``max_length + 1`` tokens."""
        over = len(ctx) + len(cont) - (self.max_length + 1)
        if over > 0:
            ctx = ctx[over:]
        return {"prompt_ids": ctx, "completion_ids": cont}

    def _windows(self, text: str) -> list[tuple[list[int], list[int]]]:
        """A document's disjoint rolling windows, as the ``hf`` backend makes them."""
        windows = get_rolling_token_windows(
            token_list=self.tok_encode(text),
            prefix_token=self.prefix_token_id,
            max_seq_len=self.max_length,
            context_len=1,
        )
        return [make_disjoint_window(w) for w in windows]

    def loglikelihood_rolling(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[float]:
        """Each document's log-likelihood: its windows scored in one job, summed."""
        docs = [self._windows(str(r.args[0])) for r in requests]
        lines = [self._score_line(ctx, cont) for windows in docs for ctx, cont in windows]
        out = iter(self.jobs.run(Batch("score", lines)) if lines else [])
        return [sum(float(next(out)["logprob"]) for _ in windows) for windows in docs]

    def _context_ids(self, ask: Generation) -> list[int]:
        """The context's last ``max_length - max_gen_toks`` tokens (the ``hf`` backend's)."""
        room = self.max_length - ask.max_tokens
        if room <= 0:
            raise Refused(
                f"shoestring evaluate: task {ask.task}: max_gen_toks {ask.max_tokens} leaves "
                f"no room for a context in the model's {self.max_length} tokens"
            )
        return self.tok_encode(ask.context)[-room:]

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        asks = [Generation.of(r) for r in requests]
        lines = [a.line(i, self._context_ids(a)) for i, a in enumerate(asks)]
        most = max((a.max_tokens for a in asks), default=1)
        out = self.jobs.run(Batch("generate", lines, most))
        return [a.answer(o) for a, o in zip(asks, out)]


@dataclass(frozen=True)
class Generation:
    """One ``generate_until`` request: greedy, at most ``max_tokens``, cut at ``until``
    (non-empty stop strings)."""

    context: str
    until: tuple[str, ...]
    max_tokens: int
    task: str

    @classmethod
    def of(cls, request: Instance) -> Generation:
        context, gen_kwargs = request.args
        kwargs = normalize_gen_kwargs(dict(gen_kwargs), DEFAULT_MAX_GEN_TOKS)
        task = request.task_name
        if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0.0:
            raise Refused(
                f"shoestring evaluate: task {task} samples (do_sample/temperature in its "
                "generation_kwargs); only greedy generation is supported"
            )
        if int(kwargs.get("num_beams") or 1) > 1:
            raise Refused(f"shoestring evaluate: task {task}: beam search")
        other = sorted(set(kwargs) - GREEDY_NEUTRAL - {"until", "max_gen_toks"})
        if other:
            raise Refused(
                f"shoestring evaluate: task {task}: generation_kwargs {', '.join(other)} "
                "are not supported (until, max_gen_toks, greedy only)"
            )
        until = tuple(s for s in kwargs.get("until") or () if s)
        return cls(context, until, int(kwargs["max_gen_toks"]), str(task))

    def line(self, index: int, context_ids: list[int]) -> dict[str, Any]:
        """An OpenAI batch line, the prompt as token ids (the job's stop strings: the
        first MAX_STOP; the rest are cut from the text afterwards)."""
        body: dict[str, Any] = {
            "prompt": context_ids,
            "max_tokens": self.max_tokens,
            "temperature": 0,
        }
        if self.until:
            body["stop"] = list(self.until[:MAX_STOP])
        return {
            "custom_id": f"req-{index}",
            "method": "POST",
            "url": "/v1/completions",
            "body": body,
        }

    def answer(self, out: dict[str, Any]) -> str:
        if out.get("error"):
            why = out["error"].get("message", out["error"])
            raise Refused(f"shoestring evaluate: a generation was refused: {why}")
        text = str(out["response"]["body"]["choices"][0]["text"])
        return str(postprocess_generated_text(text, list(self.until), None))
