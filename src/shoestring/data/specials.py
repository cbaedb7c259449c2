"""One policy for the special tokens around plain text, shared by train, eval and infer.

A tokenizer's post-processor decides what ``add_special_tokens=True`` puts around a
text: Llama's adds BOS, Qwen's adds nothing, some add EOS as well. A tokenizer can
also *name* a BOS it never adds (a chat token its template writes itself). The
policy follows the tokenizer, never the ``bos_token`` attribute:

* a prompt (training, exact-match eval, inference) is ``prefix + ids(text)``, where
  ``prefix`` is what the tokenizer itself adds in front by default and ``ids`` encodes
  without specials; never the tokenizer's suffix (an EOS after a prompt would end it);
* a training text is ``prefix + ids(text) + [eos]`` and a prompt/completion pair is
  ``prefix + ids(prompt) + ids(completion) + [eos]`` (the model learns to stop); EOS
  comes once, also from a tokenizer that appends EOS itself.

Conversations are not plain text: the chat template writes their specials
(:mod:`shoestring.data.chat`). :data:`SPECIALS_POLICY` is part of the tokenized cache
key, so caches built under another policy are not reused.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

#: Bumped whenever the ids this policy gives change (2: the tokenizer's own prefix
#: replaced an always-prepended ``bos_token``).
SPECIALS_POLICY = 2

#: Text encoded with and without specials to see what the tokenizer adds around it.
_PROBE = "hello world"


@dataclass(frozen=True)
class Specials:
    """What a tokenizer adds around a plain text by default, and its EOS."""

    prefix: tuple[int, ...]
    suffix: tuple[int, ...]
    eos: int | None

    def prompt(self, ids: list[int]) -> list[int]:
        """A prompt's ids (encoded without specials) as every job feeds them to a model."""
        return [*self.prefix, *ids]

    def ending(self) -> list[int]:
        """What ends a training sample: EOS, once."""
        return [self.eos] if self.eos is not None else []


def encode(tok: Any, text: str, add_special_tokens: bool = False) -> list[int]:
    """One text's ids; a bare ``encode(text, add_special_tokens)`` tokenizer works too."""
    if not callable(tok):
        return list(tok.encode(text, add_special_tokens=add_special_tokens))
    return list(tok(text, add_special_tokens=add_special_tokens, verbose=False)["input_ids"])


def encode_many(tok: Any, texts: list[str]) -> list[list[int]]:
    """Many texts' ids without specials, in one batch where the tokenizer can."""
    if not texts:
        return []
    if not callable(tok):
        return [encode(tok, text) for text in texts]
    enc = tok(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)
    return [list(ids) for ids in enc["input_ids"]]


def specials(tok: Any) -> Specials:
    """Probe the tokenizer: encode a text with and without specials and take the ids
    around it. Cheap (two short encodes), so it is not cached: a tokenizer changed
    after a first call is probed afresh."""
    bare = encode(tok, _PROBE)
    full = encode(tok, _PROBE, add_special_tokens=True)
    eos = tok.eos_token_id
    for at in range(len(full) - len(bare) + 1):
        if full[at : at + len(bare)] == bare:
            return Specials(tuple(full[:at]), tuple(full[at + len(bare) :]), eos)
    # warnings shows a message once per call site (not once per prompt)
    warnings.warn(
        f"cannot tell which special tokens the tokenizer adds ({_PROBE!r} with specials "
        f"is {full}, without {bare}); adding none",
        RuntimeWarning,
        stacklevel=2,
    )
    return Specials((), (), eos)


def plain_prompt_ids(tok: Any, text: str) -> list[int]:
    """A plain prompt's ids, the same in training, eval and inference."""
    return specials(tok).prompt(encode(tok, text))
