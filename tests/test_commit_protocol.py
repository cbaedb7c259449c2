"""The commit protocol: torn or corrupt checkpoints are never loaded; retention never
deletes the last good one; a failed save leaves the previous checkpoint intact."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shoestring.checkpoint import (
    CheckpointSaveError,
    CorruptCheckpoint,
    FaultPlan,
    FileWriter,
    SaveRequest,
    find_resume_point,
    make_snapshot,
    verify_dir,
)
from shoestring.checkpoint.local import (
    apply_retention,
    clean_stale,
    commit_local,
    committed_steps,
    step_dirname,
)
from shoestring.events import EventLog, read_events


def snap(step: int, n: int = 1000):
    g = torch.Generator().manual_seed(step)
    return make_snapshot(
        step,
        {"w.safetensors": {"w": torch.randn(n, generator=g)}},
        {"state.json": {"step": step}},
        {"kind": "test"},
    )


def writer(
    root: Path, tmp: Path, mode: str = "off", faults: FaultPlan | None = None, keep: int = 2
) -> FileWriter:
    return FileWriter(
        root,
        keep=keep,
        mode=mode,
        events=EventLog(tmp / "events.jsonl", run_id="t"),
        faults=faults or FaultPlan(),
    )


@pytest.mark.parametrize("mode", ["thread", "process", "off"])
def test_commit_writes_manifest_last_and_verifies(tmp_path: Path, mode: str) -> None:
    w = writer(tmp_path / "ck", tmp_path, mode=mode)
    s5 = snap(5)
    w.submit(SaveRequest.files(s5), reason="test")
    s5.tensors["w.safetensors"]["w"].add_(1.0)  # training goes on mutating the live tensor
    w.close()
    m = verify_dir(tmp_path / "ck" / step_dirname(5), deep=True)
    assert m.step == 5 and set(m.files) == {"w.safetensors", "state.json"}
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "ck" / step_dirname(5) / "w.safetensors"))["w"]
    assert torch.equal(saved + 1.0, s5.tensors["w.safetensors"]["w"])  # the pre-mutation copy
    ev = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "checkpoint"]
    assert ev[0]["step"] == 5 and ev[0]["bytes"] == m.total_bytes and ev[0]["background_ms"] > 0


@pytest.mark.e2e
@pytest.mark.parametrize(
    "point", ["ckpt.partial_file", "ckpt.after_file", "ckpt.before_manifest", "ckpt.before_rename"]
)
def test_kill_inside_write_leaves_only_previous_commit(tmp_path: Path, point: str) -> None:
    # A real SIGKILL in a child process at each fault point of the second save.
    code = f"""
import sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_commit_protocol import snap, writer
from shoestring.checkpoint import FaultPlan, SaveRequest
from pathlib import Path
w = writer(Path({str(tmp_path / "ck")!r}), Path({str(tmp_path)!r}),
           faults=FaultPlan.parse("{point}@{3 if point in ("ckpt.after_file", "ckpt.partial_file") else 2}"))
w.submit(SaveRequest.files(snap(1)), reason="t")
w.submit(SaveRequest.files(snap(2)), reason="t")
print("survived")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == -9, r.stderr
    root = tmp_path / "ck"
    assert committed_steps(root) == [1]
    ev = EventLog(tmp_path / "ev2.jsonl", run_id="t")
    point_found = find_resume_point("auto", root, None, verify=True, events=ev)
    assert point_found is not None and point_found.step == 1
    assert clean_stale(root)  # the torn temp dir is garbage and gets removed
    assert sorted(p.name for p in root.iterdir()) == [step_dirname(1)]


