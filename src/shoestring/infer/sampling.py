"""Choosing each request's next token (greedy or sampled), and its stop strings.

A sampled token is drawn with ONE uniform number ``u`` from a generator seeded by
``sha256(seed, key, index)``: the job's (or the request's) seed, the request's own
identity and the position of the token in its generation. So every draw is a pure
function of (that row's logits, the request's choice, the index), never of torch's
global RNG, of the order in which requests were drawn, of which other requests
share the batch or of how big it is. That is what makes a job that was stopped and
resumed byte-identical to an uninterrupted run: after a resume, finished requests
have left the batch and micro-batches are grouped differently, but each remaining
request still draws exactly the numbers it would have drawn. It also makes one
request's output independent of the others in the input file.

``u`` is turned into a token by the inverse CDF over the kept tokens taken in a fixed
order (descending probability, ties by lower id). Everything between the logits and
``u`` is done on CPU in float32 (probabilities and sums in float64): on the batch
only with kernels that work element by element or row by row (the division by the
temperature, the last-dimension log_softmax), the rest per row on tensors whose
shapes depend only on that row, so no kernel's batching can leak into the result.
Greedy rows touch no generator: a batch of them is one argmax.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shoestring.infer.sampleparams import Choice

#: Dtypes whose values float32 holds exactly: their argmax needs no conversion.
_EXACT_IN_FP32 = (torch.float32, torch.bfloat16, torch.float16)
#: First head of the sorted vocabulary looked at when no top_k bounds it; grown
#: 16-fold until it holds the nucleus (or the drawn token).
_FIRST_HEAD = 64
#: A nucleus is the smallest head whose mass is >= top_p - _TOP_P_SLACK: probabilities
#: from float32 logits are exact to ~1e-7, so a boundary the user meant exactly
#: (probs 0.5 + 0.3 with top_p 0.8) is not decided by rounding.
_TOP_P_SLACK = 1e-6


@dataclass(frozen=True)
class Pick:
    token: int
    #: log p(token) under the model's raw distribution (log_softmax of the float32
    #: logits, before temperature/top-k/top-p), when logprobs >= 0
    logprob: float | None = None
    #: the top-k alternatives (id, logprob), highest first, ties by lower id
    top: tuple[tuple[int, float], ...] = ()


def pick(logits: torch.Tensor, choices: Sequence[Choice], index: Sequence[int]) -> list[Pick]:
    """The next token of each row: row r is request ``choices[r]`` choosing its
    ``index[r]``-th generated token (0-based). ``logits`` is (rows, vocab), any float
    dtype, any device."""
    rows = logits.shape[0]
    assert logits.dim() == 2 and len(choices) == rows and len(index) == rows
    assert all(c.temperature >= 0 for c in choices), "temperature must be >= 0"
    x = logits.detach()
    if x.dtype not in _EXACT_IN_FP32:
        x = x.float()
    # One argmax for the whole batch (exact in any of these dtypes, first max on ties).
    tokens: list[int] = x.argmax(-1).tolist()
    busy = [r for r, c in enumerate(choices) if c.temperature > 0 or c.logprobs >= 0]
    if not busy:
        return [Pick(t) for t in tokens]
    if len(busy) < rows:
        x = x[torch.tensor(busy, device=x.device)]
    x = x.to("cpu", torch.float32)
    sampled = [i for i, r in enumerate(busy) if choices[r].temperature > 0]
    if sampled:
        drawn = _sample(
            x[sampled], [choices[busy[i]] for i in sampled], [index[busy[i]] for i in sampled]
        )
        for i, t in zip(sampled, drawn):
            tokens[busy[i]] = t
    picks = [Pick(t) for t in tokens]
    _add_logprobs(picks, x, busy, choices)
    return picks


def _add_logprobs(
    picks: list[Pick], x: torch.Tensor, busy: list[int], choices: Sequence[Choice]
) -> None:
    """Fill in the logprobs of the busy rows (``x``, float32 CPU) that asked for them."""
    want = [i for i, r in enumerate(busy) if choices[r].logprobs >= 0]
    if not want:
        return
    lp = torch.log_softmax(x[want], -1)  # one call for the batch; per row on the last dim
    chosen = torch.tensor([picks[busy[i]].token for i in want])
    values: list[float] = lp.gather(1, chosen[:, None])[:, 0].tolist()
    for j, i in enumerate(want):
        r = busy[i]
        k = min(choices[r].logprobs, lp.shape[1])
        top: tuple[tuple[int, float], ...] = ()
        if k > 0:
            ids, vals = _head(lp[j], k)
            top = tuple(zip(ids.tolist(), vals.tolist()))
        picks[r] = Pick(picks[r].token, values[j], top)


def _sample(x: torch.Tensor, choices: list[Choice], index: list[int]) -> list[int]:
    """Draw one token per row of ``x`` (float32 CPU logits of sampled rows)."""
    vocab = x.shape[1]
    temps = torch.tensor([c.temperature for c in choices], dtype=torch.float32)
    z = x / temps[:, None]  # an IEEE division per element: the same bits in any batch
    # The full-vocabulary log_softmax, for rows that no top_k cuts down (the last-dim
    # kernel works row by row, so a row's values do not depend on the others).
    full = [i for i, c in enumerate(choices) if not 0 < c.top_k < vocab]
    lpz = torch.log_softmax(z[full], -1) if full else None
    where = {i: j for j, i in enumerate(full)}
    out = []
    for i, c in enumerate(choices):
        u = _uniform(c.seed, c.key, index[i])
        if i in where and c.top_p >= 1.0:
            assert lpz is not None
            out.append(_in_id_order(lpz[where[i]], u))
        elif i in where:
            assert lpz is not None
            out.append(_from_vocab(z[i], lpz[where[i]], c.top_p, u))
        else:
            ids, vals = _head(z[i], c.top_k)
            token = _draw(ids, torch.log_softmax(vals, 0), c.top_p, u, whole=True)
            assert token is not None
            out.append(token)
    return out


def _in_id_order(lpz: torch.Tensor, u: float) -> int:
    """Draw from the whole vocabulary with nothing cut (top_p 1, no top_k: OpenAI's
    default): any fixed order gives the exact distribution, and id order needs no sort
    (a sorted draw over a flat 150k vocabulary costs ~40 ms per row)."""
    cum = lpz.double().exp().cumsum(0)  # summed in order: the same bits in any batch
    j = int(torch.searchsorted(cum, torch.tensor([u * float(cum[-1])], dtype=torch.float64),
                               right=True))  # fmt: skip
    positive = torch.nonzero(lpz > float("-inf")).flatten()
    last = int(positive[-1]) if positive.numel() else 0
    j = min(j, last)  # u * total rounded up to the total
    if lpz[j] == float("-inf"):  # never lands on a zero: cum is flat there
        j = int(positive[positive > j][0]) if bool((positive > j).any()) else last
    return j


def _from_vocab(z: torch.Tensor, lpz: torch.Tensor, top_p: float, u: float) -> int:
    """Draw from the whole vocabulary (then cut to top_p), sorting only as much of it
    as the draw needs: a full sort of a 150k vocabulary costs ~10 ms per row."""
    n = _FIRST_HEAD
    while True:
        ids, _ = _head(z, n)
        token = _draw(ids, lpz[ids], top_p, u, whole=n >= z.numel())
        if token is not None:
            return token
        n *= 16


def _draw(ids: torch.Tensor, lp: torch.Tensor, top_p: float, u: float, whole: bool) -> int | None:
    """The token at ``u`` of the inverse CDF over the kept tokens of a sorted head
    (``ids`` with log-probabilities ``lp``, normalised over the tokens top_k kept).
    ``whole``: the head holds every kept token. None: the head is too short to tell."""
    p = lp.double().exp()
    cum = p.cumsum(0)  # in float64, summed in order
    m, mass = p.numel(), 1.0
    if top_p < 1.0:
        before = torch.cat([cum.new_zeros(1), cum[:-1]])
        m = max(1, int((before < top_p - _TOP_P_SLACK).sum()))
        if m == p.numel() and not whole:
            return None  # the nucleus may go on past the head
        mass = float(cum[m - 1])  # renormalise over the nucleus
    j = int((cum[:m] <= u * mass).sum())  # the first position whose cumulative exceeds it
    if j == m:
        if not whole:
            return None
        j = m - 1  # u * 1.0 above a total rounded below 1
    positive = int((p > 0).sum())  # p does not increase along the head
    return int(ids[min(j, max(positive - 1, 0))])


def _head(z: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` (ids, values) of a 1-D ``z`` in descending order, ties by lower
    id (topk alone leaves both the order of ties and which tie makes the cut open)."""
    if n >= z.numel():
        vals, ids = torch.sort(z, descending=True, stable=True)
        return ids, vals
    vals, ids = torch.topk(z, n + 1)  # one more, to see whether a tie crosses the cut
    if not vals[n] < vals[n - 1]:  # it does: take every token tied at the cut
        vals, ids = torch.topk(z, int((z >= vals[n - 1]).sum()))
    ids = ids.sort().values
    order = torch.sort(z[ids], descending=True, stable=True).indices[:n]
    return ids[order], z[ids[order]]


