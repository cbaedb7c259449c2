"""PyTorch's NCCL flight recorder attached to a hang verdict, without NCCL: a fake rank
plays torch's part (a FIFO it reads without blocking, a pickled dump written in place
to ``<prefix><rank>``, as ``DumpPipe`` and ``DebugInfoWriter`` do in torch 2.13)."""

from __future__ import annotations

import datetime
import json
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from shoestring.supervise.supervisor import Supervisor, SupervisorConfig
from shoestring.watch.flight import (
    PIPE_NAME,
    TRACE_NAME,
    TracePaths,
    collect_traces,
    flight_recorder_env,
    load_dump,
    poke,
    records_by_default,
    summarize,
)
from shoestring.watch.hang import Verdict


def _entry(seq: int, name: str, state: str, sizes: list[list[int]]) -> dict[str, Any]:
    """One entry with the keys of torch's FlightRecorder::getCollectiveTrace (v2.10)."""
    return {
        "record_id": seq - 1,
        "pg_id": 0,
        "process_group": ("0", "default_pg"),
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": seq,
        "profiling_name": name,
        "time_created_ns": 1_700_000_000_000_000_000 + seq,
        "input_sizes": sizes,
        "input_dtypes": ["Float"],
        "output_sizes": sizes,
        "output_dtypes": ["Float"],
        "state": state,
        "time_discovered_started_ns": None if state == "scheduled" else 1,
        "time_discovered_completed_ns": 2 if state == "completed" else None,
        "retired": state == "completed",
        "timeout_ms": 600_000,
        "is_p2p": False,
        "thread_id": "140000",
        "thread_name": "MainThread",
        "frames": [{"name": "all_reduce", "filename": "distributed_c10d.py", "line": 2800}],
    }


def _dump(entries: list[dict[str, Any]]) -> bytes:
    d = {
        "version": "2.10",
        "comm_lib_version": "2.21.5",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
        "pg_status": {
            "0": {
                "last_enqueued_collective": 8,
                "last_started_collective": 7,
                "last_completed_collective": 6,
            }
        },
        "entries": entries,
    }
    return pickle.dumps(d, protocol=2)  # torch's C++ pickler writes protocol 2


HUNG = _dump(
    [
        _entry(6, "nccl:all_reduce", "completed", [[1024]]),
        _entry(7, "nccl:all_reduce", "started", [[1024]]),
        _entry(8, "nccl:broadcast", "scheduled", [[3]]),
    ]
)


