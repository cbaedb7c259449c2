"""shoestring.track: the tracker sinks fed from the event stream, read back through each
tracker's own reader (TensorBoard's EventAccumulator, W&B's offline ``.wandb`` file,
MLflow's client), across a SIGKILL + resume and a SIGTERM (preempt) + resume.

The run's life is simulated with real EventLog records: attempt 1 logs steps 1..7 with a
checkpoint at 4 and is SIGKILLed (a subprocess: nothing closes), attempt 2 resumes from
4 with the stored ids and logs 5..12; or attempt 1 logs 1..6, is preempted (SIGTERM:
checkpoint at 6, close("preempted")) and attempt 2 logs 7..12. Losses encode the attempt
(``attempt + step / 100``) so each reader shows whose value survived.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from shoestring.config import ConfigError, Source, build
from shoestring.events import EventLog, read_events
from shoestring.rundir import RunDir
from shoestring.track import (
    EVENTS,
    MlflowSink,
    TensorBoardSink,
    TrackConfig,
    Tracker,
    TrackerIds,
    TrackerNotInstalled,
    TrackerRow,
    WandbSink,
    to_row,
)

REPO = Path(__file__).resolve().parents[1]
RUN_ID = "0123456789abcdef0123456789abcdef"
ALL: list[Any] = ["tensorboard", "wandb", "mlflow"]


def loss(attempt: int, step: int) -> float:
    return attempt + step / 100


def tracker_env(root: Path) -> dict[str, str]:
    """Offline W&B kept under ``root``; its offline file flushed every 0.1 s (default 15 s)."""
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(root / "wandb-home"),
        "WANDB_CONFIG_DIR": str(root / "wandb-home" / "config"),
        "WANDB_CACHE_DIR": str(root / "wandb-home" / "cache"),
        "WANDB_DATA_DIR": str(root / "wandb-home" / "data"),
        "WANDB__TRANSACTION_LOG_FLUSH_INTERVAL": "0.1",
        "WANDB_DISABLE_GIT": "true",
    }


def new_run_dir(root: Path) -> Path:
    run = root / "run"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"run_id": RUN_ID}))
    (run / "config.yaml").write_text("train:\n  lr: 0.001\n  max_steps: 12\nmodel:\n  path: x\n")
    return run


def drive(
    run: Path,
    attempt: int,
    steps: range,
    *,
    ids: Mapping[str, str] | None = None,
    resume_step: int | None = None,
    last_logged: int | None = None,
) -> tuple[Tracker, EventLog]:
    """One attempt's records, fed as the trainer will: every EventLog record goes to submit."""
    cfg = TrackConfig(to=ALL, wandb_mode="offline", name=f"track-test-{attempt}")
    ev = EventLog(RunDir(run).events, run_id=RUN_ID)
    tracker = Tracker.open(cfg, run, TrackerIds.from_json(ids), resume_step)
    feed = tracker.submit
    if resume_step is not None:
        lost = (last_logged or resume_step) - resume_step
        feed(ev.emit("resume", from_step=resume_step, source="local", steps_lost=lost))
    feed(ev.emit("run_start", step=resume_step or 0, max_steps=12, model="builtin:tiny"))
    feed(ev.emit("data", source="builtin", samples=10))  # not a tracker event
    if resume_step is None:
        feed(ev.emit("eval", step=0, tag="before", loss=3.0, perplexity=20.1, exact_match=0.0))
    for s in steps:
        feed(
            ev.emit(
                "step",
                step=s,
                loss=loss(attempt, s),
                lr=1e-3,
                grad_norm=0.5,
                tokens=64,
                tokens_per_s=1000.0 + s,
                step_ms=50.0,
            )
        )
        if s % 4 == 0:
            feed(ev.emit("checkpoint", step=s, reason="steps", bytes=1000 + s, blocking_ms=3.0))
    return tracker, ev


def finish(tracker: Tracker, ev: EventLog, step: int) -> None:
    feed = tracker.submit
    feed(ev.emit("eval", step=step, tag="after", loss=0.5, perplexity=1.6, exact_match=0.9))
    feed(ev.emit("run_end", status="completed", step=step, final="final", eval={"loss": 0.5}))
    feed(ev.emit("cost", device="cpu", attempts=2, preemptions=1, usd=0.42, wall_hours=0.1))
    tracker.close("completed")
    ev.close()