def _corrupt(d: Path, how: str) -> None:
    f = d / "w.safetensors"
    if how == "truncate":
        with open(f, "r+b") as fh:
            fh.truncate(f.stat().st_size - 7)
    elif how == "flip":
        b = bytearray(f.read_bytes())
        b[len(b) // 2] ^= 0x01
        f.write_bytes(bytes(b))
    elif how == "no_manifest":
        (d / "manifest.json").unlink()
    elif how == "garbled_manifest":
        (d / "manifest.json").write_text("{not json")


@pytest.mark.parametrize("how", ["truncate", "flip", "no_manifest", "garbled_manifest"])
def test_corrupt_newest_falls_back_to_previous(tmp_path: Path, how: str) -> None:
    root = tmp_path / "ck"
    w = writer(root, tmp_path, keep=3)
    for s in (1, 2, 3):
        w.submit(SaveRequest.files(snap(s)), reason="t")
    _corrupt(root / step_dirname(3), how)
    ev = EventLog(tmp_path / "ev.jsonl", run_id="t")
    p = find_resume_point("auto", root, None, verify=True, events=ev)
    ev.close()
    assert p is not None and p.step == 2
    if how not in ("no_manifest",):
        bad = [e for e in read_events(tmp_path / "ev.jsonl") if e["event"] == "checkpoint_invalid"]
        assert bad and bad[0]["step"] == 3
        assert not (root / step_dirname(3)).exists()  # quarantined, never retried


def test_explicit_resume_path_refuses_corrupt(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    w = writer(root, tmp_path)
    w.submit(SaveRequest.files(snap(1)), reason="t")
    _corrupt(root / step_dirname(1), "flip")
    with pytest.raises(CorruptCheckpoint, match="sha256 mismatch"):
        find_resume_point(
            str(root / step_dirname(1)),
            root,
            None,
            verify=True,
            events=EventLog(tmp_path / "e.jsonl", run_id="t"),
        )


def test_retention_deletes_only_after_new_commit(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    for s in (1, 2):
        commit_local(root, s, {"a": b"x" * s}, {})
    # The third save dies before its manifest: nothing old may have been deleted.
    with pytest.raises(OSError):
        commit_local(root, 3, {"a": b"abc"}, {}, FaultPlan.parse("ckpt.before_manifest:enospc"))
    assert committed_steps(root) == [2, 1]
    commit_local(root, 3, {"a": b"abc"}, {})
    assert apply_retention(root, keep=2) == [1]
    assert committed_steps(root) == [3, 2]


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_save_error_is_reported_and_previous_intact(tmp_path: Path, mode: str) -> None:
    root = tmp_path / "ck"
    w = writer(root, tmp_path, mode=mode, faults=FaultPlan.parse("ckpt.after_file@3:enospc"))
    w.submit(SaveRequest.files(snap(1)), reason="t")
    w.submit(SaveRequest.files(snap(2)), reason="t")
    with pytest.raises(
        CheckpointSaveError,
        match=r"step 2 .*No space left on device.*step 1 is "
        r"intact",
    ):
        w.wait()
    w.close()
    assert committed_steps(root) == [1]
    verify_dir(root / step_dirname(1), deep=True)
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]


def test_saves_never_overlap(tmp_path: Path) -> None:
    w = writer(tmp_path / "ck", tmp_path, mode="thread", keep=10)
    for s in range(1, 6):
        w.submit(SaveRequest.files(snap(s, n=200_000)), reason="t")
        assert w._thread is not None  # the previous job was joined before this one started
    w.wait()
    assert committed_steps(tmp_path / "ck") == [5, 4, 3, 2, 1]


def _can_mount_tmpfs(path: Path) -> bool:
    if os.geteuid() != 0:
        return False
    path.mkdir(exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)], capture_output=True
    )
    if r.returncode == 0:
        subprocess.run(["umount", str(path)])
    return r.returncode == 0


def test_real_disk_full_keeps_previous_checkpoint(tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    if not _can_mount_tmpfs(mnt):
        pytest.skip("needs root to mount a small tmpfs")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], check=True)
    try:
        root = mnt / "ck"
        w = writer(root, tmp_path, mode="thread", keep=1)
        w.submit(SaveRequest.files(snap(1, n=250_000)), reason="t")  # ~1 MB
        w.wait()
        before = (root / step_dirname(1) / "w.safetensors").read_bytes()
        w.submit(SaveRequest.files(snap(2, n=600_000)), reason="t")  # ~2.4 MB: does not fit
        with pytest.raises(CheckpointSaveError) as ei:
            w.wait()
        assert ei.value.__cause__ is not None
        assert getattr(ei.value.__cause__, "errno", None) == errno.ENOSPC
        assert committed_steps(root) == [1]
        verify_dir(root / step_dirname(1), deep=True)
        assert (root / step_dirname(1) / "w.safetensors").read_bytes() == before
    finally:
        subprocess.run(["umount", "-l", str(mnt)])