class FakeRank:
    """Reads its FIFO like torch's heartbeat monitor (non-blocking, polled); on a request,
    writes ``payload`` to ``dump`` in place, in two parts."""

    def __init__(self, pipe: Path, dump: Path, payload: bytes = HUNG, answer: bool = True) -> None:
        self.pipe, self.dump, self.payload, self.answer = pipe, dump, payload, answer
        self.requests = 0
        self._ready, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FakeRank:
        if self.pipe.exists():
            self.pipe.unlink()
        os.mkfifo(self.pipe, 0o666)
        self._thread.start()
        assert self._ready.wait(5)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        fd = os.open(self.pipe, os.O_RDONLY | os.O_NONBLOCK)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if os.read(fd, 128):  # b"" without a writer, as torch's shouldDump()
                    self.requests += 1
                    if self.answer:
                        self._write()
                time.sleep(0.02)
        finally:
            os.close(fd)

    def _write(self) -> None:
        cut = next(
            i
            for i in range(len(self.payload) // 2, 0, -1)
            if self.payload[i - 1 : i] != pickle.STOP
        )
        with open(self.dump, "wb") as f:
            f.write(self.payload[:cut])
            f.flush()
            time.sleep(0.05)
            f.write(self.payload[cut:])


def _paths(run: Path) -> TracePaths:
    (run / "ranks").mkdir(parents=True, exist_ok=True)
    (run / "verdicts").mkdir(parents=True, exist_ok=True)
    return TracePaths.from_env(flight_recorder_env({}, run))


def test_env_turns_the_recorder_on_under_the_run_dir(tmp_path: Path) -> None:
    base = {"PATH": "/usr/bin", "RANK": "0"}
    env = flight_recorder_env(base, tmp_path / "run")
    run = (tmp_path / "run").absolute()
    assert env == {
        **base,
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": f"{run}/verdicts/{TRACE_NAME}",
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": f"{run}/ranks/{PIPE_NAME}",
    }
    assert base == {"PATH": "/usr/bin", "RANK": "0"}  # not modified
    paths = TracePaths.from_env(env)
    assert paths.dump(3) == run / "verdicts" / "nccl_trace_rank_3"
    assert paths.pipe_prefix == f"{run}/ranks/nccl_pipe_rank_"
    # torch >= 2.13 keeps 2000 entries by default and would only warn that the name is old.
    recent = flight_recorder_env(base, tmp_path / "run", "2.13.0+cpu")
    assert recent == {k: v for k, v in env.items() if k != "TORCH_NCCL_TRACE_BUFFER_SIZE"}
    assert flight_recorder_env(base, tmp_path, "2.4.1")["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert [
        records_by_default(v)
        for v in ("2.13.0", "2.14.1+cu128", "3.0", "2.12.1", "2.9.0a0", "", None)
    ] == [True] * 3 + [False] * 4


def test_env_keeps_what_the_user_set(tmp_path: Path) -> None:
    user = {
        "TORCH_FR_BUFFER_SIZE": "500",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/scratch/fr_",  # the older name
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "",
    }  # explicitly off
    env = flight_recorder_env(user, tmp_path)
    assert env == {**user, "TORCH_NCCL_TRACE_BUFFER_SIZE": "500"}  # agrees with FR's own
    assert "TORCH_FR_DUMP_TEMP_FILE" not in env  # it would take precedence over theirs
    paths = TracePaths.from_env(env)
    assert paths == TracePaths("/scratch/fr_", None)
    assert collect_traces(paths, 5.0) == {}  # no pipe configured: nothing asked, no wait
    kept = flight_recorder_env(
        {"TORCH_FR_DUMP_TEMP_FILE": "/a/b_", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}, tmp_path
    )
    assert kept["TORCH_FR_DUMP_TEMP_FILE"] == "/a/b_"
    assert kept["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "0"


def test_fake_rank_dumps_and_the_verdict_names_its_last_collective(tmp_path: Path) -> None:
    paths = _paths(tmp_path)
    dump = paths.dump(1)
    assert dump is not None
    dump.write_bytes(_dump([_entry(1, "nccl:barrier", "completed", [[1]])]))  # older, stale
    pipe = Path(f"{paths.pipe_prefix}1.pipe")
    with FakeRank(pipe, dump) as rank:
        t0 = time.monotonic()
        got = collect_traces(paths, 5.0, "hang-123.")
        took = time.monotonic() - t0
    assert rank.requests == 1 and took < 3.0
    rec = got["1"]
    assert rec["path"] == str(tmp_path / "verdicts" / "hang-123.nccl_trace_rank_1")
    assert rec["bytes"] == len(HUNG) and Path(rec["path"]).read_bytes() == HUNG
    assert not dump.exists()  # kept under the verdict's name: a later dump cannot overwrite it
    assert "nccl_trace_error" not in rec
    assert rec["summary"].startswith("last: nccl:broadcast #8 scheduled (pg 0, input sizes [[3]])")
    assert "oldest not completed: nccl:all_reduce #7 started" in rec["summary"]
    assert rec["last_collective"] == {
        "profiling_name": "nccl:broadcast",
        "seq": 8,
        "state": "scheduled",
        "process_group": ("0", "default_pg"),
    }
    assert rec["entries"] == 3
    json.dumps(got)  # goes into the verdict file and the event as it is


def test_pipe_without_reader_does_not_block(tmp_path: Path) -> None:
    paths = _paths(tmp_path)
    os.mkfifo(f"{paths.pipe_prefix}0.pipe")  # left by a rank that is gone
    t0 = time.monotonic()
    got = collect_traces(paths, 5.0)
    assert time.monotonic() - t0 < 1.0  # nobody was asked, so nothing is waited for
    assert got["0"]["path"] is None
    assert "no process reads its dump pipe" in got["0"]["nccl_trace_error"]
    assert poke(Path(f"{paths.pipe_prefix}0.pipe")) is not None


def test_rank_that_reads_but_never_dumps_costs_the_wait_and_no_more(tmp_path: Path) -> None:
    paths = _paths(tmp_path)
    dump = paths.dump(0)
    assert dump is not None
    with FakeRank(Path(f"{paths.pipe_prefix}0.pipe"), dump, answer=False) as rank:
        t0 = time.monotonic()
        got = collect_traces(paths, 0.6)
        took = time.monotonic() - t0
    assert rank.requests == 1 and 0.6 <= took < 2.0
    assert got["0"]["path"] is None and "no new dump" in got["0"]["nccl_trace_error"]


def test_no_pipes_means_no_wait_and_no_fields(tmp_path: Path) -> None:
    paths = _paths(tmp_path)  # gloo: the directories exist, torch made no FIFO
    (tmp_path / "ranks" / "rank0").mkdir()
    (tmp_path / "ranks" / f"{PIPE_NAME}0.pipe.txt").write_text("not a pipe")
    (tmp_path / "ranks" / f"{PIPE_NAME}1.pipe").write_text("a regular file, not a FIFO")
    t0 = time.monotonic()
    assert collect_traces(paths, 5.0) == {}
    assert time.monotonic() - t0 < 0.5
    assert collect_traces(TracePaths(None, None), 5.0) == {}


def test_unreadable_dumps_become_errors_not_failures(tmp_path: Path) -> None:
    paths = _paths(tmp_path)
    evil = pickle.dumps({"entries": [], "when": datetime.date(2024, 1, 1)}, protocol=2)
    for r, payload in ((0, b"\x80\x02}q\x00X\x07\x00\x00\x00entries."), (1, evil)):
        dump = paths.dump(r)
        assert dump is not None
        with FakeRank(Path(f"{paths.pipe_prefix}{r}.pipe"), dump, payload):
            got = collect_traces(paths, 2.0)
        assert got[str(r)]["path"] == str(dump) and got[str(r)]["bytes"] == len(payload)
        assert got[str(r)]["nccl_trace_error"].startswith("cannot read the dump")
        assert "summary" not in got[str(r)]
    assert "refused a reference to datetime.date" in got["1"]["nccl_trace_error"]
    assert summarize(load_dump(_write(tmp_path / "empty", _dump([]))))["entries"] == 0


REAL_DUMP = """
import sys, torch, torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0,
                        world_size=1)
t = torch.ones(3)
dist.all_reduce(t)
dist.broadcast(t, 0)
open(sys.argv[1], "wb").write(_dump_fr_trace(True, True, False))
dist.destroy_process_group()
"""


@pytest.mark.e2e
def test_a_dump_written_by_torch_itself_is_summarised(tmp_path: Path) -> None:
    """torch's own C++ pickler and entry format (gloo records into the same flight recorder
    on CPU): read without allowing any class reference."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dump = tmp_path / "nccl_trace_rank_0"
    subprocess.run(
        [sys.executable, "-c", REAL_DUMP, str(dump), str(port)],
        check=True,
        timeout=120,
        env={**os.environ, "TORCH_FR_BUFFER_SIZE": "100"},
    )
    d = load_dump(dump)
    assert {"version", "pg_config", "pg_status", "entries"} <= set(d)
    got = summarize(d)
    assert got["entries"] == 2
    assert got["summary"].startswith("last: gloo:broadcast #2 ")
    assert "oldest not completed" not in got["summary"]  # both retired
    assert got["last_collective"]["profiling_name"] == "gloo:broadcast"
    assert got["last_collective"]["seq"] == 2


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_hang_verdict_carries_the_traces(tmp_path: Path) -> None:
    """The supervisor's own path: the verdict file and the `hang` event get `nccl_traces`
    (no child to kill: the verdict names no pid)."""
    sup = Supervisor(["true"], SupervisorConfig(run_dir=tmp_path, nccl_dump_wait_s=3.0), {})
    assert sup.child_env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and sup.env == {}
    paths = _paths(tmp_path)
    dump = paths.dump(0)
    assert dump is not None
    verdict = Verdict(
        "collective_hang",
        [0, 1],
        "all ranks entered all_reduce #7",
        {"op": "all_reduce", "seq": 7},
        {0: {"step": 3}, 1: {"step": 3}},
        12.0,
    )
    with FakeRank(Path(f"{paths.pipe_prefix}0.pipe"), dump):
        sup._on_hang(verdict)
    (ev,) = [
        json.loads(line)
        for line in (tmp_path / "events.jsonl").read_text().splitlines()
        if json.loads(line)["event"] == "hang"
    ]
    rec = json.loads(Path(ev["verdict_file"]).read_text())
    for got in (ev["nccl_traces"], rec["nccl_traces"]):
        assert list(got) == ["0"]
        assert got["0"]["path"].endswith(".nccl_trace_rank_0")
        assert Path(got["0"]["path"]).name.startswith(Path(ev["verdict_file"]).stem + ".")
        assert "nccl:all_reduce #7 started" in got["0"]["summary"]
    sup.alerts.close()


def test_cli_rejects_a_negative_dump_wait(capsys: Any) -> None:
    from shoestring.cli import main

    assert main(["run", "--nccl-dump-wait", "-1", "--", "true"]) == 2
    assert "--nccl-dump-wait: 'nccl_dump_wait' must be >= 0" in capsys.readouterr().err