# --------------------------------------------------------------------------- scenarios


@pytest.fixture(scope="module")
def offline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("trackers")
    mp = pytest.MonkeyPatch()
    for k, v in tracker_env(root).items():
        mp.setenv(k, v)
    mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # (the sink sets it; keep it scoped here)
    # an in-process wandb.init exports its wandb-core's address as WANDB_SERVICE; undone
    # with the rest, so later tests' children start their own (see conftest.CLI.env)
    mp.delenv("WANDB_SERVICE", raising=False)
    yield root
    mp.undo()


@pytest.fixture(scope="module")
def sigkill_run(offline: Path) -> dict[str, Any]:
    """Attempt 1 (a subprocess) logs 1..7, checkpoint at 4, flushes, is SIGKILLed;
    attempt 2 resumes from 4 with the ids attempt 1 reported and logs 5..12."""
    run = new_run_dir(offline / "sigkill")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MLFLOW_ALLOW_FILE_STORE", "WANDB_SERVICE")  # its own wandb-core
    }
    env["PYTHONPATH"] = str(REPO / "src")
    child = subprocess.Popen(
        [sys.executable, __file__, "attempt1", str(run)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], 120)
        line = child.stdout.readline() if ready else ""
        assert line.startswith("{"), child.stderr.read() if child.stderr else line
        # W&B's writer flushes its offline file every 0.1 s here; step 7's row stays open
        wait_for_wandb_step(run, json.loads(line)["wandb"], 6)
    finally:
        child.kill()  # SIGKILL: no close, no atexit, no flush
        child.wait()
    ids = json.loads(line)
    tracker, ev = drive(run, 2, range(5, 13), ids=ids, resume_step=4, last_logged=7)
    finish(tracker, ev, 12)
    return {"run": run, "ids": ids, "ids2": tracker.ids.to_json(), "errors": tracker.errors}


@pytest.fixture(scope="module")
def sigterm_run(offline: Path) -> dict[str, Any]:
    """Attempt 1 logs 1..6, is preempted at 6 (checkpoint saved), closes as preempted;
    attempt 2 resumes from 6 WITHOUT stored ids (found again from run.json) and logs 7..12."""
    from mlflow.tracking import MlflowClient

    run = new_run_dir(offline / "sigterm")
    tracker, ev = drive(run, 1, range(1, 7))
    tracker.submit(ev.emit("preempt", step=6, reason="SIGTERM", saved=True))
    tracker.close("preempted")
    ev.close()
    ids1 = tracker.ids.to_json()
    status1 = MlflowClient(tracking_uri=mlflow_uri(run)).get_run(ids1["mlflow"]).info.status
    tracker, ev = drive(run, 2, range(7, 13), ids=None, resume_step=6, last_logged=6)
    finish(tracker, ev, 12)
    return {"run": run, "ids": ids1, "ids2": tracker.ids.to_json(), "mlflow_status1": status1}


@pytest.mark.e2e
def test_sigkill_and_sigterm_resumes_keep_one_tracker_run_each(
    sigkill_run: dict[str, Any], sigterm_run: dict[str, Any]
) -> None:
    assert set(sigkill_run["ids"]) == {"wandb", "mlflow", "tensorboard"}
    assert sigkill_run["ids2"] == sigkill_run["ids"]
    assert sigkill_run["errors"] == {"tensorboard": 0, "wandb": 0, "mlflow": 0}
    # Without stored ids the same runs are found again: W&B's id derives from run.json's
    # run_id, MLflow's run carries it as a tag, TensorBoard's dir is fixed.
    assert sigterm_run["ids2"] == sigterm_run["ids"]


# --------------------------------------------------------------------------- TensorBoard


