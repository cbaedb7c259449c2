"""Tied embeddings (``tie_word_embeddings``): one tensor, read at most once per pass, held once.

The lm_head of a tied model is the input embedding's tensor. The engine keeps it in
the embed unit only: when that unit is resident the head uses the resident tensor;
when it is streamed, the head acquires it as the next pass's first read and keeps it
for that pass's embedding lookup. So model bytes count it once, a pass reads model
bytes - resident bytes, and an all-resident plan holds it once and reserves no ring.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shoestring.cli import main
from shoestring.infer.config import MemoryConfig
from shoestring.infer.decode import generate, prompt_logits
from shoestring.infer.engine import StreamingCausalLM
from shoestring.infer.fixtures import build_random_model
from shoestring.infer.plan import Budget, Lengths, ModelShape, Needs, make_plan
from shoestring.infer.shards import index_model

CPU = torch.device("cpu")
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # hidden 256: the embedding (320 x 256 fp32) is well above the alignment slack.
    d = tmp_path_factory.mktemp("tied")
    return build_random_model(d, "llama", hidden=256, ffn=256, layers=3, tie=True, seed=4)


def _with_head(src: Path, dest: Path, head: torch.Tensor | None = None) -> Path:
    """``src`` saved in one file with lm_head.weight stored too: a copy of the
    embedding, or ``head``."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src))
    model.save_pretrained(dest, max_shard_size="100GB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dest / name).write_bytes((src / name).read_bytes())
    state = load_file(str(dest / "model.safetensors"))
    state[HEAD] = (head if head is not None else state[EMBED]).clone()
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 12, (n,), generator=g).tolist()
    return [torch.randint(0, 256, (k,), generator=g).tolist() for k in lens]


def _check_against_transformers(model_dir: Path, resident: int | set[int]) -> None:
    """Greedy tokens and fp32 prompt logits equal the in-memory model's."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    prompts = _prompts(5, seed=1)
    eng = StreamingCausalLM(model_dir, device=CPU).start(resident=resident, depth=1)
    try:
        # micro_tokens 12: several micro-batches per unit; 8 passes, then one more
        # pass (prompt_logits) that starts from the unit kept by the last head.
        out = generate(eng, prompts, max_new_tokens=8, eos_ids=set(), pad_id=0, micro_tokens=12)
        logits = prompt_logits(eng, prompts)
    finally:
        eng.close()
    for p, o, lg in zip(prompts, out, logits):
        want = ref.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
        )
        assert o.tokens == want[0, len(p) :].tolist()
        with torch.no_grad():
            assert (lg - ref(torch.tensor([p])).logits[0].float()).abs().max().item() <= 1e-5


@pytest.mark.parametrize("resident", [0, {0}, 2, 99], ids=["streamed", "embed", "two", "all"])
def test_tied_model_matches_transformers(tied: Path, resident: int | set[int]) -> None:
    _check_against_transformers(tied, resident)


def test_tied_weight_is_one_tensor_in_the_embed_unit(tied: Path, tmp_path: Path) -> None:
    """Every stored tensor is in exactly one unit, so model bytes count the embedding
    once: within alignment of the tensor bytes on disk, not one embedding above."""
    disk = index_model(tied)
    assert HEAD not in disk
    eng = StreamingCausalLM(tied, device=CPU)
    keys = [r.key for u in eng.units for r in u.refs]
    assert sorted(keys) == sorted(disk)
    assert eng.units[-1].shared == {HEAD: EMBED} and HEAD in eng.units[-1].params
    tensor_bytes = sum(r.nbytes for r in disk.values())
    embed = disk[EMBED].nbytes
    model = sum(eng.unit_bytes)
    assert tensor_bytes <= model < tensor_bytes + embed // 2
    eng.untie({HEAD})  # no head stored: its own read of the embedding's bytes
    head_ref = eng.units[-1].refs[-1]
    assert head_ref.key == HEAD and head_ref.offset == disk[EMBED].offset
    # The same bytes stored twice (tied config): transformers ties them; so do we.
    copy = _with_head(tied, tmp_path / "copy")
    eng = StreamingCausalLM(copy, device=CPU)
    assert eng.units[-1].shared == {HEAD: EMBED}
    assert all(r.key != HEAD for u in eng.units for r in u.refs)
    # An adapter merged into the lm_head unties it: the head reads its own stored bytes.
    eng.untie({HEAD})
    assert eng.units[-1].shared == {} and eng.units[-1].refs[-1] == eng.refs[HEAD]


def test_a_stored_head_that_differs_is_not_tied(tied: Path, tmp_path: Path) -> None:
    """transformers keeps a tied config's stored lm_head apart when it differs; so do we."""
    g = torch.Generator().manual_seed(9)
    shape = index_model(tied)[EMBED].shape
    other = _with_head(tied, tmp_path / "other", torch.randn(shape, generator=g) * 0.2)
    eng = StreamingCausalLM(other, device=CPU)
    assert eng.units[-1].shared == {} and HEAD in [r.key for r in eng.units[-1].refs]
    _check_against_transformers(other, 1)


