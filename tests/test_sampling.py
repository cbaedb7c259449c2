"""Token choice (greedy/sampled, keyed draws) and stop strings of shoestring infer."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from shoestring.infer import sampling
from shoestring.infer.sampling import Choice, Pick, StopStrings, pick

# ---------------------------------------------------------------- token choice


def _chi2_bound(dof: int, alpha: float) -> float:
    """x with P(chi2_dof >= x) <= alpha, from the Chernoff bound
    P(X >= t*dof) <= (t * e^(1-t))^(dof/2) (conservative: no scipy needed)."""
    lo, hi = 1.0, 1000.0
    for _ in range(200):
        t = (lo + hi) / 2
        if (dof / 2) * (math.log(t) + 1 - t) > math.log(alpha):
            lo = t
        else:
            hi = t
    return float(hi * dof)


def _chi2(counts: Counter[int], probs: torch.Tensor) -> float:
    n = sum(counts.values())
    return sum((counts[i] - n * p) ** 2 / (n * p) for i, p in enumerate(probs.tolist()))


def _draw_many(logits_row: torch.Tensor, choice: Choice, n: int, prefix: str = "k") -> Counter[int]:
    """n draws of one row, each with its own key (so distinct, fixed (key, index) pairs)."""
    choices = [Choice(**{**choice.__dict__, "key": f"{prefix}{i}"}) for i in range(n)]
    picks = pick(logits_row.expand(n, -1), choices, [i % 7 for i in range(n)])
    return Counter(p.token for p in picks)


LOGITS8 = torch.tensor([1.0, 0.5, -0.3, 2.0, 0.0, -1.2, 1.4, 0.2])
ALPHA = 1e-9  # the draws are deterministic: this only says the bound is not tuned to them


def test_greedy_is_argmax_with_ties_to_lowest_id_and_draws_nothing(monkeypatch: Any) -> None:
    def no_draw(*a: object) -> float:
        raise AssertionError("a greedy row drew a random number")

    monkeypatch.setattr(sampling, "_uniform", no_draw)
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -0.5, -0.5]])
    picks = pick(logits, [Choice()] * 3, [0, 1, 2])
    assert picks == [Pick(1), Pick(0), Pick(2)]
    picks = pick(logits, [Choice(logprobs=2, top_k=1, top_p=0.1)] * 3, [0, 1, 2])
    assert [p.token for p in picks] == [1, 0, 2]


class _Calls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_all_greedy_batch_is_one_argmax_call() -> None:
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)).bfloat16()
    with _Calls() as calls:
        picks = pick(logits, [Choice(key=f"r{i}") for i in range(64)], list(range(64)))
    assert picks == [Pick(t) for t in logits.float().argmax(-1).tolist()]
    assert calls.names.count("argmax") == 1
    assert not {"log_softmax", "softmax", "topk", "sort", "to", "float"} & set(calls.names)


def test_draw_depends_only_on_row_choice_and_index() -> None:
    g = torch.Generator().manual_seed(1)
    row = (torch.randn(50, generator=g) * 2).bfloat16().float()  # exact in bf16 too
    others = (torch.randn(9, 50, generator=g) * 3).bfloat16().float()
    choices = [
        Choice(temperature=0.8, key="req-a", seed=7),
        Choice(temperature=1.3, top_p=0.9, key="line:12", seed=7, logprobs=3),
        Choice(temperature=0.7, top_k=20, top_p=0.95, key="x", seed=-5, logprobs=0),
    ]
    for c in choices:
        for idx in (0, 5, 1000):
            alone = pick(row[None], [c], [idx])[0]
            for pos in (0, 4, 9):
                batch = torch.cat([others[:pos], row[None], others[pos:]])
                other = [Choice(temperature=1.0, key=f"o{i}", logprobs=2) for i in range(9)]
                mixed = [*other[:pos], c, *other[pos:]]
                for dtype in (torch.float32, torch.bfloat16):
                    torch.manual_seed(pos)  # the global RNG plays no part
                    torch.rand(3)
                    got = pick(batch.to(dtype), mixed, [3] * pos + [idx] + [4] * (9 - pos))
                    assert got[pos] == alone


def test_pick_leaves_the_global_rng_alone() -> None:
    state = torch.get_rng_state()
    pick(LOGITS8.expand(5, -1), [Choice(temperature=1.0, key=str(i)) for i in range(5)], [0] * 5)
    assert torch.equal(torch.get_rng_state(), state)


def test_different_index_key_or_seed_give_different_draws() -> None:
    flat = torch.zeros(8)
    c = Choice(temperature=1.0, key="k")
    by_index = [pick(flat[None], [c], [i])[0].token for i in range(400)]
    by_key = [
        pick(flat[None], [Choice(temperature=1.0, key=f"k{i}")], [0])[0].token for i in range(400)
    ]
    by_seed = [
        pick(flat[None], [Choice(temperature=1.0, seed=s)], [0])[0].token for s in range(400)
    ]
    for tokens in (by_index, by_key, by_seed):
        counts = Counter(tokens)
        assert set(counts) == set(range(8))
        assert _chi2(counts, torch.full((8,), 1 / 8)) < _chi2_bound(7, ALPHA)
    assert by_index != by_key and by_key != by_seed


def test_temperature_one_matches_softmax() -> None:
    counts = _draw_many(LOGITS8, Choice(temperature=1.0, seed=3), 20000)
    assert _chi2(counts, torch.softmax(LOGITS8, -1)) < _chi2_bound(7, ALPHA)
    # ... and is far from a wrong distribution (the test can fail)
    assert _chi2(counts, torch.softmax(LOGITS8 / 1.2, -1)) > _chi2_bound(7, ALPHA)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_logits(temperature: float) -> None:
    counts = _draw_many(LOGITS8, Choice(temperature=temperature, seed=4), 5000)
    assert _chi2(counts, torch.softmax(LOGITS8 / temperature, -1)) < _chi2_bound(7, ALPHA)
    assert _chi2(counts, torch.softmax(LOGITS8, -1)) > _chi2_bound(7, ALPHA)


def test_top_k() -> None:
    g = torch.Generator().manual_seed(2)
    rows = torch.randn(300, 40, generator=g)
    ones = [Choice(temperature=1.5, top_k=1, key=f"r{i}") for i in range(300)]
    assert [p.token for p in pick(rows, ones, [0] * 300)] == rows.argmax(-1).tolist()
    counts = _draw_many(LOGITS8, Choice(temperature=1.0, top_k=3), 3000)
    assert set(counts) == {3, 6, 0}  # the three largest logits
    top3 = torch.tensor([LOGITS8[0], LOGITS8[3], LOGITS8[6]])
    got = Counter({0: counts[0], 1: counts[3], 2: counts[6]})
    assert _chi2(got, torch.softmax(top3, -1)) < _chi2_bound(2, ALPHA)


def test_top_k_ties_at_the_cut_keep_the_lower_ids() -> None:
    logits = torch.tensor([0.0, 1.0, 1.0, 2.0, 1.0, 1.0])
    counts = _draw_many(logits, Choice(temperature=1.0, top_k=3), 2000)
    assert set(counts) == {3, 1, 2}


def test_top_p_keeps_the_smallest_nucleus() -> None:
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])  # ids by probability: 1, 3, 0, 2
    logits = probs.log()
    counts = _draw_many(logits, Choice(temperature=1.0, top_p=0.8), 4000)
    assert set(counts) == {1, 3}
    assert _chi2(Counter({0: counts[1], 1: counts[3]}), torch.tensor([0.625, 0.375])) < _chi2_bound(
        1, ALPHA
    )
    counts = _draw_many(logits, Choice(temperature=1.0, top_p=0.81), 4000)
    assert set(counts) == {1, 3, 0}
    counts = _draw_many(logits, Choice(temperature=1.0, top_p=0.3), 500)
    assert set(counts) == {1}


def _reference(row: torch.Tensor, c: Choice, index: int) -> int:
    """The spec's sampler, by brute force: a full stable sort of the vocabulary (in id
    order when nothing is cut: top_p 1 and no top_k)."""
    z = row / c.temperature
    vals, ids = torch.sort(z, descending=True, stable=True)
    if c.top_p >= 1 and not 0 < c.top_k < z.numel():
        vals, ids = z, torch.arange(z.numel())
    if 0 < c.top_k < z.numel():
        vals, ids = vals[: c.top_k], ids[: c.top_k]
        lp = torch.log_softmax(vals, 0)
    else:
        lp = torch.log_softmax(z, 0)[ids]
    cum = lp.double().exp().cumsum(0)
    m, mass = cum.numel(), 1.0
    if c.top_p < 1:
        m = max(1, int((torch.cat([cum.new_zeros(1), cum[:-1]]) < c.top_p - 1e-6).sum()))
        mass = float(cum[m - 1])
    u = sampling._uniform(c.seed, c.key, index)
    return int(ids[min(int((cum[:m] <= u * mass).sum()), m - 1)])


def test_large_vocabulary_agrees_with_a_full_sort() -> None:
    """A 150k vocabulary with bf16 values (ties everywhere): drawing from a short
    sorted head, grown as needed, gives the brute-force full-sort answer."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(4, 151_936, generator=g) * 4).bfloat16().float()
    logits[2:, :10] += 20  # two peaked rows
    for top_p, top_k in ((0.9, 0), (1.0, 0), (0.5, 3000), (1.0, 100)):
        choices = [Choice(temperature=0.9, top_p=top_p, top_k=top_k, key=f"q{i}") for i in range(4)]
        got = [p.token for p in pick(logits, choices, [11] * 4)]
        assert got == [_reference(logits[r], c, 11) for r, c in enumerate(choices)]


