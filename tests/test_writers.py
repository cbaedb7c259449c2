"""The checkpoint-writer contract, tested directly: one template (:class:`Writer`) and its two
back-ends — the file writer (thread | process | off) and the sharded (DCP) writer — plus the
commit pipeline they share (publish error text, retention order) and the remote store."""

from __future__ import annotations

import ast
import os
import re
import socket
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from shoestring.checkpoint import (
    CheckpointSaveError,
    FaultPlan,
    FileWriter,
    PublishError,
    RemoteStore,
    SaveRequest,
    Writer,
    make_snapshot,
    verify_dir,
)
from shoestring.checkpoint.commit import publish_and_prune, run_commit
from shoestring.checkpoint.local import commit_local, committed_steps, step_dirname
from shoestring.checkpoint.sharded import ShardedWriter, is_sharded
from shoestring.checkpoint.writer import Committed, Finish
from shoestring.events import EventLog, read_events

CKPT_SRC = Path(__file__).resolve().parent.parent / "src" / "shoestring" / "checkpoint"


def _snap(step: int, n: int = 1000) -> Any:
    g = torch.Generator().manual_seed(step)
    return make_snapshot(
        step,
        {"w.safetensors": {"w": torch.randn(n, generator=g)}},
        {"state.json": {"step": step}},
        {"kind": "test"},
    )


def _events(tmp: Path, name: str = "checkpoint") -> list[dict[str, Any]]:
    return [e for e in read_events(tmp / "events.jsonl") if e["event"] == name]


def _file_writer(
    tmp: Path, mode: str, *, keep: int = 2, faults: str = "", remote: RemoteStore | None = None
) -> FileWriter:
    return FileWriter(
        tmp / "ck",
        keep=keep,
        mode=mode,
        events=EventLog(tmp / "events.jsonl", run_id="t"),
        remote=remote,
        faults=FaultPlan.parse(faults),
    )


# ---------------------------------------------------------------- the file writer


@pytest.mark.parametrize("mode", ["thread", "process", "off"])
def test_file_writer_commits_prunes_and_accounts_blocking(tmp_path: Path, mode: str) -> None:
    w = _file_writer(tmp_path, mode, keep=2)
    returned = []
    try:
        for step in (1, 2, 3):
            req = SaveRequest.files(_snap(step), capture_ms=7.0)
            returned.append(w.submit(req, reason="steps"))
        w.wait()
    finally:
        w.close()
    root = tmp_path / "ck"
    assert committed_steps(root) == [3, 2]  # retention: the newest two
    assert sorted(p.name for p in root.iterdir()) == [step_dirname(2), step_dirname(3)]
    m = verify_dir(root / step_dirname(3), deep=True)
    assert set(m.files) == {"w.safetensors", "state.json"} and m.meta == {"kind": "test"}
    ev = _events(tmp_path)
    assert [e["step"] for e in ev] == [1, 2, 3]
    assert [e["deleted"] for e in ev] == [[], [], [1]]
    # The event's fields and their order are the file writer's (docs/events.md).
    assert list(ev[0])[5:] == [
        "step",
        "path",
        "bytes",
        "serialize_ms",
        "write_ms",
        "upload_ms",
        "background_ms",
        "deleted",
        "reason",
        "blocking_ms",
        "mode",
        "storage",
    ]
    for e, ret in zip(ev, returned):
        assert e["reason"] == "steps" and e["mode"] == mode and e["storage"] == ""
        assert e["blocking_ms"] >= 7.0  # the caller's capture time counts as blocking
        assert e["background_ms"] > 0 and e["bytes"] == m.total_bytes
        if mode == "off":  # synchronous: training waited for the whole commit
            assert e["blocking_ms"] >= 7.0 + e["background_ms"]
        assert ret == pytest.approx(e["blocking_ms"], abs=2e-3)