def _uniform(seed: int, key: str, index: int) -> float:
    """The one uniform number in [0, 1) of (seed, key, index)."""
    text = f"{seed}\0{key}\0{index}".encode("utf-8", "surrogatepass")
    g = torch.Generator(device="cpu")
    g.manual_seed(int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1)
    return float(torch.rand((), generator=g, dtype=torch.float64))


class StopStrings:
    """Stop strings of one request, checked as tokens arrive.

    ``hit`` decodes only a tail window of the tokens, not the whole generation each
    time (quadratic). Why the window below is wide enough: let B be the longest stop
    string's length in UTF-8 bytes. A stop string that appears for the first time
    once token n is added ends inside the characters token n completed (a byte-level
    decode of a prefix only differs from the next one in its last incomplete
    character, shown as U+FFFD), so it starts at most B - 1 bytes before token n's
    first byte. Every token that decodes to something on its own adds at least one
    byte to the text (special tokens, skipped, and any other token that decodes to
    nothing are not counted), so the last B counted tokens hold it. The decode of a
    window is the full text's suffix, except at its start: a character cut by the
    window's edge (U+FFFD, or a whole SentencePiece byte-fallback run), a stripped
    leading space, and text clean-ups that delete a space before punctuation (at
    most one per character of the stop string, so its raw text is <= 2B bytes). So
    the window is the last 2B + 1 counted tokens, backed up by up to 3 more tokens
    while its text starts with U+FFFD (a character is at most 4 bytes, and a
    byte-fallback token is one byte). A hit in the window is confirmed on the full
    decode (free for byte-level BPE, where a window's text is a suffix of the full
    text apart from leading U+FFFDs), so ``hit`` can never say True while ``text``
    is not cut.
    """

    def __init__(self, tok: Any, stops: Sequence[str]) -> None:
        self._tok = tok
        self._stops = tuple(stops)
        longest = max((len(s.encode("utf-8", "surrogatepass")) for s in self._stops), default=0)
        self._width = 2 * longest + 1
        self._blank: dict[int, bool] = {}  # token id -> decodes to "" on its own

    def _decode(self, tokens: Sequence[int]) -> str:
        return str(self._tok.decode(list(tokens), skip_special_tokens=True))

    def _is_blank(self, token: int) -> bool:
        blank = self._blank.get(token)
        if blank is None:
            blank = self._blank[token] = self._decode([token]) == ""
        return blank

    def _back(self, tokens: Sequence[int], start: int, count: int) -> int:
        """``start`` moved back over ``count`` tokens that decode to something (and
        every blank token between them); 0 when the sequence runs out first."""
        while count > 0 and start > 0:
            start -= 1
            if not self._is_blank(tokens[start]):
                count -= 1
        return start

    def hit(self, tokens: Sequence[int]) -> bool:
        """Called after each new token with all tokens generated so far: True once
        the decoded text contains a stop string."""
        if not self._stops or not tokens:
            return False
        start = self._back(tokens, len(tokens), self._width)
        tail = self._decode(tokens[start:])
        for _ in range(3):
            if start == 0 or not tail.startswith("\ufffd"):
                break
            start = self._back(tokens, start, 1)
            tail = self._decode(tokens[start:])
        if not any(s in tail for s in self._stops):
            return False
        return start == 0 or any(s in self._decode(tokens) for s in self._stops)

    def text(self, tokens: Sequence[int]) -> str:
        """The final text, cut before the first occurrence of any stop string (which
        is not returned); the whole text when none occurs."""
        text = self._decode(tokens)
        found = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        return text[: min(found)] if found else text