def test_logprobs_are_the_raw_log_softmax() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 30, generator=g) * 3
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # a tie at the top
    choices = [
        Choice(logprobs=5),
        Choice(logprobs=0),
        Choice(temperature=0.6, top_k=4, key="a", logprobs=3),
        Choice(temperature=1.5, top_p=0.5, key="b", logprobs=40),
        Choice(temperature=1.0, key="c"),
        Choice(),
    ]
    picks = pick(logits, choices, list(range(6)))
    ref = torch.log_softmax(logits.float(), -1)
    for r, (p, c) in enumerate(zip(picks, choices)):
        if c.logprobs < 0:
            assert p.logprob is None and p.top == ()
            continue
        assert p.logprob == ref[r, p.token].item()
        assert len(p.top) == min(c.logprobs, 30)
        want = sorted(((i, v) for i, v in enumerate(ref[r].tolist())), key=lambda t: (-t[1], t[0]))
        assert list(p.top) == want[: len(p.top)]
    assert picks[0].token == 7 and picks[0].top[:2] == (
        (7, picks[0].logprob),
        (9, picks[0].logprob),
    )


def test_bf16_logits_pick_as_the_same_values_in_fp32() -> None:
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(40, 300, generator=g) * 3).bfloat16()
    choices = [
        Choice(
            temperature=[0.0, 0.7, 1.0, 1.6][i % 4],
            top_k=[0, 0, 5, 50][i % 4],
            top_p=[1.0, 0.9][i % 2],
            key=f"b{i}",
            logprobs=i % 3 - 1,
        )
        for i in range(40)
    ]
    idx = list(range(40))
    assert pick(logits, choices, idx) == pick(logits.float(), choices, idx)
    assert pick(logits.half(), choices, idx) == pick(logits.half().float(), choices, idx)
    assert pick(logits.double(), choices, idx) == pick(logits.float(), choices, idx)