def tb_scalars(run: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def tb_texts(run: Path, tag: str) -> list[tuple[int, str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    tag += "/text_summary"  # where SummaryWriter.add_text puts it
    if tag not in acc.Tags()["tensors"]:
        return []
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]


@pytest.mark.e2e
def test_tensorboard_sigkill_resume_shows_each_step_once_with_the_surviving_values(
    sigkill_run: dict[str, Any],
) -> None:
    run = sigkill_run["run"]
    points = tb_scalars(run, "train/loss")
    assert [s for s, _ in points] == list(range(1, 13))  # purge_step hid attempt 1's 5..7
    for s, v in points:
        assert v == pytest.approx(loss(1 if s <= 4 else 2, s))
    assert [s for s, _ in tb_scalars(run, "checkpoint/bytes")] == [4, 8, 12]
    assert [s for s, _ in tb_scalars(run, "eval/after/perplexity")] == [12]
    config = tb_texts(run, "config")
    assert config and "train.lr: 0.001" in config[0][1] and "run.max_steps: 12" in config[0][1]
    assert any("resumed from step 4" in t for _, t in tb_texts(run, "events"))
    assert [s for s, _ in tb_scalars(run, "cost/usd")] == [12]
    assert any("0.42" in t for _, t in tb_texts(run, "cost"))


@pytest.mark.e2e
def test_tensorboard_sigterm_resume_continues_after_the_preempt(
    sigterm_run: dict[str, Any],
) -> None:
    run = sigterm_run["run"]
    points = tb_scalars(run, "train/loss")
    assert [s for s, _ in points] == list(range(1, 13))
    for s, v in points:
        assert v == pytest.approx(loss(1 if s <= 6 else 2, s))
    assert any(s == 6 and "preempt" in t for s, t in tb_texts(run, "events"))


# --------------------------------------------------------------------------- W&B


def wandb_records(path: Path) -> Iterator[Any]:
    """The records of a ``.wandb`` transaction log: a 7-byte header, then LevelDB log
    format (32 KiB blocks; chunks: crc32, length, type FULL/FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec


def wandb_attempts(run: Path, run_id: str) -> list[dict[str, Any]]:
    """Per offline run directory (oldest first): history {step: row}, config, summary,
    alerts, exit code, run id."""
    out = []
    # offline-run-<time>-<id>, with -1, -2 ... when two attempts start in the same second
    for d in sorted((run / "wandb").glob(f"offline-run-*-{run_id}*")):
        got: dict[str, Any] = {"history": {}, "config": {}, "summary": {}, "alerts": []}
        for r in wandb_records(d / f"run-{run_id}.wandb"):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                got["run_id"] = r.run.run_id
            elif kind == "history":
                row = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in r.history.item
                }
                got["history"][r.history.step.num] = row
            elif kind == "config":
                got["config"].update({i.key: json.loads(i.value_json) for i in r.config.update})
            elif kind == "summary":
                got["summary"].update(
                    {
                        i.key or "/".join(i.nested_key): json.loads(i.value_json)
                        for i in r.summary.update
                    }
                )
            elif kind == "alert":
                got["alerts"].append(r.alert.title)
            elif kind == "exit":
                got["exit_code"] = r.exit.exit_code
        out.append(got)
    return out


def wait_for_wandb_step(run: Path, run_id: str, step: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if any(step in a["history"] for a in wandb_attempts(run, run_id)):
                return
        except Exception:  # a record still being written
            pass
        time.sleep(0.1)
    raise AssertionError(f"W&B never wrote step {step} to its offline file")


@pytest.mark.e2e
def test_wandb_sigkill_resume_one_run_id_monotone_steps(sigkill_run: dict[str, Any]) -> None:
    run, wid = sigkill_run["run"], sigkill_run["ids"]["wandb"]
    first, second = wandb_attempts(run, wid)  # offline: one directory per attempt, same id
    assert first["run_id"] == second["run_id"] == wid
    # Attempt 1: W&B commits a step's row when a later step arrives, so the SIGKILL lost
    # step 7's row; everything before it is in the offline file.
    assert list(first["history"]) == list(range(0, 7))
    assert "exit_code" not in first
    assert first["history"][4]["checkpoint/bytes"] == 1004
    assert first["history"][5]["train/loss"] == pytest.approx(loss(1, 5))
    # Attempt 2 re-logs 5..7 (offline W&B ignores resume: its file starts at the resume
    # step); steps rise monotonically in each file.
    assert list(second["history"]) == list(range(5, 13))
    for s, row in second["history"].items():
        assert row["train/loss"] == pytest.approx(loss(2, s))
    assert second["history"][12]["eval/after/exact_match"] == pytest.approx(0.9)
    assert second["config"]["train.lr"] == 0.001 and second["config"]["run.max_steps"] == 12
    assert second["summary"]["cost/usd"] == pytest.approx(0.42)
    assert second["exit_code"] == 0


@pytest.mark.e2e
def test_wandb_sigterm_resume_marks_the_preempt(sigterm_run: dict[str, Any]) -> None:
    run, wid = sigterm_run["run"], sigterm_run["ids"]["wandb"]
    first, second = wandb_attempts(run, wid)
    assert list(first["history"]) == list(range(0, 7))  # close committed step 6
    assert first["exit_code"] == 75
    assert "shoestring: preempt" in first["alerts"]
    assert "preempted at step 6" in first["summary"]["alarm/preempt"]
    assert list(second["history"]) == list(range(7, 13))
    assert second["exit_code"] == 0


# --------------------------------------------------------------------------- MLflow


def mlflow_uri(run: Path) -> str:
    return (run / "mlruns").resolve().as_uri()


def mlflow_run(run: Path, run_id: str) -> tuple[Any, list[tuple[int, float]], Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri(run))
    r = client.get_run(run_id)
    runs = client.search_runs([r.info.experiment_id])
    history = [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")]
    return r, history, runs


@pytest.mark.e2e
def test_mlflow_sigkill_resume_keeps_both_values_of_relogged_steps(
    sigkill_run: dict[str, Any],
) -> None:
    r, history, runs = mlflow_run(sigkill_run["run"], sigkill_run["ids"]["mlflow"])
    assert len(runs) == 1 and r.info.status == "FINISHED"
    steps = [s for s, _ in history]
    assert sorted(set(steps)) == list(range(1, 13))
    assert sorted(s for s in set(steps) if steps.count(s) > 1) == [5, 6, 7]  # only these twice
    by_step: dict[int, list[float]] = {}
    for s, v in history:
        by_step.setdefault(s, []).append(v)
    for s in (5, 6, 7):  # the thrown-away value, then the re-logged one
        assert by_step[s] == pytest.approx([loss(1, s), loss(2, s)])
    assert r.data.params["train.lr"] == "0.001" and r.data.params["run.model"] == "builtin:tiny"
    assert r.data.metrics["cost/usd"] == pytest.approx(0.42)
    assert r.data.tags["shoestring.run_id"] == RUN_ID
    assert r.data.tags["shoestring.events"] == "run completed at step 12"  # the latest note


@pytest.mark.e2e
def test_mlflow_sigterm_resume_is_killed_then_finished_with_the_alarm(
    sigterm_run: dict[str, Any],
) -> None:
    assert sigterm_run["mlflow_status1"] == "KILLED"
    r, history, runs = mlflow_run(sigterm_run["run"], sigterm_run["ids"]["mlflow"])
    assert len(runs) == 1 and r.info.status == "FINISHED"
    assert [s for s, _ in history] == list(range(1, 13))  # nothing re-logged
    assert r.data.tags["shoestring.preempted"] == "true"
    # run_start's per-attempt fields (step, pid) are not params, so nothing "changed"
    assert not [k for k in r.data.tags if k.startswith("shoestring.config.")]
    assert "preempted at step 6 (SIGTERM)" in r.data.tags["shoestring.alarm.preempt"]


# --------------------------------------------------------------------------- outages


class RaisingSink:
    name = "broken"

    def __init__(self) -> None:
        self.calls = 0

    def planned(self, ids: TrackerIds) -> dict[str, str]:
        return {}

    def open(self, ids: TrackerIds, resume_step: int | None) -> dict[str, str]:
        return {}

    def write(self, row: TrackerRow) -> None:
        self.calls += 1
        raise ConnectionError("tracker unreachable")

    def flush(self) -> None:
        raise ConnectionError("tracker unreachable")

    def close(self, status: str) -> None:
        raise ConnectionError("tracker unreachable")


def step_record(step: int) -> dict[str, Any]:
    return {
        "v": 1,
        "ts": time.time(),
        "event": "step",
        "run_id": "r",
        "rank": 0,
        "step": step,
        "loss": 1.0,
        "lr": 1e-3,
    }


def track_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "shoestring.track" and r.levelno == logging.WARNING
    ]


def test_a_sink_that_always_raises_never_reaches_the_run(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "shoestring.track")
    sink = RaisingSink()
    tracker = Tracker([sink])
    t0 = time.perf_counter()
    for s in range(1, 201):
        tracker.submit(step_record(s))
    assert time.perf_counter() - t0 < 0.5
    assert tracker.flush(10)
    tracker.close("completed", timeout=10)
    assert sink.calls >= 1 and tracker.errors["broken"] >= 1
    warnings = track_warnings(caplog)
    assert len(warnings) == 1, warnings  # rate-limited: once per sink per minute
    assert "broken failed (ConnectionError: tracker unreachable); training continues" in warnings[0]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_mlflow_server_costs_the_run_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, "shoestring.track")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    cfg = TrackConfig(to=["mlflow"], mlflow_uri=f"http://127.0.0.1:{closed_port()}")
    with Tracker.open(cfg, tmp_path) as tracker:
        t0 = time.perf_counter()
        for s in range(1, 101):
            tracker.submit(step_record(s))
        assert time.perf_counter() - t0 < 0.5
    assert tracker.ids.mlflow is None
    warnings = track_warnings(caplog)
    assert len(warnings) == 1 and warnings[0].startswith("track: mlflow failed"), warnings


class BlockingSink:
    name = "slow"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.rows = 0

    def planned(self, ids: TrackerIds) -> dict[str, str]:
        return {}

    def open(self, ids: TrackerIds, resume_step: int | None) -> dict[str, str]:
        return {}

    def write(self, row: TrackerRow) -> None:
        self.release.wait(30)
        self.rows += 1

    def flush(self) -> None:
        pass

    def close(self, status: str) -> None:
        pass


def test_submit_never_blocks_when_the_queue_is_full(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "shoestring.track")
    sink = BlockingSink()
    tracker = Tracker([sink], queue_size=100)
    records = [step_record(s) for s in range(10000)]
    t0 = time.perf_counter()
    for r in records:
        tracker.submit(r)
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.0, elapsed
    assert 10000 - 101 <= tracker.dropped <= 10000 - 100
    sink.release.set()
    tracker.close("completed", timeout=10)
    assert sink.rows == 10000 - tracker.dropped
    warnings = track_warnings(caplog)
    assert len(warnings) == 2 and "queue full" in warnings[0] and "dropped" in warnings[1]


class RecordingSink:
    """Counts rows and flushes; ``flushed`` is set at each flush."""

    name = "recording"

    def __init__(self) -> None:
        self.events: list[str] = []
        self.flushes = 0
        self.flushed = threading.Event()

    def planned(self, ids: TrackerIds) -> dict[str, str]:
        return {}

    def open(self, ids: TrackerIds, resume_step: int | None) -> dict[str, str]:
        return {}

    def write(self, row: TrackerRow) -> None:
        self.events.append(row.event)

    def flush(self) -> None:
        self.flushes += 1
        self.flushed.set()

    def close(self, status: str) -> None:
        pass


def test_step_records_wait_for_the_batch_and_a_checkpoint_flushes_them_at_once() -> None:
    """Step records do not wake the tracker thread (its Python work would contend with
    every step for the GIL); a checkpoint record does, and its batch is flushed: every
    step up to a committed checkpoint reaches the sinks' files right after the commit."""
    sink = RecordingSink()
    tracker = Tracker([sink], batch_s=60.0)
    for s in range(1, 6):
        tracker.submit(step_record(s))
    time.sleep(0.5)
    assert sink.events == [] and sink.flushes == 0, "a step record woke the tracker thread"
    tracker.submit({"event": "checkpoint", "ts": time.time(), "step": 5, "bytes": 10})
    assert sink.flushed.wait(10), "a checkpoint record did not wake the tracker thread"
    assert sink.events == ["step"] * 5 + ["checkpoint"] and sink.flushes == 1
    tracker.submit(step_record(6))
    assert tracker.flush(10) and sink.events[-1] == "step" and sink.flushes == 2
    tracker.close()


def test_a_half_full_queue_wakes_the_tracker_thread() -> None:
    sink = RecordingSink()
    tracker = Tracker([sink], queue_size=10, batch_s=60.0)
    for s in range(1, 6):
        tracker.submit(step_record(s))
    assert sink.flushed.wait(10), "a half-full queue did not wake the tracker thread"
    assert sink.events == ["step"] * 5 and tracker.dropped == 0
    tracker.close()


def test_submit_ignores_events_trackers_do_not_show() -> None:
    sink = BlockingSink()
    sink.release.set()
    tracker = Tracker([sink])
    for event in ("data", "window", "gave_up", "interval", "attempt_start", "plan"):
        tracker.submit({"event": event, "step": 1})
    tracker.close()
    assert sink.rows == 0
    inert = Tracker.open(TrackConfig(), "/nonexistent")  # track.to empty: no thread, no sinks
    inert.submit(step_record(1))
    assert inert.flush() and inert.ids == TrackerIds()
    inert.close()


def test_tensorboard_hides_rethrown_steps_when_a_resume_record_arrives(tmp_path: Path) -> None:
    """Opened without resume_step (the tracker started before the resume was known), the
    ``resume`` record itself makes TensorBoard hide the earlier attempt's later steps."""
    for attempt, steps in ((1, range(1, 8)), (2, range(5, 10))):
        sink = TensorBoardSink(tmp_path)
        sink.open(TrackerIds(), None)
        if attempt == 2:
            resume = {"event": "resume", "ts": time.time(), "from_step": 4, "source": "local"}
            sink.write(to_row(resume))  # type: ignore[arg-type]
        for s in steps:
            sink.write(to_row({**step_record(s), "loss": loss(attempt, s)}))  # type: ignore[arg-type]
        sink.close("completed" if attempt == 2 else "preempted")
    points = tb_scalars(tmp_path, "train/loss")
    assert [s for s, _ in points] == list(range(1, 10))
    assert [v for _, v in points] == pytest.approx(
        [loss(1 if s <= 4 else 2, s) for s in range(1, 10)]
    )


# --------------------------------------------------------------------------- missing libraries


@pytest.mark.parametrize(
    ("module", "make"),
    [
        ("wandb", lambda p: WandbSink("p", None, "offline", p, "abc")),
        ("mlflow", lambda p: MlflowSink("file:/x", "p", None, None)),
        ("tensorboard", lambda p: TensorBoardSink(p)),
    ],
)
def test_a_missing_library_names_the_install_hint(
    module: str, make: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(TrackerNotInstalled, match=r"pip install 'shoestring\[track\]'"):
        make(tmp_path)
    with pytest.raises(ImportError, match=f"track.to: {module} needs"):
        Tracker.open(TrackConfig(to=[module]), tmp_path)


def test_a_library_that_fails_to_import_in_open_is_contained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "shoestring.track")
    sink = TensorBoardSink(tmp_path)
    real_import = builtins.__import__

    def no_tb(name: str, *a: Any, **kw: Any) -> Any:
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("broken tensorboard")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_tb)
    tracker = Tracker([sink])
    tracker.submit(step_record(1))
    tracker.close(timeout=10)
    assert tracker.errors == {"tensorboard": 1}
    assert "tensorboard failed (ImportError: broken tensorboard)" in track_warnings(caplog)[0]


# --------------------------------------------------------------------------- config, ids, rows


def test_config_names_the_key_of_an_unknown_tracker() -> None:
    with pytest.raises(
        ValueError, match=r"^track.to: unknown tracker 'x' \(choose tensorboard, wandb, mlflow\)$"
    ):
        TrackConfig(to=["wandb", "x"])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match=r"--to: 'to' unknown tracker 'nope'"):
        build(TrackConfig, [("to", "wandb,nope", Source("--to", "wandb,nope"))])
    cfg = build(TrackConfig, [("to", "wandb,mlflow,wandb", Source("--to"))])
    assert cfg.to == ["wandb", "mlflow"]
    with pytest.raises(ValueError, match="track.queue"):
        TrackConfig(queue=0)


