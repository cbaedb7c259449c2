"""What a run leaves behind stays bounded and durable: exports are fsynced before their
rename, stale export temp dirs, quarantined checkpoints and hang verdicts are pruned
by policy, and the event log is rotated (nothing lost) so a start reads only its tail."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import CLI, FAST, read_events
from shoestring.checkpoint.local import prune_quarantined
from shoestring.events import EventLog, read_tail, rotate, segments
from shoestring.report.timeline import load
from shoestring.supervise.supervisor import prune_verdicts
from shoestring.train import export
from shoestring.train.resume import last_logged_step


class _Saver:
    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def save_pretrained(self, d: str, **kw: Any) -> None:
        Path(d).mkdir(parents=True, exist_ok=True)
        for n in self.names:
            (Path(d) / n).write_bytes(b"x" * 10)


class _Tok(_Saver):
    def __call__(self, text: str, return_tensors: str) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.zeros(1, 3, dtype=torch.long)}


def _tiny_peft_model() -> Any:
    """A one-layer Llama with a LoRA adapter: the merged export streams real modules."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=8,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    return get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=2, target_modules=["q_proj"]))


def _record_fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Every fsync (by path) and rename, in order."""
    log: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(a: Any, b: Any) -> None:
        log.append(("rename", f"{a} -> {b}"))
        real_rename(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    return log


@pytest.mark.parametrize("which", ["final", "merged"])
def test_exports_are_fsynced_before_their_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    log = _record_fsyncs(monkeypatch)
    tok = _Tok(("tok.json",))
    if which == "final":
        model = _Saver(("adapter_model.safetensors", "adapter_config.json"))
        final = export.export_adapter(model, tok, tmp_path)
    else:
        final = export.export_merged(_tiny_peft_model(), tok, tmp_path)
    (rename,) = [i for i, (k, what) in enumerate(log) if k == "rename" and what.endswith(which)]
    tmp = log[rename][1].split(" -> ")[0]
    synced_before = {p for k, p in log[:rename] if k == "fsync"}
    files = sorted(p.name for p in final.iterdir())
    assert "tok.json" in files and (which == "final" or export.MERGE_REPORT in files)
    for name in files:
        assert f"{tmp}/{name}" in synced_before, (name, log)
    assert tmp in synced_before  # the directory's entries too
    assert str(tmp_path) in {p for k, p in log[rename:] if k == "fsync"}  # and the rename


def test_stale_export_dirs_are_pruned(tmp_path: Path) -> None:
    for name in (".tmp-final-abc123", ".tmp-merged-9", ".replaced-final-1", "final", "keep"):
        (tmp_path / name).mkdir()
    assert export.prune_exports(tmp_path) == [
        ".replaced-final-1",
        ".tmp-final-abc123",
        ".tmp-merged-9",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "keep"]


def test_quarantined_checkpoints_keep_the_newest(tmp_path: Path) -> None:
    t = int(time.time())
    names = [f".corrupt-step-{s:08d}-{t + s}-abcdef" for s in (4, 8, 12, 16)]
    for n in names:
        (tmp_path / n).mkdir()
    (tmp_path / "step-00000020").mkdir()
    assert prune_quarantined(tmp_path, 2) == names[:2]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*names[2:], "step-00000020"])
    assert prune_quarantined(tmp_path, 0) == names[2:]


def test_hang_verdicts_keep_the_newest(tmp_path: Path) -> None:
    for ms in (1000, 2000, 3000):
        (tmp_path / f"hang-{ms}.json").write_text("{}")
        (tmp_path / f"hang-{ms}.nccl_trace_rank0").write_text("")
    (tmp_path / "other.txt").write_text("")
    assert prune_verdicts(tmp_path, 1) == ["hang-2000", "hang-1000"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "hang-3000.json",
        "hang-3000.nccl_trace_rank0",
        "other.txt",
    ]


def _log(path: Path, steps: range, ts0: float = 1000.0) -> None:
    with EventLog(path, run_id="r", clock=lambda: ts0) as ev:
        for s in steps:
            ev.emit("step", step=s, loss=1.0)


def test_rotation_keeps_every_record_and_the_tail_spans_segments(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    _log(path, range(0, 50))
    assert rotate(path, 1 << 20) is None  # small: left alone
    assert rotate(path, 100) == tmp_path / "events.1.jsonl"
    _log(path, range(50, 52))
    assert rotate(path, 100) == tmp_path / "events.2.jsonl"
    assert not path.exists() and rotate(path, 100) is None
    _log(path, range(52, 53))
    assert segments(path) == [tmp_path / f"events.{n}.jsonl" for n in (1, 2)] + [path]
    every = [r["step"] for seg in segments(path) for r in _read(seg)]
    assert every == list(range(53))
    # The last logged step of the previous attempts survives a rotation at start.
    assert last_logged_step(path) == 52
    path.unlink()
    assert last_logged_step(path) == 51
    tail = [r["step"] for r in read_tail(path, 300)]
    assert tail and tail == list(range(52 - len(tail), 52))  # a suffix, in order
    # The report reads the whole history.
    tl = load(tmp_path)
    assert [e.data["step"] for e in tl.events if e.kind == "step"] == list(range(52))


def _read(p: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


@pytest.mark.e2e
def test_a_start_prunes_and_rotates(cli: CLI, tmp_path: Path) -> None:
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    ckpts.mkdir(parents=True)
    (out / ".tmp-final-dead01").mkdir()
    (out / ".tmp-final-dead01" / "adapter_model.safetensors").write_bytes(b"x" * 100)
    t = int(time.time()) - 100
    corrupt = [f".corrupt-step-{s:08d}-{t + s}-abcdef" for s in (4, 8, 12)]
    for n in corrupt:
        (ckpts / n).mkdir()
    _log(out / "events.jsonl", range(1, 40), ts0=time.time() - 3600)
    r = cli.run(out, *FAST, "--train.max_steps", "2", "--events_rotate_mb", "0.001")
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (out / ".tmp-final-dead01").exists() and (out / "final").is_dir()
    assert sorted(p.name for p in ckpts.glob(".corrupt-*")) == corrupt[1:]
    (pruned,) = [e for e in read_events(out) if e["event"] == "pruned"]
    assert pruned["exports"] == [".tmp-final-dead01"] and pruned["quarantined"] == corrupt[:1]
    # The old log became a segment, whole; the new run began a new file.
    assert [r["step"] for r in _read(out / "events.1.jsonl")] == list(range(1, 40))
    assert not [e for e in read_events(out) if e["event"] == "step" and e["step"] > 2]
