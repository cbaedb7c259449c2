"""A prompt prefix that several sequences share is computed once per prefill, and the
results are the unshared run's: greedy tokens equal (and equal transformers'), logits
within fp32 noise, sampled tokens equal, 8-bit caches too; a generation stopped between
passes resumes bit for bit; the job reports fewer prefill tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from shoestring.cli import main
from shoestring.infer import partial
from shoestring.infer.decode import GenState, Rules, generate_from, start
from shoestring.infer.engine import StreamingCausalLM
from shoestring.infer.fixtures import build_random_model
from shoestring.infer.kvcache import takes_prefix
from shoestring.infer.prefix import find_shared_prefix
from shoestring.infer.sampleparams import Choice

#: fp32 logits, shared against unshared and against transformers: the house level
#: (measured 2026-12-06: <= 6.9e-6 on these prompts).
TOL = 1e-5
#: With 8-bit caches a difference at that level can move a key's code by one step
#: (1/127 of its row's absmax) on other CPUs' kernels; measured 9.3e-6 here.
TOL_KV8 = 1e-4
NEW = 8


class Stop(Exception):
    pass


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("prefix"), "llama", seed=7, layers=3)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Five prompts = a 40-token prefix + suffixes of 1-17 tokens, one equal to the
    prefix, one shorter than it, one sharing nothing."""
    g = torch.Generator().manual_seed(3)

    def rand(n: int) -> list[int]:
        return torch.randint(3, 250, (n,), generator=g).tolist()

    pre = rand(40)
    return [pre + rand(k) for k in (1, 5, 9, 17, 3)] + [rand(30), pre[:20], list(pre)]


@pytest.fixture(scope="module")
def engines(model: Path) -> Iterator[dict[int, StreamingCausalLM]]:
    torch.set_num_threads(1)
    engs = {
        bits: StreamingCausalLM(model, device=torch.device("cpu"), kv_bits=bits).start(
            resident=1, depth=1
        )
        for bits in (16, 8)
    }
    yield engs
    for e in engs.values():
        e.close()


def _state(eng: StreamingCausalLM, prompts: list[list[int]], share: bool) -> GenState:
    return start(eng, prompts, pad_id=0, micro_tokens=48, share_prefix=share)


def _prefill_logits(eng: StreamingCausalLM, state: GenState) -> torch.Tensor:
    """Each sequence's next-token logits after the prefill, in sequence order."""
    per_group = eng.forward_pass(state.mbs, lambda mb, h: eng.logits(h[:, -1, :]))
    rows = [i for g in state.groups for i in g]
    return torch.cat(per_group)[torch.tensor(rows).argsort()]


def test_the_prefix_found_saves_the_most_and_keeps_a_suffix(prompts: list[list[int]]) -> None:
    shared = find_shared_prefix(prompts)
    assert shared is not None
    # The prompt equal to the prefix shares all but its last token (computed per row,
    # for its logits): 39 tokens x 6 rows beats 40 x 5; the short and the foreign
    # prompts are left out.
    assert shared.rows == [0, 1, 2, 3, 4, 7] and shared.tokens == prompts[7][:39]
    assert shared.saved == 5 * 39
    assert find_shared_prefix([p[:30] for p in prompts]) is None  # under 32 tokens
    assert find_shared_prefix(prompts[:1]) is None  # one sequence


def test_sliding_window_caches_are_left_unshared(engines: dict[int, StreamingCausalLM]) -> None:
    """A sliding-window layer drops old tokens and tracks positions of its own: a prefix
    is not copied into it (the prefill runs every prompt in full)."""
    from transformers import AutoConfig
    from transformers.cache_utils import DynamicCache

    kw = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=1, num_key_value_heads=1)
    mistral = AutoConfig.for_model("mistral", sliding_window=8, **kw)
    assert not takes_prefix(DynamicCache(config=mistral))
    assert takes_prefix(DynamicCache(config=AutoConfig.for_model("llama", **kw)))
    assert engines[16].shares_prefix() and engines[8].shares_prefix()


@pytest.mark.parametrize("bits", [16, 8])
def test_shared_prefill_equals_the_unshared_one(
    engines: dict[int, StreamingCausalLM], prompts: list[list[int]], bits: int
) -> None:
    eng = engines[bits]
    shared, plain = _state(eng, prompts, True), _state(eng, prompts, False)
    assert shared.prefix is not None and plain.prefix is None
    assert all(mb.prefix is not None for mb in shared.mbs[-2:])  # the sharing groups
    got, want = _prefill_logits(eng, shared), _prefill_logits(eng, plain)
    assert all(mb.prefix is None for mb in shared.mbs)  # the pass consumed it
    print(f"kv {bits}: shared vs unshared prefill logits {(got - want).abs().max().item():.2e}")
    assert (got - want).abs().max().item() <= (TOL if bits == 16 else TOL_KV8)

    def run(share: bool, rules: Rules) -> list[list[int]]:
        out = generate_from(eng, _state(eng, prompts, share), rules=rules, pad_id=0)
        return [o.tokens for o in out]

    greedy = Rules.uniform(len(prompts), NEW, set())
    assert run(True, greedy) == run(False, greedy)
    keyed = [Choice(temperature=0.9, top_p=0.95, seed=5, key=f"k{i}") for i in range(8)]
    sampled = Rules([NEW] * len(prompts), choices=keyed)
    assert run(True, sampled) == run(False, sampled)


