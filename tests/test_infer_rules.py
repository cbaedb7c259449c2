"""Per-sequence limits, end tokens, sampling and compaction in the decode loop: a
sequence that ends leaves its micro-batch, and no remaining sequence's tokens
change; sampled tokens do not depend on which other sequences share the batch; a
state saved after some sequences left is resumed bit for bit."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from shoestring.infer import partial
from shoestring.infer.decode import Generated, GenState, Rules, generate_from, start
from shoestring.infer.engine import StreamingCausalLM
from shoestring.infer.fixtures import build_random_model
from shoestring.infer.sampling import Choice


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 14, (n,), generator=g).tolist()
    return [torch.randint(0, 256, (k,), generator=g).tolist() for k in lens]


@dataclass
class Engines:
    model: Path
    kv_bits: int
    sliding: bool  # a sliding-window model: its rows cannot leave (fed pads instead)

    def __call__(self) -> StreamingCausalLM:
        eng = StreamingCausalLM(self.model, device=torch.device("cpu"), kv_bits=self.kv_bits)
        return eng.start(resident=1, depth=1)


@pytest.fixture(scope="module", params=[("llama", 16), ("llama", 8), ("mistral", 16)])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Engines:
    arch, kv_bits = request.param
    extra = {"sliding_window": 8} if arch == "mistral" else {}
    model = build_random_model(tmp_path_factory.mktemp(arch) / "m", arch, seed=5, **extra)
    torch.set_num_threads(1)
    return Engines(model, kv_bits, arch == "mistral")


def _run(
    make: Callable[[], StreamingCausalLM],
    prompts: list[list[int]],
    rules: Rules,
    on_pass: Callable[[GenState], None] = lambda s: None,
) -> list[Generated]:
    eng = make()
    try:
        state = start(eng, prompts, pad_id=0, micro_tokens=24)
        return generate_from(eng, state, rules=rules, pad_id=0, on_pass=lambda: on_pass(state))
    finally:
        eng.close()


def test_ended_sequences_leave_the_batch_and_change_no_other_token(
    engine: Engines,
) -> None:
    prompts = _prompts(6, seed=2)
    uniform = _run(engine, prompts, Rules.uniform(6, 12, set()))
    limits = [1, 12, 3, 7, 2, 12]
    rows: list[int] = []
    mixed = _run(
        engine,
        prompts,
        Rules(limits),
        lambda s: rows.append(sum(mb.input_ids.shape[0] for mb in s.mbs)),
    )
    assert [g.tokens for g in mixed] == [u.tokens[:n] for u, n in zip(uniform, limits)]
    assert [g.finish for g in mixed] == ["length"] * 6
    running = [sum(n > p for n in limits) for p in range(1, 13)]  # after pass p
    if not engine.sliding:  # full attention: rows leave (a sliding window keeps them)
        assert rows == running
    assert len(rows) == 12


def test_an_end_token_ends_only_its_sequence(engine: Engines) -> None:
    prompts = _prompts(5, seed=3)
    uniform = _run(engine, prompts, Rules.uniform(5, 10, set()))
    eos = uniform[1].tokens[3]  # sequence 1 ends at its 4th token (or earlier)
    got = _run(engine, prompts, Rules.uniform(5, 10, {eos}))
    for u, g in zip(uniform, got):
        cut = u.tokens.index(eos) + 1 if eos in u.tokens else len(u.tokens)
        assert g.tokens == u.tokens[:cut]
        assert g.finish == ("eos" if eos in u.tokens else "length")


def _sampled(n: int) -> list[Choice]:
    return [Choice(temperature=1.0, top_p=0.95, seed=7, key=f"r{i}", logprobs=2) for i in range(n)]


def test_sampled_tokens_do_not_depend_on_the_other_sequences(
    engine: Engines,
) -> None:
    prompts = _prompts(6, seed=4)
    together = _run(engine, prompts, Rules([9] * 6, choices=_sampled(6)))
    alone = _run(engine, prompts[2:3], Rules([9], choices=[_sampled(6)[2]]))
    assert together[2].tokens == alone[0].tokens
    # The tokens are the same draw; a logprob's last bits may not be: the CPU GEMM
    # blocks a batch of 6 rows differently from 1 (fp32 reduction order, measured
    # 1.05e-5 absolute = 2.4e-6 relative on a -4.35 logprob).
    assert together[2].logprobs == pytest.approx(alone[0].logprobs, rel=1e-5)
    assert all(len(g.logprobs) == len(g.tokens) == len(g.top) for g in together)
    greedy = _run(engine, prompts, Rules.uniform(6, 9, set()))
    assert [g.tokens for g in together] != [g.tokens for g in greedy]


class _Stop(Exception):
    pass


def test_a_state_saved_after_some_sequences_left_resumes_bit_for_bit(
    engine: Engines, tmp_path: Path
) -> None:
    prompts = _prompts(6, seed=6)
    rules = Rules([2, 9, 4, 9, 1, 6], choices=_sampled(6))
    ref = _run(engine, prompts, rules)
    eng = engine()
    try:
        state = start(eng, prompts, pad_id=0, micro_tokens=24)

        def stop_at_5() -> None:
            if state.step == 5:
                raise _Stop

        with pytest.raises(_Stop):
            generate_from(eng, state, rules=rules, pad_id=0, on_pass=stop_at_5)
        path, _ = partial.save(tmp_path / "partial", 0, state, {"chunk": 0})
    finally:
        eng.close()
    eng = engine()
    try:
        loaded = partial.load(path, eng, len(prompts))
        got = generate_from(eng, loaded, rules=rules, pad_id=0)
    finally:
        eng.close()
    key: Callable[[Generated], Any] = lambda g: (g.tokens, g.finish, g.logprobs, g.top)  # noqa: E731
    assert [key(g) for g in got] == [key(g) for g in ref]
