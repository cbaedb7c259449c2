"""What a checkpoint directory and a bucket are trusted with: file names stay inside the
checkpoint, nothing is read, kept or deleted through a symlink."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import CLI, FAST, read_events
from shoestring.checkpoint.local import (
    apply_retention,
    clean_stale,
    commit_local,
    committed_steps,
    step_dirname,
)
from shoestring.checkpoint.manifest import MANIFEST, CorruptCheckpoint, Manifest, verify_dir
from shoestring.checkpoint.remote import RemoteStore
from shoestring.checkpoint.resume import find_resume_point
from shoestring.events import EventLog


def _manifest(files: dict[str, dict[str, object]]) -> str:
    return json.dumps({"format": Manifest(1, {}).format, "step": 1, "files": files})


@pytest.mark.parametrize(
    "name", ["/etc/passwd", "../x", "a/../../x", "a//b", "./a", "", "a\\..\\b", "a\x00b", "a/."]
)
def test_a_manifest_naming_a_path_outside_the_checkpoint_is_refused(name: str) -> None:
    with pytest.raises(CorruptCheckpoint, match="not a plain relative path"):
        Manifest.from_json(_manifest({name: {"size": 1, "sha256": "0" * 64}}), "m.json")


def test_nested_plain_names_are_accepted() -> None:
    m = Manifest.from_json(_manifest({"shards/__0_0.distcp": {"size": 1, "sha256": "a"}}), "m")
    assert list(m.files) == ["shards/__0_0.distcp"]


def test_a_bucket_manifest_writing_outside_is_refused_and_the_previous_step_used(
    tmp_path: Path,
) -> None:
    root, bucket = tmp_path / "run" / "checkpoints", tmp_path / "bucket"
    remote = RemoteStore(str(bucket))
    for step in (1, 2):
        path, manifest = commit_local(root, step, {"a.json": b"%d" % step}, {})
        remote.publish(path, manifest)
    for step in (1, 2):
        os.rename(root / step_dirname(step), tmp_path / f"gone-{step}")  # an empty disk
    evil = tmp_path / "evil.txt"
    doc = json.loads((bucket / step_dirname(2) / MANIFEST).read_text())
    doc["files"] = {"../../../evil.txt": doc["files"]["a.json"]}
    (bucket / step_dirname(2) / MANIFEST).write_text(json.dumps(doc))
    events = EventLog(tmp_path / "events.jsonl", run_id="r")
    point = find_resume_point("auto", root, remote, verify=True, events=events)
    assert point is not None and point.step == 1 and point.source == "remote"
    assert not evil.exists()
    (bad,) = [e for e in read_events(tmp_path) if e["event"] == "checkpoint_invalid"]
    assert bad["step"] == 2 and "not a plain relative path" in bad["error"]


def test_a_checkpoint_whose_file_is_a_symlink_is_invalid(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    path, _ = commit_local(root, 1, {"a.json": b"1"}, {})
    outside = tmp_path / "outside.json"
    outside.write_bytes(b"1")  # same bytes and size: only the link gives it away
    os.unlink(path / "a.json")
    os.symlink(outside, path / "a.json")
    with pytest.raises(CorruptCheckpoint, match="symlink"):
        verify_dir(path, deep=True)


def test_retention_and_cleanup_never_act_through_a_symlink(tmp_path: Path) -> None:
    other = tmp_path / "other-run" / "checkpoints"
    theirs, _ = commit_local(other, 1, {"a.json": b"theirs"}, {})
    root = tmp_path / "run" / "checkpoints"
    for step in (2, 3, 4):
        commit_local(root, step, {"a.json": b"%d" % step}, {})
    os.symlink(theirs, root / step_dirname(1))  # a link to another run's checkpoint
    os.symlink(tmp_path / "other-run", root / ".tmp-linked")
    assert committed_steps(root) == [4, 3, 2]  # the link is not one of ours
    assert apply_retention(root, keep=1) == [3, 2]
    clean_stale(root)
    assert (theirs / MANIFEST).exists() and (theirs / "a.json").read_bytes() == b"theirs"
    assert committed_steps(other) == [1]


@pytest.mark.e2e
@pytest.mark.slow  # the fallback: ...that_does_not_load_falls_back (CI time)
def test_a_verified_checkpoint_lacking_a_required_file_falls_back(cli: CLI, tmp_path: Path) -> None:
    """A manifest that verifies but does not list adapter.safetensors (a hand-edited or
    foreign checkpoint) used to crash-loop with KeyError; now it is invalid and the
    previous checkpoint resumes."""
    out = tmp_path / "run"
    r = cli.run(out, *FAST)
    assert r.returncode == 0, r.stderr[-2000:]
    last = out / "checkpoints" / step_dirname(12)
    doc = json.loads((last / MANIFEST).read_text())
    del doc["files"]["adapter.safetensors"]
    (last / "adapter.safetensors").unlink()
    (last / MANIFEST).write_text(json.dumps(doc))
    r = cli.run(out, *FAST)
    assert r.returncode == 0, r.stderr[-2000:]
    ev = read_events(out)
    (bad,) = [e for e in ev if e["event"] == "checkpoint_invalid"]
    assert bad["step"] == 12 and "lacks adapter.safetensors" in bad["error"]
    assert [e["from_step"] for e in ev if e["event"] == "resume"] == [8]


def _replace_file(ckpt: Path, name: str, data: bytes) -> None:
    """Put ``data`` in the checkpoint as ``name`` and make the manifest agree with it:
    a checkpoint that verifies, whatever its bytes are."""
    import hashlib

    (ckpt / name).write_bytes(data)
    doc = json.loads((ckpt / MANIFEST).read_text())
    doc["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / MANIFEST).write_text(json.dumps(doc))


def _adapter_without_one_tensor(ckpt: Path) -> bytes:
    from safetensors.torch import load_file, save

    tensors = load_file(str(ckpt / "adapter.safetensors"))
    tensors.pop(sorted(tensors)[0])
    return save(tensors)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "damage",
    [
        "not_safetensors",
        pytest.param("missing_tensor", marks=pytest.mark.slow),  # (CI's 20 minutes)
        pytest.param("state_not_json", marks=pytest.mark.slow),
    ],
)
def test_a_verified_checkpoint_that_does_not_load_falls_back(
    cli: CLI, tmp_path: Path, damage: str
) -> None:
    """Bytes that verify against their manifest but are not a loadable state (garbage in
    place of the adapter, an adapter lacking a tensor, a trainer state that is not
    JSON): the checkpoint is invalid and quarantined, the previous one resumes — this
    used to end every rerun in a crash (SafetensorError, KeyError, JSONDecodeError)."""
    out = tmp_path / "run"
    r = cli.run(out, *FAST)
    assert r.returncode == 0, r.stderr[-2000:]
    last = out / "checkpoints" / step_dirname(12)
    if damage == "not_safetensors":
        _replace_file(last, "adapter.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    elif damage == "missing_tensor":
        _replace_file(last, "adapter.safetensors", _adapter_without_one_tensor(last))
    else:
        _replace_file(last, "trainer_state.json", b"{not json")
    r = cli.run(out, *FAST)
    assert r.returncode == 0, r.stderr[-2000:]
    ev = read_events(out)
    (bad,) = [e for e in ev if e["event"] == "checkpoint_invalid"]
    assert bad["step"] == 12 and "cannot load it" in bad["error"], bad
    assert [e["from_step"] for e in ev if e["event"] == "resume"] == [8]
    assert Path(bad["quarantined"]).is_dir()  # moved aside, not deleted
    assert max(committed_steps(out / "checkpoints")) == 12  # trained again to the end
    verify_dir(last, deep=True)


def test_a_plain_path_store_prunes_staging_a_killed_publish_left(tmp_path: Path) -> None:
    root, bucket = tmp_path / "run" / "checkpoints", tmp_path / "bucket"
    remote = RemoteStore(str(bucket))
    path, manifest = commit_local(root, 2, {"a.json": b"2"}, {})
    remote.publish(path, manifest)
    # A publish of step 3 killed part-way, and one of step 9 still in progress.
    killed = bucket / f".tmp-{step_dirname(3)}-4242-deadbeef"
    running = bucket / f".tmp-{step_dirname(9)}-4343-cafef00d"
    for d in (killed, running):
        d.mkdir()
        (d / "a.json").write_bytes(b"partial")
    path, manifest = commit_local(root, 4, {"a.json": b"4"}, {})
    remote.publish(path, manifest)
    assert remote.apply_retention(keep=1) == [2]
    assert not killed.exists() and running.is_dir()
    assert remote.committed_steps() == [4]