# --------------------------------------------------------------- stop strings

WORDS = [
    "the",
    "cat",
    "café",
    "naïve",
    "über",
    "中文",
    "日本語",
    "😀",
    "🚀",
    "STOP",
    "END",
    "a",
    "!",
    ".",
    "\n",
    "\n\n",
    "文",
    "é",
    "日本語中文",
    "😀🚀🚀",
]


def _sentences(n: int) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(n)]


@pytest.fixture(scope="module")
def bpe_tok() -> Any:
    """A tiny byte-level BPE (GPT-2/Llama 3/Qwen style), trained here offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=285,
        special_tokens=["<|pad|>", "<|eos|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(_sentences(400), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>"],
    )


@pytest.fixture(scope="module")
def byte_tok() -> Any:
    """The built-in model's tokenizer: one token per byte (every non-ASCII character
    spans several tokens)."""
    from shoestring.train.builtin import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="module")
def fallback_tok() -> Any:
    """A SentencePiece-style (Llama 2/Mistral) BPE with byte fallback: characters not
    in the vocabulary become <0xNN> tokens, decoded run by run."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in [
        "▁",
        *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.!é",
        "ST",
        "OP",
        "STOP",
        "▁t",
    ]:
        vocab[piece] = len(vocab)
    merges = [("S", "T"), ("O", "P"), ("ST", "OP"), ("▁", "t")]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tk.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def _full(tok: Any, ids: list[int]) -> str:
    return str(tok.decode(ids, skip_special_tokens=True))


