"""The chunk ledger of ``shoestring infer`` on its own: what a rerun skips, redoes, refuses
and continues (infer/ledger.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from shoestring.checkpoint.local import step_dirname
from shoestring.checkpoint.manifest import read_manifest
from shoestring.config import ConfigError
from shoestring.infer.decode import GenState, Rules, generate_from, start
from shoestring.infer.engine import StreamingCausalLM
from shoestring.infer.fixtures import build_random_model
from shoestring.infer.ledger import CHUNK_FILE, ChunkLedger, Pinned, RunRecord


def _events(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _open(run_dir: Path, n_records: int = 7, chunk_records: int = 3) -> ChunkLedger:
    return ChunkLedger.open(run_dir, "run-1", n_records, chunk_records)


def test_verified_chunks_are_skipped_and_the_output_is_assembled_in_order(tmp_path: Path) -> None:
    ledger = _open(tmp_path)
    assert ledger.n_chunks == 3 and ledger.todo == [0, 1, 2]
    assert [ledger.records(k) for k in range(3)] == [range(0, 3), range(3, 6), range(6, 7)]
    ledger.commit(2, b"g\n")
    ledger.commit(0, b"a\nb\nc\n")
    man = read_manifest(tmp_path / "chunks" / step_dirname(0))
    assert man.meta == {"records": [0, 3], "run_id": "run-1"}
    ledger.close()

    ledger = _open(tmp_path)  # the rerun
    assert ledger.todo == [1] and ledger.done == {0, 2} and ledger.records_done() == 4
    ledger.commit(1, b"d\ne\nf\n")
    assert ledger.todo == []
    out = tmp_path / "sub" / "out.jsonl"
    assert ledger.assemble(out) == len(b"a\nb\nc\nd\ne\nf\ng\n")
    assert out.read_bytes() == b"a\nb\nc\nd\ne\nf\ng\n"
    ledger.close()
    assert not [e for e in _events(tmp_path) if e["event"] == "chunk_invalid"]


@pytest.mark.parametrize("damage", ["truncated", "flipped", "missing"])
def test_a_corrupt_chunk_is_quarantined_and_redone(tmp_path: Path, damage: str) -> None:
    ledger = _open(tmp_path)
    for k in range(3):
        ledger.commit(k, f"line {k}\n".encode())
    ledger.close()
    path = tmp_path / "chunks" / step_dirname(1) / CHUNK_FILE
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:-2])
    elif damage == "flipped":
        path.write_bytes(b"LINE 1\n")
    else:
        path.unlink()

    ledger = _open(tmp_path)
    assert ledger.todo == [1] and ledger.records_done() == 4
    (bad,) = [e for e in _events(tmp_path) if e["event"] == "chunk_invalid"]
    assert bad["chunk"] == 1 and Path(bad["quarantined"]).is_dir()
    assert not (tmp_path / "chunks" / step_dirname(1)).exists()
    ledger.commit(1, b"line 1\n")
    assert ledger.assemble(tmp_path / "out.jsonl") == 21
    ledger.close()


def test_leftovers_of_a_killed_commit_are_cleaned(tmp_path: Path) -> None:
    (tmp_path / "chunks" / ".tmp-step-00000000-1").mkdir(parents=True)
    (tmp_path / "chunks" / step_dirname(1)).mkdir()  # no manifest: never committed
    (tmp_path / "partial" / ".tmp-partial-0-1").mkdir(parents=True)
    ledger = _open(tmp_path)
    assert ledger.todo == [0, 1, 2]
    assert list((tmp_path / "chunks").iterdir()) == []
    assert list((tmp_path / "partial").iterdir()) == []
    ledger.close()


def test_run_record_round_trip_and_identity_mismatch_is_refused_naming_the_key(
    tmp_path: Path,
) -> None:
    assert RunRecord.read(tmp_path) is None
    identity = {"input_sha256": "ab", "model": "m1", "generate.max_new_tokens": 4}
    made = RunRecord.create(tmp_path / "run", identity, Pinned(8, 512, 3, "bfloat16"))
    read = RunRecord.read(tmp_path / "run")
    assert read == made and read.pinned == Pinned(8, 512, 3, "bfloat16")
    read.check(dict(identity))  # the same job: fine
    with pytest.raises(ConfigError) as e:
        read.check({**identity, "generate.max_new_tokens": 5, "model": "m2"})
    assert str(e.value) == (
        f"{tmp_path / 'run' / 'run.json'}: this run directory belongs to "
        "a different job (generate.max_new_tokens, model changed); use "
        "another --output or --run-dir"
    )


def test_run_json_from_before_dtype_was_pinned_computes_in_the_stored_dtype(tmp_path: Path) -> None:
    (tmp_path / "run.json").write_text(
        json.dumps(
            {"run_id": "old", "identity": {}, "pinned": {"batch_size": 4, "micro_tokens": 64}}
        )
    )
    record = RunRecord.read(tmp_path)
    assert record is not None and record.run_id == "old"
    assert record.pinned == Pinned(
        batch_size=4, micro_tokens=64, chunk_records=None, dtype="stored"
    )


class _Stop(Exception):
    pass


def _two_passes(engine: StreamingCausalLM, prompts: list[list[int]]) -> GenState:
    """A generation stopped after its prefill and one decode pass."""
    state = start(engine, prompts, pad_id=0, micro_tokens=64)

    def on_pass() -> None:
        if state.step == 2:
            raise _Stop

    with pytest.raises(_Stop):
        rules = Rules.uniform(len(prompts), 6, set())
        generate_from(engine, state, rules=rules, pad_id=0, on_pass=on_pass)
    return state


def test_a_saved_state_is_picked_up_and_dropped_once_its_chunk_commits(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    model = build_random_model(
        tmp_path / "m", "llama", hidden=64, layers=2, ffn=128, heads=2, kv_heads=1, seed=4
    )
    engine = StreamingCausalLM(model, device=torch.device("cpu")).start(resident=0, depth=1)
    prompts = [[5, 6, 7], [8, 9]]
    run_dir = tmp_path / "run"
    try:
        ledger = _open(run_dir)
        assert ledger.load_state(1, engine, 2) is None  # nothing saved
        state = _two_passes(engine, prompts)
        assert ledger.save_state(1, state) == 2
        assert ledger.save_state(2, state) == 2
        ledger.commit(2, b"g\n")  # a commit drops its chunk's state
        assert not (run_dir / "partial" / step_dirname(2)).exists()
        ledger.save_state(2, state)  # as if killed between a save and the commit
        ledger.commit(0, b"a\nb\nc\n")
        ledger.close()

        ledger = _open(run_dir)
        assert ledger.todo == [1]
        assert not (run_dir / "partial" / step_dirname(2)).exists()  # chunk 2 committed
        loaded = ledger.load_state(1, engine, 2)
        assert loaded is not None and loaded.step == 2
        assert [g.tokens for g in loaded.out] == [g.tokens for g in state.out]
        assert ledger.load_state(1, engine, 3) is None  # saved for another chunk size
        ledger.close()
    finally:
        engine.close()
    ev = _events(run_dir)
    assert [(e["chunk"], e["passes"]) for e in ev if e["event"] == "partial_saved"] == [
        (1, 2),
        (2, 2),
        (2, 2),
    ]
    assert [(e["chunk"], e["passes"]) for e in ev if e["event"] == "partial_loaded"] == [(1, 2)]
    (bad,) = [e for e in ev if e["event"] == "partial_invalid"]
    assert bad["chunk"] == 1 and "3" in bad["error"] and Path(bad["quarantined"]).is_dir()