def test_every_tracker_name_has_one_registry_entry_and_no_name_falls_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shoestring.track import TRACKER_KINDS, TRACKERS, build_sinks
    from shoestring.track.registry import tracker_kind

    assert set(TRACKER_KINDS) == set(TRACKERS)
    cfg = TrackConfig(to=["tensorboard", "mlflow"])
    sinks = build_sinks(cfg, tmp_path, TrackerIds())
    assert [s.name for s in sinks] == ["tensorboard", "mlflow"]
    # A name that passed an older check but has no entry is an error, not another tracker.
    cfg.to = ["tensorboard", "neptune"]  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"track.to: no tracker is registered as 'neptune'"):
        build_sinks(cfg, tmp_path, TrackerIds())
    with pytest.raises(ValueError, match="neptune"):
        tracker_kind("neptune")


def test_ids_round_trip_through_json() -> None:
    ids = TrackerIds(wandb="abc", mlflow="f00", tensorboard="tensorboard")
    assert TrackerIds.from_json(json.loads(json.dumps(ids.to_json()))) == ids
    assert TrackerIds.from_json(None) == TrackerIds()
    assert TrackerIds.from_json({"wandb": "a", "other": "b", "mlflow": 3}) == TrackerIds(wandb="a")
    assert TrackerIds(wandb="a").to_json() == {"wandb": "a"}