def test_shared_prefill_matches_transformers(
    model: Path, engines: dict[int, StreamingCausalLM], prompts: list[list[int]]
) -> None:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(model)).eval()
    eng = engines[16]
    logits = _prefill_logits(eng, _state(eng, prompts, True))
    out = generate_from(
        eng, _state(eng, prompts, True), rules=Rules.uniform(len(prompts), NEW, set()), pad_id=0
    )
    for p, o, lg in zip(prompts, out, logits):
        ids = torch.tensor([p])
        with torch.no_grad():
            want = ref.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False
            )
            ref_logits = ref(ids).logits[0, -1].float()
        assert o.tokens == want[0, len(p) :].tolist()
        print(f"vs transformers: {(lg - ref_logits).abs().max().item():.2e}")
        assert (lg - ref_logits).abs().max().item() <= TOL


def _caches(state: GenState) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for mb in state.mbs:
        for layer in mb.cache.layers:
            out += [*layer._k, *layer._v] if hasattr(layer, "_k") else [layer.keys, layer.values]
    return out


@pytest.mark.parametrize("bits", [16, 8])
def test_a_shared_generation_stopped_between_passes_resumes_bit_for_bit(
    tmp_path: Path, engines: dict[int, StreamingCausalLM], prompts: list[list[int]], bits: int
) -> None:
    eng, rules = engines[bits], Rules.uniform(len(prompts), NEW, set())
    ref = _state(eng, prompts, True)
    ref_out = [g.tokens for g in generate_from(eng, ref, rules=rules, pad_id=0)]
    for stop_after in (1, 3):
        state = _state(eng, prompts, True)

        def on_pass(state: Any = state, stop_after: int = stop_after) -> None:
            if state.step == stop_after:
                raise Stop

        with pytest.raises(Stop):
            generate_from(eng, state, rules=rules, pad_id=0, on_pass=on_pass)
        path, _ = partial.save(tmp_path / f"p{bits}", stop_after, state, {"chunk": 0})
        loaded = partial.load(path, eng, len(prompts))
        assert [g.tokens for g in generate_from(eng, loaded, rules=rules, pad_id=0)] == ref_out
        assert all(torch.equal(a, b) for a, b in zip(_caches(loaded), _caches(ref), strict=True))


def _job(model: Path, inp: Path, out: Path, *extra: str, rc: int = 0) -> list[dict[str, Any]]:
    args = ["infer", "--model", str(model), "--input", str(inp), "--output", str(out)]
    args += ["--threads", "1", "--job.progress", "off", "--max-new-tokens", "4", *extra]
    assert main(args) == rc
    events = Path(str(out) + ".run") / "events.jsonl"
    return [json.loads(line) for line in events.read_text().splitlines()]


def test_the_job_reports_fewer_prefill_tokens_and_writes_the_same_output(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    system = "You answer in one word. Examples: sky is blue; grass is green. Now: "
    questions = ["snow is", "coal is", "the sun is", "an orange is", "blood is"]
    lines = [{"prompt": system + q} for q in questions] + [{"prompt": "unrelated text"}]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))

    off_events = _job(model, inp, tmp_path / "off.jsonl", "--memory.share_prefix", "off")
    off = off_events[-1]
    assert off_events[0]["plan"]["breakdown"]["shared_prefix"] == 0
    assert off["shared_prefix_seqs"] == 0
    assert off["prefill_tokens"] == off["prefill_tokens_unshared"]

    # A stop inside the prefill (before its 2nd layer): nothing to save; the rerun
    # computes the chunk again, sharing the same prefix, to the same bytes.
    monkeypatch.setenv("SHOESTRING_FAULTS", "pass.unit@2:term")
    stopped = _job(model, inp, tmp_path / "on.jsonl", rc=75)[-1]
    assert stopped["event"] == "preempt" and stopped["mid_pass"] and not stopped["partial_passes"]
    monkeypatch.delenv("SHOESTRING_FAULTS")
    events = _job(model, inp, tmp_path / "on.jsonl")
    end = events[-1]
    # The plan reserved at least what the prefix row held: its hidden states (128 fp32)
    # and one layer's keys and values (2 x 2 heads x 32 fp32) per token.
    row = end["shared_prefix_tokens"] * (128 * 4 + 2 * 2 * 32 * 4)
    assert events[0]["plan"]["breakdown"]["shared_prefix"] >= row
    (chunk,) = [e for e in events if e["event"] == "chunk"]
    assert chunk["shared_prefix"] == {"tokens": end["shared_prefix_tokens"], "seqs": 5}
    assert end["shared_prefix_tokens"] >= len(system) and end["shared_prefix_seqs"] == 5
    assert end["prefill_tokens_unshared"] == off["prefill_tokens_unshared"]
    saved = end["prefill_tokens_unshared"] - end["prefill_tokens"]
    assert saved == 4 * end["shared_prefix_tokens"]
    assert (tmp_path / "on.jsonl").read_bytes() == (tmp_path / "off.jsonl").read_bytes()