def test_sync_save_in_thread_mode_blocks_for_the_commit(tmp_path: Path) -> None:
    w = _file_writer(tmp_path, "thread")
    ms = w.submit(SaveRequest.files(_snap(4)), reason="emergency", sync=True)
    assert not w.busy() and committed_steps(tmp_path / "ck") == [4]  # done on return
    (e,) = _events(tmp_path)
    assert e["mode"] == "thread" and e["blocking_ms"] >= e["background_ms"]
    assert ms == pytest.approx(e["blocking_ms"], abs=2e-3)
    w.close()


def test_a_file_writer_refuses_a_sharded_request(tmp_path: Path) -> None:
    w = _file_writer(tmp_path, "off")
    w.submit(SaveRequest.files(_snap(1)), reason="t")
    assert committed_steps(tmp_path / "ck") == [1]
    with pytest.raises(TypeError, match="no snapshot"):
        w.submit(SaveRequest.sharded(2, {}, {}, {}), reason="t")


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_background_failure_surfaces_at_check_naming_the_intact_step(
    tmp_path: Path, mode: str
) -> None:
    # Each save writes 2 files: the 3rd file write is save 2's first.
    w = _file_writer(tmp_path, mode, faults="ckpt.after_file@3:enospc")
    try:
        w.submit(SaveRequest.files(_snap(1)), reason="t")
        w.submit(SaveRequest.files(_snap(2)), reason="t")  # returns: the failure is later
        assert w._thread is not None
        w._thread.join()
        root = tmp_path / "ck"
        with pytest.raises(CheckpointSaveError) as ei:
            w.check()
        # Said once in both modes (the process worker's error crosses a queue).
        assert re.match(
            rf"saving checkpoint step 2 under {re.escape(str(root))} failed: "
            r"OSError: \[Errno 28\] No space left on device",
            str(ei.value),
        )
        assert str(ei.value).endswith("; step 1 is intact")
        assert getattr(ei.value.__cause__, "errno", None) == 28
        w.check()  # reported once
    finally:
        w.close()
    (failed,) = _events(tmp_path, "checkpoint_failed")
    assert failed["step"] == 2 and failed["reason"] == "t" and "No space" in failed["error"]
    assert committed_steps(root) == [1]
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]


def test_failure_without_earlier_checkpoint_says_so(tmp_path: Path) -> None:
    w = _file_writer(tmp_path, "off", faults="ckpt.before_rename:enospc")
    with pytest.raises(
        CheckpointSaveError,
        match=r"step 1 under .* failed: OSError: .*; "
        r"no earlier checkpoint exists$",
    ):
        w.submit(SaveRequest.files(_snap(1)), reason="t")


class _Gated(FileWriter):
    """A file writer whose commit waits for a gate: a slow disk, under test control."""

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.gate = threading.Event()
        self.started: list[int] = []

    def _commit(self, staged: Any) -> Committed:
        self.started.append(staged.step)
        assert self.gate.wait(30)
        return super()._commit(staged)


def test_busy_wait_and_one_save_in_flight(tmp_path: Path) -> None:
    w = _Gated(
        tmp_path / "ck",
        keep=5,
        mode="thread",
        events=EventLog(tmp_path / "events.jsonl", run_id="t"),
    )
    w.submit(SaveRequest.files(_snap(1)), reason="t")
    assert w.busy()
    w.check()  # nothing to report while the save runs
    second = threading.Thread(
        target=w.submit, args=(SaveRequest.files(_snap(2)),), kwargs={"reason": "t"}
    )
    second.start()
    second.join(0.3)
    assert second.is_alive() and w.started == [1]  # the next save waits for the previous
    w.gate.set()
    second.join(30)
    w.wait()
    assert not w.busy() and w.started == [1, 2]
    assert committed_steps(tmp_path / "ck") == [2, 1]
    w.close()


class _Toy(Writer):
    """The smallest back-end: the template alone decides events and blocking."""

    def __init__(self, tmp: Path, mode: str, tail_ms: float, fail: bool = False) -> None:
        super().__init__(
            tmp / "ck", keep=1, mode=mode, events=EventLog(tmp / "events.jsonl", run_id="t")
        )
        self.tail_ms, self.fail = tail_ms, fail

    def _start(self, req: SaveRequest, background: bool) -> Finish:
        def finish() -> Committed:
            if self.fail:
                raise RuntimeError("boom")
            return Committed(
                {"step": req.step, "reason": None, "blocking_ms": None, "background": background},
                self.tail_ms,
            )

        return finish


