"""A generation stopped between passes, saved and loaded into a fresh engine, continues
bit for bit: same tokens and the same KV cache contents as a run that never stopped."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from shoestring.checkpoint.manifest import CorruptCheckpoint
from shoestring.infer import partial
from shoestring.infer.decode import GenState, Rules, generate_from, start
from shoestring.infer.engine import PassStopped, StreamingCausalLM
from shoestring.infer.fixtures import build_random_model


class Stop(Exception):
    pass


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 14, (n,), generator=g).tolist()
    return [torch.randint(0, 256, (k,), generator=g).tolist() for k in lens]


def _cache_tensors(state: GenState) -> list[torch.Tensor]:
    out = []
    for mb in state.mbs:
        for layer in mb.cache.layers:
            qs = getattr(layer, "_k", None)
            out += [*layer._k, *layer._v] if qs is not None else [layer.keys, layer.values]
    return out


def _reference(
    tmp_path: Path,
    arch: str,
    kv_bits: int,
    prompts: list[list[int]],
    new_tokens: int,
    *,
    seed: int,
    resident: int,
    **model_kw: Any,
) -> tuple[Callable[[], StreamingCausalLM], dict[str, Any], GenState, list[list[int]]]:
    """(engine factory, generate kwargs, final state and tokens of an uninterrupted run)."""
    torch.set_num_threads(1)
    extra = {"sliding_window": 8} if arch == "mistral" else {}
    model = build_random_model(tmp_path / "m", arch, seed=seed, **extra, **model_kw)
    kw: dict[str, Any] = dict(rules=Rules.uniform(len(prompts), new_tokens, set()), pad_id=0)

    def engine() -> StreamingCausalLM:
        return StreamingCausalLM(model, device=torch.device("cpu"), kv_bits=kv_bits).start(
            resident=resident, depth=1
        )

    eng = engine()
    try:
        ref = start(eng, prompts, pad_id=0, micro_tokens=24)  # several prefill groups
        ref_out = [g.tokens for g in generate_from(eng, ref, **kw)]
    finally:
        eng.close()
    return engine, kw, ref, ref_out


@pytest.mark.parametrize("arch,kv_bits", [("llama", 16), ("llama", 8), ("mistral", 16)])
def test_stopped_generation_resumes_bit_for_bit(tmp_path: Path, arch: str, kv_bits: int) -> None:
    prompts = _prompts(7, seed=11)
    engine, kw, ref, ref_out = _reference(tmp_path, arch, kv_bits, prompts, 9, seed=4, resident=1)

    for stop_after in (1, 4):  # right after the prefill; in the middle of decoding
        eng = engine()
        state = start(eng, prompts, pad_id=0, micro_tokens=24)

        def on_pass(state: Any = state, stop_after: int = stop_after) -> None:
            if state.step == stop_after:
                raise Stop

        try:
            with pytest.raises(Stop):
                generate_from(eng, state, on_pass=on_pass, **kw)
            path, nbytes = partial.save(tmp_path / "partial", stop_after, state, {"chunk": 0})
        finally:
            eng.close()
        assert nbytes > sum(t.numel() * t.element_size() for t in _cache_tensors(state))
        eng = engine()  # a new process, as far as the engine is concerned
        try:
            loaded = partial.load(path, eng, len(prompts))
            assert loaded.step == stop_after
            assert [g.tokens for g in loaded.out] == [t[:stop_after] for t in ref_out]
            got = [g.tokens for g in generate_from(eng, loaded, **kw)]
        finally:
            eng.close()
        assert got == ref_out
        assert loaded.groups == ref.groups
        assert all(
            torch.equal(a, b)
            for a, b in zip(_cache_tensors(loaded), _cache_tensors(ref), strict=True)
        )

    # A state saved for another chunk shape is refused, not silently continued.
    with pytest.raises(CorruptCheckpoint, match="sequences"):
        partial.load(path, engine(), len(prompts) + 1)


@pytest.mark.parametrize("arch,kv_bits", [("llama", 16), ("llama", 8), ("mistral", 16)])
def test_stop_inside_a_pass_cuts_the_caches_back_and_resumes_bit_for_bit(
    tmp_path: Path, arch: str, kv_bits: int
) -> None:
    """A pass is abandoned between two layers (a notice shorter than a pass): the layers
    already run drop this pass's token, and the saved state continues exactly. Sliding-
    window caches cannot drop it again, so there the pass runs to its end."""
    prompts = _prompts(5, seed=12)
    engine, kw, ref, ref_out = _reference(
        tmp_path, arch, kv_bits, prompts, 7, seed=5, resident=0, layers=5
    )

    eng = engine()
    state = start(eng, prompts, pad_id=0, micro_tokens=24)
    asked = [0]

    def stop() -> bool:  # in pass 4 (3 complete), before its 4th unit (after 2 layers)
        if state.step == 3:
            asked[0] += 1
        return asked[0] >= 3

    try:
        if arch == "mistral":
            got = [g.tokens for g in generate_from(eng, state, stop=stop, **kw)]
            assert got == ref_out and asked[0] == 0  # never cut a pass short
            return
        with pytest.raises(PassStopped):
            generate_from(eng, state, stop=stop, **kw)
        assert state.step == 3 and [g.tokens for g in state.out] == [t[:3] for t in ref_out]
        lengths = {layer.get_seq_length() for mb in state.mbs for layer in mb.cache.layers}
        assert len(lengths) == 1  # every layer back at the pass's start
        path, _ = partial.save(tmp_path / "partial", 0, state, {})
    finally:
        eng.close()
    eng = engine()
    try:
        loaded = partial.load(path, eng, len(prompts))
        got = [g.tokens for g in generate_from(eng, loaded, **kw)]
    finally:
        eng.close()
    assert got == ref_out
    assert all(
        torch.equal(a, b) for a, b in zip(_cache_tensors(loaded), _cache_tensors(ref), strict=True)
    )