@pytest.mark.parametrize("resident", [0, {0}, 2], ids=["streamed", "embed", "two"])
def test_a_pass_reads_model_bytes_minus_resident_bytes(
    tied: Path, resident: int | set[int]
) -> None:
    eng = StreamingCausalLM(tied, device=CPU).start(resident=resident, depth=1)
    st = eng.streamer
    assert st is not None
    served: list[int] = []
    read: list[int] = []

    def on_pass() -> None:
        served.append(st.served_bytes)
        read.append(st.reader.bytes_read - st.resident_bytes)  # residents: read once

    try:
        generate(
            eng,
            _prompts(4, seed=2),
            max_new_tokens=6,
            eos_ids=set(),
            pad_id=0,
            micro_tokens=64,
            on_pass=on_pass,
        )
    finally:
        eng.close()
    model = sum(eng.unit_bytes)
    per_pass = model - st.resident_bytes
    assert st.streamed_bytes == per_pass
    # The first pass's head also took the next pass's embedding read (when streamed).
    kept = eng.units[0].plan.read_bytes if 0 in st.order else 0
    assert served == [k * per_pass + kept for k in range(1, len(served) + 1)]
    # On disk: what was served plus at most a ring's worth of read-ahead.
    ring = st.slots * st.slot_bytes
    assert all(s <= r <= s + ring for s, r in zip(served, read))


def test_all_resident_plan_holds_the_embedding_once_and_no_ring(tied: Path) -> None:
    from types import SimpleNamespace

    eng = StreamingCausalLM(tied, device=CPU)
    model = sum(eng.unit_bytes)
    cfg = eng.config
    plan = make_plan(
        budget=Budget(total=64 << 20, runtime=16 << 20),
        needs=Needs(read=eng.unit_bytes, extra=[0] * len(eng.units)),
        shape=ModelShape(
            config=SimpleNamespace(
                hidden_size=cfg.hidden_size,
                intermediate_size=cfg.intermediate_size,
                num_attention_heads=cfg.num_attention_heads,
                vocab_size=cfg.vocab_size,
            ),
            itemsize=4,
            kv_per_token=1024,
        ),
        lengths=Lengths(prompts=[8] * 4, new_tokens=4),
        memory=MemoryConfig(batch_size=4, micro_batch_tokens=64, prefetch_depth=2, resident=-1),
    )
    assert plan.resident == tuple(range(len(eng.units)))
    assert plan.breakdown["resident"] == model and plan.breakdown["read_ahead"] == 0
    assert sum(plan.breakdown.values()) <= plan.budget
    eng.start(set(plan.resident), plan.depth)
    try:
        st = eng.streamer
        assert st is not None and st.slots == 0 and st.slot_bytes == 0
        assert st.resident_bytes == model and st.streamed_bytes == 0
    finally:
        eng.close()


def _infer_start(tied: Path, tmp_path: Path, name: str, *extra: str) -> dict:
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt": f"tied {i}"}) + "\n" for i in range(3)))
    out = tmp_path / f"{name}.jsonl"
    args = ["infer", "--model", str(tied), "--input", str(inp), "--output", str(out)]
    args += ["--threads", "1", "--job.progress", "off", "--max-new-tokens", "3", *extra]
    assert main(args) == 0
    events = (Path(str(out) + ".run") / "events.jsonl").read_text().splitlines()
    start: dict = json.loads(events[0])
    assert start["event"] == "infer_start"
    return start


def test_job_reports_streamed_bytes_as_model_minus_resident(tied: Path, tmp_path: Path) -> None:
    disk = sum(r.nbytes for r in index_model(tied).values())
    embed = index_model(tied)[EMBED].nbytes
    all_in = _infer_start(tied, tmp_path, "all", "--memory-budget", "2GB")
    some = _infer_start(tied, tmp_path, "some", "--memory-budget", "2GB", "--memory.resident", "2")
    for start in (all_in, some):
        model, parts = start["model_bytes"], start["plan"]["breakdown"]
        assert disk <= model < disk + embed // 2
        assert start["streamed_bytes_per_pass"] == model - parts["resident"]
    assert all_in["plan"]["breakdown"]["read_ahead"] == 0
    assert all_in["streamed_bytes_per_pass"] == 0
    assert len(some["plan"]["resident"]) == 2 and some["plan"]["breakdown"]["read_ahead"] > 0


def test_a_resident_embedding_pays_for_itself_by_shrinking_the_ring() -> None:
    """The ring holds the largest streamed unit: with a 100 MB embedding and 10 MB
    layers, keeping the embedding resident frees (depth + 1) x 90 MB of ring, which
    buys it and 8 layers (7 before the plan kept its slack out of the prefill
    micro-batches too), where largest-first with the embedding's ring buys nothing."""
    from types import SimpleNamespace

    mb = 1 << 20
    plan = make_plan(
        budget=Budget(total=350 * mb, runtime=100 * mb),
        needs=Needs(read=[100 * mb] + [10 * mb] * 20 + [4096], extra=[0] * 22),
        shape=ModelShape(
            config=SimpleNamespace(
                hidden_size=256, intermediate_size=512, num_attention_heads=4, vocab_size=320
            ),
            itemsize=4,
            kv_per_token=16384,
        ),
        lengths=Lengths(prompts=[20] * 64, new_tokens=12),
        memory=MemoryConfig(batch_size=64, micro_batch_tokens=512, prefetch_depth=1, resident=-1),
    )
    parts = plan.breakdown
    assert plan.batch_size == 64 and sum(parts.values()) <= plan.budget
    # Without the embedding resident the ring alone (2 x 100 MB) leaves no room.
    assert (
        parts["runtime"] + 200 * mb + parts["activations"] + parts["kv_and_hidden"] + parts["slack"]
        > plan.budget - 10 * mb
    )
    assert 0 in plan.resident and parts["read_ahead"] == 2 * 10 * mb
    assert len([i for i in plan.resident if 1 <= i <= 20]) == 8