@pytest.mark.parametrize("mode,sync", [("thread", False), ("thread", True), ("off", False)])
def test_template_fills_reason_and_blocking(tmp_path: Path, mode: str, sync: bool) -> None:
    w = _Toy(tmp_path, mode, tail_ms=1000.0)
    ms = w.submit(SaveRequest(step=3, capture_ms=2.0), reason="final", sync=sync)
    w.close()
    (e,) = _events(tmp_path)
    background = mode == "thread" and not sync
    assert list(e)[5:] == ["step", "reason", "blocking_ms", "background"]
    assert e["reason"] == "final" and e["background"] is background
    assert 2.0 <= e["blocking_ms"] < 500 if background else e["blocking_ms"] >= 1002.0
    assert ms == pytest.approx(e["blocking_ms"], abs=2e-3)


def test_template_reports_failure_once_with_the_common_text(tmp_path: Path) -> None:
    w = _Toy(tmp_path, "thread", tail_ms=0.0, fail=True)
    w.submit(SaveRequest(step=9), reason="t")
    with pytest.raises(
        CheckpointSaveError,
        match=rf"^saving checkpoint step 9 under "
        rf"{re.escape(str(tmp_path / 'ck'))} failed: "
        r"RuntimeError: boom; no earlier",
    ):
        w.wait()
    w.close()  # the error was consumed: close does not raise it again
    assert [e["error"] for e in _events(tmp_path, "checkpoint_failed")] == ["RuntimeError: boom"]


# ---------------------------------------------------------------- the shared commit pipeline


def test_publish_failure_message_and_local_copy_kept(tmp_path: Path) -> None:
    remote = RemoteStore(str(tmp_path / "remote"))
    w = _file_writer(tmp_path, "thread", remote=remote, faults="upload.before_manifest:enospc")
    w.submit(SaveRequest.files(_snap(1)), reason="t")
    with pytest.raises(CheckpointSaveError) as ei:
        w.wait()
    w.close()
    local = tmp_path / "ck" / step_dirname(1)
    cause = ei.value.__cause__
    assert isinstance(cause, PublishError)
    assert str(cause) == (
        f"publishing step 1 to {remote.url} failed (OSError: [Errno 28] No "
        f"space left on device (fault upload.before_manifest)); the local "
        f"copy {local} is committed"
    )
    assert str(ei.value).endswith("; step 1 is intact")  # the local commit did happen
    assert committed_steps(tmp_path / "ck") == [1] and remote.committed_steps() == []


def test_publish_and_prune_order_local_then_remote(tmp_path: Path) -> None:
    root, remote = tmp_path / "ck", RemoteStore(str(tmp_path / "remote"))
    for step in (1, 2, 3):
        path, manifest = commit_local(root, step, {"a.json": b"%d" % step}, {})
        upload_ms, deleted = publish_and_prune(path, manifest, root=root, keep=2, remote=remote)
        assert upload_ms > 0
    assert deleted == [1] and committed_steps(root) == [3, 2]
    assert remote.committed_steps() == [3, 2]
    path, manifest = commit_local(root, 4, {"a.json": b"4"}, {})
    assert publish_and_prune(path, manifest, root=root, keep=2, remote=None) == (0.0, [2])


def test_run_commit_result(tmp_path: Path) -> None:
    res = run_commit(_snap(5), tmp_path / "ck", 1, None)
    assert res.step == 5 and res.deleted == [] and res.upload_ms == 0.0
    assert res.background_ms >= res.serialize_ms + res.write_ms - 1e-3
    assert res.bytes == verify_dir(Path(res.path), deep=True).total_bytes