def test_rows_map_each_tracked_event_in_one_place(tmp_path: Path) -> None:
    with EventLog(tmp_path / "events.jsonl", run_id="r") as ev:
        ev.emit("step", step=3, loss=1.5, lr=1e-4, grad_norm=0.2, tokens_per_s=10.0, batch_crc=7)
        ev.emit("eval", step=3, tag="periodic", loss=1.0, perplexity=2.7, exact_match=0.5)
        ev.emit("checkpoint", step=4, reason="steps", bytes=10, blocking_ms=2.0, path="p")
        ev.emit("straggler", rank=1, part="data", slower_by=0.25, step=9, slower_since_step=3)
        ev.emit("hang", kind="stuck_rank", culprits=[1], summary="rank 1 stuck in forward")
        ev.emit("checkpoint_failed", step=8, reason="steps", error="disk full")
        ev.emit("restart", attempt=2, exit_code=137, reason="killed by SIGKILL")
        ev.emit("notice", provider="aws", action="terminate", preempting=True, deadline_in_s=90)
        ev.emit("window", rank=0, steps=5)
    rows = [to_row(r) for r in read_events(tmp_path / "events.jsonl")]
    step, ev_, ck, strag, hang, ckf, restart, notice, window = rows
    assert (
        step is not None
        and step.step == 3
        and step.scalars
        == {"train/loss": 1.5, "train/lr": 1e-4, "train/grad_norm": 0.2, "train/tokens_per_s": 10.0}
    )
    assert ev_ is not None and ev_.scalars == {
        "eval/periodic/loss": 1.0,
        "eval/periodic/perplexity": 2.7,
        "eval/periodic/exact_match": 0.5,
    }
    assert ck is not None and ck.scalars == {
        "checkpoint/bytes": 10.0,
        "checkpoint/blocking_ms": 2.0,
        "checkpoint/step": 4.0,
    }
    assert strag is not None and strag.alarm == "straggler: rank 1 data slower by 25% since step 3"
    assert (
        hang is not None and hang.step is None and "rank 1 stuck in forward" in (hang.alarm or "")
    )
    assert ckf is not None and ckf.alarm == "checkpoint at step 8 (steps) failed: disk full"
    assert restart is not None and "attempt 2 after exit 137" in (restart.alarm or "")
    assert notice is not None and notice.alarm is None and "aws notice" in notice.texts["events"]
    assert window is None
    assert "window" not in EVENTS and "cost" in EVENTS


# --------------------------------------------------------------------------- attempt 1 (child)


def _attempt1(run: Path) -> None:
    """The SIGKILLed attempt: logs 1..7 (checkpoint at 4), flushes, reports its ids, waits."""
    tracker, _ev = drive(run, 1, range(1, 8))
    assert tracker.flush(120), "tracker did not flush"
    print(json.dumps(tracker.ids.to_json()), flush=True)
    time.sleep(600)


if __name__ == "__main__":
    if sys.argv[1] == "attempt1":
        _attempt1(Path(sys.argv[2]))