def _first_hit(tok: Any, stops: list[str], ids: list[int]) -> int | None:
    s = StopStrings(tok, stops)
    return next((n for n in range(1, len(ids) + 1) if s.hit(ids[:n])), None)


def _first_full(tok: Any, stops: list[str], ids: list[int]) -> int | None:
    return next(
        (n for n in range(1, len(ids) + 1) if any(x in _full(tok, ids[:n]) for x in stops)), None
    )


def _check(tok: Any, stops: list[str], ids: list[int]) -> int | None:
    """hit() fires at exactly the first prefix whose full decode holds a stop string,
    and text() of the tokens generated by then is cut before its first stop string."""
    n = _first_hit(tok, stops, ids)
    assert n == _first_full(tok, stops, ids), (stops, ids)
    final = ids[:n] if n else ids
    full = _full(tok, final)
    cut = min((full.find(s) for s in stops if s in full), default=len(full))
    assert StopStrings(tok, stops).text(final) == full[:cut]
    assert (cut < len(full)) == (n is not None)
    return n


def _special_ids(tok: Any) -> list[int]:
    return list(tok.all_special_ids)


def _sequences(tok: Any, n: int, seed: int) -> list[list[int]]:
    """Token sequences made of fragments encoded apart (varied token boundaries), with
    special tokens and stray tokens (partial UTF-8 on their own) mixed in."""
    rng = random.Random(seed)
    specials = _special_ids(tok)
    out = []
    for _ in range(n):
        ids: list[int] = []
        for _ in range(rng.randint(2, 10)):
            roll = rng.random()
            if roll < 0.15:
                ids.append(rng.choice(specials))
            elif roll < 0.25:
                ids.append(rng.randrange(len(tok)))
            else:
                frag = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
                ids += tok.encode(frag, add_special_tokens=False)
        out.append(ids)
    return out


STOP_SETS = [["STOP"], ["中文"], ["é!"], ["🚀🚀", "\n\n"], ["END", "文 S", "ïve"], ["😀 a", "t 日"]]


@pytest.mark.parametrize("which", ["bpe_tok", "byte_tok", "fallback_tok"])
def test_hit_agrees_with_a_full_decode_at_every_prefix(which: str, request: Any) -> None:
    tok = request.getfixturevalue(which)
    hits = 0
    for i, ids in enumerate(_sequences(tok, 120, seed=len(which))):
        hits += _check(tok, STOP_SETS[i % len(STOP_SETS)], ids) is not None
    assert 20 < hits < 110  # both outcomes are exercised


def test_bpe_tokenizer_splits_characters_across_tokens(bpe_tok: Any) -> None:
    """The fixture exercises partial UTF-8: some tokens alone decode to U+FFFD."""
    ids = bpe_tok.encode("😀 🚀 中文 日本語 naïve", add_special_tokens=False)
    assert any("\ufffd" in bpe_tok.decode([t]) for t in ids)
    assert bpe_tok.decode(ids) == "😀 🚀 中文 日本語 naïve"


def test_multi_token_stop_is_hit_at_the_completing_token(byte_tok: Any, bpe_tok: Any) -> None:
    for tok in (byte_tok, bpe_tok):
        pre = tok.encode("the cat 中", add_special_tokens=False)
        stop = tok.encode("文 STOP", add_special_tokens=False)
        ids = pre + stop + tok.encode(" a", add_special_tokens=False)
        assert len(stop) > 1
        assert _check(tok, ["中文 STOP"], ids) == len(pre) + len(stop)
    # each byte of a multi-byte stop string is its own token
    ids = byte_tok.encode("a 中文!", add_special_tokens=False)
    assert _check(byte_tok, ["中文"], ids) == len("a 中文".encode())