@pytest.mark.parametrize("scheme", ["", "file://"])
def test_remote_store_publish_committed_steps_retention(tmp_path: Path, scheme: str) -> None:
    remote = RemoteStore(scheme + str(tmp_path / "remote"))
    remote.check()
    (tmp_path / "remote" / step_dirname(1)).mkdir()  # an unfinished upload (no manifest)
    w = _file_writer(tmp_path, "thread", keep=2, remote=remote)
    for step in (2, 3, 4):
        w.submit(SaveRequest.files(_snap(step)), reason="t")
    w.close()
    assert remote.committed_steps() == [4, 3]
    assert sorted(p.name for p in (tmp_path / "remote").iterdir()) == [
        step_dirname(3),
        step_dirname(4),
    ]
    ev = _events(tmp_path)
    assert all(e["storage"] == remote.url and e["upload_ms"] > 0 for e in ev)
    assert ev[-1]["deleted"] == [2]
    assert remote.read_manifest(4) == verify_dir(tmp_path / "ck" / step_dirname(4), deep=True)
    fetched = remote.fetch(4, tmp_path / "cache")
    assert (fetched / "w.safetensors").read_bytes() == (
        tmp_path / "ck" / step_dirname(4) / "w.safetensors"
    ).read_bytes()


# ---------------------------------------------------------------- the sharded (DCP) writer


def _dcp_request(step: int, rank: int = 0) -> SaveRequest:
    g = torch.Generator().manual_seed(step * 10 + rank)
    state = {"model": {"w": torch.randn(64, generator=g)}, "optim": {"m": torch.ones(8) * step}}
    return SaveRequest.sharded(
        step, state, {f"rng_rank{rank}.json": b"{}"}, {"kind": "dcp"}, capture_ms=1.0
    )


def _sharded(
    tmp: Path,
    mode: str,
    *,
    rank: int = 0,
    group: Any = None,
    keep: int = 2,
    faults: str = "",
    remote: RemoteStore | None = None,
) -> ShardedWriter:
    return ShardedWriter(
        tmp / "ck",
        rank=rank,
        group=group,
        keep=keep,
        mode=mode,
        events=EventLog(
            tmp / ("events.jsonl" if rank == 0 else f"events.rank{rank}.jsonl"),
            run_id="t",
            rank=rank,
        ),
        remote=remote,
        faults=FaultPlan.parse(faults),
    )


