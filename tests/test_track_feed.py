"""`shoestring run`'s records reach a run's trackers: the tail of events.jsonl (from the
watermark in run.json) and the rows its host/GPU samples and alarms become."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from shoestring.events import EventLog, rotate
from shoestring.rundir import RunDir
from shoestring.track import to_row
from shoestring.train import tracking


class Collect:
    def __init__(self) -> None:
        self.got: list[dict[str, Any]] = []

    def submit(self, record: dict[str, Any]) -> None:
        self.got.append(dict(record))


def _wait_for(pred: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_feed_hands_on_supervisor_records_once_across_attempts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tracking, "POLL_S", 0.05)
    rd = RunDir(tmp_path)
    sup = EventLog(rd.events, run_id="r", rank=-1)
    trainer = EventLog(rd.events, run_id="r", rank=0)
    rd.run_json.write_text(json.dumps({"run_id": "r"}))
    sup.emit("hang", kind="stuck_rank", culprits=[1])
    sup.emit("restart", reason="hang")
    trainer.emit("step", step=1, loss=1.0)

    first = Collect()
    feed = tracking.SupervisorFeed(first, rd)  # type: ignore[arg-type]
    assert [r["event"] for r in first.got] == ["hang", "restart"]  # not the trainer's
    sup.emit("metrics", host={"cpu_pct": 50.0})
    _wait_for(lambda: len(first.got) == 3)  # tailed while the attempt runs
    with open(rd.events, "a") as f:  # a line still being written is not read yet
        f.write('{"v":1,"ts":')
    time.sleep(0.2)
    assert len(first.got) == 3
    with open(rd.events, "a") as f:  # ... until its writer ends it
        f.write('9.0,"event":"step","rank":0}\n')
    feed.close()
    assert json.loads(rd.run_json.read_text())["tracked_until"] == first.got[-1]["ts"]

    second = Collect()  # the next attempt: nothing again, only what is new
    sup.emit("straggler", rank=1, part="forward", slower_by=0.2)
    feed = tracking.SupervisorFeed(second, rd)  # type: ignore[arg-type]
    feed.close()
    assert [r["event"] for r in second.got] == ["straggler"]


def test_records_a_rotation_moved_into_an_old_segment_are_still_handed_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``shoestring run`` wrote a hang and a restart after the last forward; the next
    start rotated the log (it had grown past events_rotate_mb): those records are in
    events.1.jsonl now, and the feed still hands them on, once."""
    monkeypatch.setattr(tracking, "POLL_S", 0.05)
    rd = RunDir(tmp_path)
    rd.run_json.write_text(json.dumps({"run_id": "r"}))
    with EventLog(rd.events, run_id="r", rank=-1) as sup:
        sup.emit("restart", reason="preempted")
    first = Collect()
    tracking.SupervisorFeed(first, rd).close()  # type: ignore[arg-type]
    with EventLog(rd.events, run_id="r", rank=-1) as sup:
        sup.emit("hang", kind="stuck_rank", culprits=[1])
        sup.emit("restart", reason="hang")
    assert rotate(rd.events, 0) is not None and not rd.events.exists()
    with EventLog(rd.events, run_id="r", rank=-1) as sup:
        sup.emit("attempt_start", attempt=2)
    second = Collect()
    tracking.SupervisorFeed(second, rd).close()  # type: ignore[arg-type]
    assert [r["event"] for r in first.got] == ["restart"]
    assert [r["event"] for r in second.got] == ["hang", "restart", "attempt_start"]


def test_host_and_gpu_samples_and_degradation_alarms_become_rows() -> None:
    row = to_row(
        {
            "event": "metrics",
            "ts": 1.0,
            "host": {"cpu_pct": 40.0, "mem_used_bytes": 5e9, "load1": 1.5},
            "gpus": [{"gpu": 0, "util_pct": 97.0, "power_w": 300.5, "temp_c": 61}],
        }
    )
    assert row is not None and row.step is None  # shown at the current step
    assert row.scalars == {
        "system/cpu_pct": 40.0,
        "system/mem_used_bytes": 5e9,
        "system/load1": 1.5,
        "system/gpu0/util_pct": 97.0,
        "system/gpu0/power_w": 300.5,
        "system/gpu0/temp_c": 61.0,
    }
    alarm = to_row({"event": "alarm", "kind": "throughput_drop", "rank": 1, "change": -0.31})
    assert alarm is not None and alarm.alarm == "throughput_drop: rank 1 -31% vs its baseline"


def test_grpo_rewards_reach_the_trackers_with_each_functions_mean() -> None:
    step = {"event": "step", "step": 3, "loss": 0.0, "reward": 0.5, "kl": 0.01}
    step |= {"rewards/letters/mean": 0.25, "completions/clipped_ratio": 1.0, "tokens": 9}
    row = to_row(step)
    assert row is not None and row.step == 3
    assert row.scalars == {
        "train/loss": 0.0,
        "train/reward": 0.5,
        "train/kl": 0.01,
        "train/completions/clipped_ratio": 1.0,
        "train/rewards/letters/mean": 0.25,
    }
    held_out = {"event": "eval", "step": 3, "tag": "after", "reward": 0.75}
    row = to_row(held_out | {"rewards/letters/mean": 0.5, "samples": 4})
    assert row is not None
    assert row.scalars == {"eval/after/reward": 0.75, "eval/after/rewards/letters/mean": 0.5}


@pytest.mark.parametrize(
    "dropped,errors,warned",
    [(0, {"wandb": 0, "mlflow": 0}, False), (0, {"wandb": 2, "mlflow": 0}, True), (3, {}, True)],
)
def test_tracker_losses_are_reported_only_when_there_are_some(
    caplog: pytest.LogCaptureFixture, dropped: int, errors: dict[str, int], warned: bool
) -> None:
    from types import SimpleNamespace

    with caplog.at_level("WARNING", logger="shoestring.finetune"):
        tracking._log_losses(SimpleNamespace(dropped=dropped, errors=errors))  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records]
    assert bool(lines) == warned, lines
    if warned and errors:
        assert "'wandb': 2" in lines[0] and "mlflow" not in lines[0]
