"""Prompt records → the token ids an online objective samples completions after.

``train.objective grpo`` trains on prompts alone: the policy writes the answers. A text
prompt is tokenized as SFT tokenizes the prompt of a prompt/completion record (the
tokenizer's own prefix, :func:`shoestring.data.specials.plain_prompt_ids`); a
conversation is rendered with the chat template and its generation prompt, as
inference and evaluation render it. Sampling stops at EOS, and for conversations at the
template's end-of-turn tokens too. A prompt longer than ``data.max_length`` tokens is
left out and counted (judged by a bounded cut, never tokenized whole).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from shoestring.data.chat import end_of_turn_ids, prompt_text
from shoestring.data.records import DataError, Record
from shoestring.data.specials import encode, plain_prompt_ids
from shoestring.data.tokenize import ids_within


@dataclass(frozen=True)
class Prompt:
    """One prompt: its ids, the ids that end a completion, and its record (the raw prompt
    and the columns the reward functions read)."""

    ids: tuple[int, ...]
    stop: tuple[int, ...]
    record: Record

    @property
    def raw(self) -> str | list[dict[str, Any]]:
        """The prompt as TRL hands it to reward functions: text, or the message list."""
        if self.record.messages is not None:
            return [dict(m) for m in self.record.messages]
        return self.record.prompt or ""


@dataclass
class PromptStats:
    samples: int = 0
    dropped: int = 0  # longer than data.max_length
    tokens: int = 0


def _encoder(r: Record, tok: Any, template: str | None) -> tuple[str, Callable[[str], list[int]]]:
    if r.messages is not None:
        return prompt_text(r.messages, tok, template, r.tools), lambda t: encode(tok, t)
    return r.prompt or "", lambda t: plain_prompt_ids(tok, t)


def tokenize_prompts(
    records: Sequence[Record],
    tok: Any,
    template: str | None,
    max_length: int,
    should_stop: Callable[[], bool] = lambda: False,
) -> tuple[list[Prompt], PromptStats]:
    """Every prompt record that fits ``max_length`` tokens, in order, and the counts."""
    eos = (tok.eos_token_id,) if tok.eos_token_id is not None else ()
    chat_stop: tuple[int, ...] | None = None
    out: list[Prompt] = []
    stats = PromptStats()
    for r in records:
        if not r.is_prompt:
            raise DataError(f"{r.source}: not a prompt record")
        if should_stop():
            raise InterruptedError("preempted while tokenizing")
        text, encode_one = _encoder(r, tok, template)
        ids = ids_within(text, encode_one, max_length)
        if ids is None:
            stats.dropped += 1
            continue
        if r.messages is not None and chat_stop is None:
            chat_stop = tuple(dict.fromkeys(end_of_turn_ids(tok, template))) or eos
        stop = chat_stop if r.messages is not None and chat_stop is not None else eos
        out.append(Prompt(tuple(ids), stop, r))
        stats.samples += 1
        stats.tokens += len(ids)
    return out, stats