@pytest.mark.parametrize("mode", ["thread", "off"])
def test_sharded_writer_in_one_process(tmp_path: Path, mode: str) -> None:
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    remote = RemoteStore(str(tmp_path / "remote"))
    w = _sharded(tmp_path, mode, remote=remote)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        for step in (1, 2, 3):
            w.submit(_dcp_request(step), reason="steps")
        w.close()
    root = tmp_path / "ck"
    assert committed_steps(root) == [3, 2] and remote.committed_steps() == [3, 2]
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    m = verify_dir(root / step_dirname(3), deep=True)
    assert is_sharded(m.files) and "rng_rank0.json" in m.files and m.meta == {"kind": "dcp"}
    ev = _events(tmp_path)
    assert list(ev[0])[5:] == [
        "step",
        "path",
        "bytes",
        "reason",
        "mode",
        "format",
        "shards",
        "blocking_ms",
        "seal_ms",
        "upload_ms",
        "storage",
        "deleted",
    ]
    assert [e["deleted"] for e in ev] == [[], [], [1]]
    for e in ev:
        assert e["format"] == "dcp" and e["shards"] == 1 and e["mode"] == mode
        assert e["reason"] == "steps" and e["storage"] == remote.url
        assert e["blocking_ms"] >= 1.0 and e["seal_ms"] > 0
        if mode == "off":
            assert e["blocking_ms"] >= 1.0 + e["seal_ms"]
    back = {"model": {"w": torch.zeros(64)}, "optim": {"m": torch.zeros(8)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_load(back, checkpoint_id=str(root / step_dirname(3)), no_dist=True)
    want = _dcp_request(3).state
    assert want is not None and torch.equal(back["model"]["w"], want["model"]["w"])
    assert torch.equal(back["optim"]["m"], torch.full((8,), 3.0))


def test_sharded_seal_failure_names_rank_and_intact_step(tmp_path: Path) -> None:
    w = _sharded(tmp_path, "thread", faults="ckpt.before_manifest@2:enospc")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w.submit(_dcp_request(1), reason="t")
        w.submit(_dcp_request(2), reason="t")
        with pytest.raises(CheckpointSaveError) as ei:
            w.wait()
    w.close()
    root = tmp_path / "ck"
    assert re.fullmatch(
        rf"saving checkpoint step 2 under {re.escape(str(root))} failed on rank "
        r"0: OSError: \[Errno 28\] No space left on device \(fault "
        r"ckpt.before_manifest\); step 1 is intact",
        str(ei.value),
    )
    assert [e["step"] for e in _events(tmp_path, "checkpoint_failed")] == [2]
    assert committed_steps(root) == [1]


def test_sharded_publish_failure_uses_the_same_message(tmp_path: Path) -> None:
    remote = RemoteStore(str(tmp_path / "remote"))
    w = _sharded(tmp_path, "off", remote=remote, faults="upload.before_manifest:enospc")
    with warnings.catch_warnings(), pytest.raises(CheckpointSaveError) as ei:
        warnings.simplefilter("ignore")
        w.submit(_dcp_request(1), reason="t")
    cause = ei.value.__cause__
    assert isinstance(cause, PublishError)
    assert str(cause).startswith(f"publishing step 1 to {remote.url} failed (OSError: ")
    assert str(cause).endswith(f"the local copy {tmp_path / 'ck' / step_dirname(1)} is committed")


def test_sharded_writer_refuses_a_files_request(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="no DCP state"):
        _sharded(tmp_path, "off").submit(SaveRequest.files(_snap(1)), reason="t")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _dcp_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        w = _sharded(Path(out), "thread", rank=rank, group=dist.group.WORLD, keep=1)
        w.submit(_dcp_request(1, rank), reason="steps")
        w.submit(_dcp_request(2, rank), reason="emergency", sync=True)
        w.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.e2e
def test_sharded_writer_two_gloo_ranks(tmp_path: Path) -> None:
    mp.start_processes(
        _dcp_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn"
    )
    root = tmp_path / "ck"
    assert committed_steps(root) == [2]  # keep=1: step 1 pruned after step 2 was sealed
    m = verify_dir(root / step_dirname(2), deep=True)
    assert {"rng_rank0.json", "rng_rank1.json", ".metadata"} <= set(m.files)
    assert list(read_events(tmp_path / "events.rank1.jsonl")) == []  # only rank 0 logs
    ck = _events(tmp_path)
    assert [(e["step"], e["mode"], e["shards"]) for e in ck] == [(1, "thread", 2), (2, "off", 2)]


# ---------------------------------------------------------------- the package's shape


def _imports(path: Path) -> set[str]:
    """checkpoint/ modules that ``path`` imports, at top level or inside functions."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if parts[:2] == ["shoestring", "checkpoint"]:
                out |= {parts[2]} if len(parts) > 2 else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {
                a.name.split(".")[2]
                for a in node.names
                if a.name.startswith("shoestring.checkpoint.")
            }
    return out


def test_checkpoint_package_has_no_import_cycle() -> None:
    graph = {
        p.stem: _imports(p) - {"__init__"} for p in CKPT_SRC.glob("*.py") if p.stem != "__init__"
    }
    assert "writer" not in graph["procworker"] and "commit" in graph["procworker"]

    def reaches(a: str, b: str, seen: frozenset[str] = frozenset()) -> bool:
        return any(
            n == b or (n not in seen and reaches(n, b, seen | {n})) for n in graph.get(a, ())
        )

    assert [m for m in graph if reaches(m, m)] == []


def test_no_function_in_checkpoint_is_over_60_lines() -> None:
    long = [
        f"{p.name}:{n.name} ({n.end_lineno - n.lineno + 1} lines)"  # type: ignore[operator]
        for p in CKPT_SRC.glob("*.py")
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and n.end_lineno - n.lineno + 1 > 60
    ]  # type: ignore[operator]
    assert long == []