def test_stop_spanning_special_tokens(bpe_tok: Any) -> None:
    eos, start = bpe_tok.eos_token_id, bpe_tok.convert_tokens_to_ids("<|im_start|>")
    ids = bpe_tok.encode("the S", add_special_tokens=False) + [eos, start, eos]
    ids += bpe_tok.encode("TOP a", add_special_tokens=False)
    assert _check(bpe_tok, ["STOP"], ids) == len(ids) - len(
        bpe_tok.encode(" a", add_special_tokens=False)
    )
    assert StopStrings(bpe_tok, ["STOP"]).text(ids) == "the "


def test_stop_that_never_occurs_and_no_stops(bpe_tok: Any) -> None:
    ids = bpe_tok.encode("the cat café 中文 😀 STOP", add_special_tokens=False)
    for stops in (["nope"], ["中文!"], []):
        s = StopStrings(bpe_tok, stops)
        assert not any(s.hit(ids[:n]) for n in range(1, len(ids) + 1))
        assert s.text(ids) == "the cat café 中文 😀 STOP"


def test_earliest_stop_in_the_text_wins(bpe_tok: Any) -> None:
    ids = bpe_tok.encode("a cat END the STOP über END", add_special_tokens=False)
    s = StopStrings(bpe_tok, ["STOP", "über", "END"])
    assert s.text(ids) == "a cat "
    assert _check(bpe_tok, ["STOP", "über", "END"], ids) == len(
        bpe_tok.encode("a cat END", add_special_tokens=False)
    )
    assert StopStrings(bpe_tok, ["STOP", "the"]).text(ids) == "a cat END "


class _Counting:
    """A tokenizer that records how many tokens each decode call got."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.sizes = tok, list[int]()

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self.sizes.append(len(ids))
        return str(self.tok.decode(ids, skip_special_tokens=skip_special_tokens))


def test_hit_decodes_a_bounded_window(bpe_tok: Any) -> None:
    ids = bpe_tok.encode(" ".join(_sentences(60)), add_special_tokens=False)
    assert len(ids) > 600
    tok = _Counting(bpe_tok)
    s = StopStrings(tok, ["never here", "中文中文"])
    assert not any(s.hit(ids[:n]) for n in range(1, len(ids) + 1))
    assert max(tok.sizes) <= 2 * len("中文中文".encode()) + 1 + 3


def test_a_line_and_a_request_make_their_choice_in_one_place() -> None:
    """A {"prompt"} line (generate.*) and an OpenAI request body are one Sampling shape,
    and Sampling.choice keys the draws: the job's seed under the request's identity, or
    a request's own seed under an empty key (equal requests, equal answers), with
    logprobs -1 unless asked for."""
    import json

    from shoestring.infer.batchapi import Request, parse_line
    from shoestring.infer.sampleparams import Sampling

    line = Sampling(max_tokens=4, temperature=0.5, top_p=0.9, top_k=3)
    assert line.choice(7, "line:2") == Choice(0.5, 0.9, 3, 7, "line:2", -1)

    def request(custom_id: str, **body: Any) -> Request:
        doc = {"custom_id": custom_id, "method": "POST", "url": "/v1/completions"}
        req = parse_line(json.dumps({**doc, "body": {"prompt": "x", **body}}).encode(), 1, "in", 16)
        assert isinstance(req, Request)
        return req

    plain = request("r1", temperature=0.5, logprobs=2)
    assert plain.sampling.choice(7, plain.custom_id) == Choice(0.5, 1.0, 0, 7, "r1", 2)
    a, b = (request(cid, temperature=0.5, seed=11) for cid in ("a", "b"))
    assert a.sampling.choice(7, a.custom_id) == b.sampling.choice(7, b.custom_id)
    assert a.sampling.choice(7, a.custom_id) == Choice(0.5, 1.0, 0, 11, "", -1)
