"""Degradation windows, alerts and the Prometheus collector, on hand-made snapshots
and a fake clock (no processes)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest

from shoestring.watch.alerts import Alerts, WebhookSink
from shoestring.watch.degrade import DegradationMonitor, DegradePolicy
from shoestring.watch.exporter import JobCollector, JobState

POLICY = DegradePolicy(window_s=60, consecutive=3, warmup_windows=1, baseline_windows=3)


class FakeRank:
    """Cumulative recorder totals of one rank, advanced one window at a time."""

    def __init__(self) -> None:
        self.t = {"steps": 0, "tokens": 0, "train_s": 0.0, "comm_s": 0.0}

    def advance(self, steps: int, step_s: float, comm_s: float, tokens: int = 512) -> None:
        self.t = {
            "steps": self.t["steps"] + steps,
            "tokens": self.t["tokens"] + steps * tokens,
            "train_s": self.t["train_s"] + steps * step_s,
            "comm_s": self.t["comm_s"] + steps * comm_s,
        }

    def snap(self, rank: int) -> dict[str, Any]:
        return {"rank": rank, "step": self.t["steps"], "totals": dict(self.t)}


def drive(
    windows: list[list[tuple[float, float]]],
    policy: DegradePolicy = POLICY,
) -> tuple[list[Any], list[dict[str, Any]]]:
    """``windows[i][r] = (step_s, comm_s)`` for rank r in window i; 100 steps per window."""
    ranks = [FakeRank() for _ in windows[0]]
    mon = DegradationMonitor(policy)
    mon.observe(0.0, {r: f.snap(r) for r, f in enumerate(ranks)})
    all_w, all_a = [], []
    for i, spec in enumerate(windows):
        for f, (step_s, comm_s) in zip(ranks, spec):
            f.advance(100, step_s, comm_s)
        w, a = mon.observe(100.0 * (i + 1), {r: f.snap(r) for r, f in enumerate(ranks)})
        all_w += w
        all_a += a
    return all_w, all_a


def test_steady_run_with_noise_raises_nothing() -> None:
    # +-4 % throughput noise and +-8 % communication noise, window to window.
    noise = [0.0, 0.04, -0.03, 0.02, -0.04, 0.03, 0.01, -0.02, 0.04, -0.01]
    spec = [[(0.1 * (1 + n), 0.01 * (1 + 2 * n))] * 2 for n in noise]
    windows, alarms = drive(spec)
    assert len(windows) == 2 * len(spec) and alarms == []


def test_communication_rise_alarms_after_three_windows_and_names_the_rank() -> None:
    base = [[(0.1, 0.010), (0.1, 0.010)]] * 4
    slow = [[(0.1, 0.010), (0.1, 0.0125)]] * 4  # rank 1: +25 % time in collectives
    _, alarms = drive(base + slow)
    (a,) = alarms
    assert a["kind"] == "comm_degraded" and a["rank"] == 1
    assert a["change"] == pytest.approx(0.25, abs=1e-6)
    assert "+25%" in a["message"]


def test_two_bad_windows_then_recovery_is_not_an_alarm() -> None:
    base = [[(0.1, 0.01)]] * 4
    _, alarms = drive(base + [[(0.12, 0.01)]] * 2 + [[(0.1, 0.01)]] * 3)
    assert alarms == []


def test_throughput_drop_alarms_once_until_it_recovers() -> None:
    base = [[(0.1, 0.01)]] * 4
    drop = [[(0.107, 0.01)]] * 5  # 6.5 % fewer tokens per second
    windows, alarms = drive(base + drop + [[(0.1, 0.01)]] * 2 + drop[:3])
    kinds = [a["kind"] for a in alarms]
    assert kinds == ["throughput_drop", "throughput_drop"]  # once per episode
    assert alarms[0]["change"] == pytest.approx(1 / 1.07 - 1, abs=1e-3)


def test_windows_with_few_steps_are_not_judged() -> None:
    mon = DegradationMonitor(POLICY)
    f = FakeRank()
    mon.observe(1.0, {0: f.snap(0)})
    f.advance(2, 0.1, 0.01)  # an eval or a long save filled the window
    w, a = mon.observe(100.0, {0: f.snap(0)})
    assert w == [] and a == []
    f.advance(3, 0.1, 0.01)  # ... so it stays open until it holds enough steps
    (w,), _ = mon.observe(101.0, {0: f.snap(0)})
    assert (w.t0, w.t1, w.steps) == (1.0, 101.0, 5)


def test_a_restarted_rank_gets_no_negative_window() -> None:
    mon = DegradationMonitor(POLICY)
    f = FakeRank()
    f.advance(500, 0.1, 0.01)
    mon.observe(1.0, {0: f.snap(0)})
    fresh = FakeRank()
    fresh.advance(100, 0.1, 0.01)
    w, _ = mon.observe(100.0, {0: fresh.snap(0)})
    assert w == []


class Receiver(BaseHTTPRequestHandler):
    got: list[dict[str, Any]] = []

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        Receiver.got.append(json.loads(body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *a: object) -> None:
        pass


def test_webhook_posts_slack_compatible_json_and_survives_a_dead_receiver() -> None:
    Receiver.got = []
    srv = HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    hook = WebhookSink(f"http://127.0.0.1:{srv.server_port}/alert", "job-7", "hostA")
    dead = WebhookSink("http://127.0.0.1:9/nothing", "job-7", "hostA", retries=2, backoff_s=0.01)
    alerts = Alerts([hook, dead])
    alerts("alarm", {"kind": "throughput_drop", "rank": 1, "message": "throughput -7%"})
    alerts.close()
    srv.shutdown()
    (body,) = Receiver.got
    assert body["text"] == "shoestring job-7: THROUGHPUT_DROP rank 1: throughput -7%"
    assert body["event"] == "alarm" and body["kind"] == "throughput_drop"
    assert body["rank"] == 1 and body["job"] == "job-7" and body["host"] == "hostA"
    assert hook.sent == 1 and dead.failed == 1


def test_collector_exposes_stable_names_with_job_host_rank_labels() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    st = JobState("job-7", "hostA")
    st.update(
        snaps={
            1: {
                "ts": 99.0,
                "step": 12,
                "phase": "train_step",
                "phase_start": 99.5,
                "stats": {"train_step": {"p50": 0.1, "p99": 0.2}},
                "open_collectives": [{"seq": 3}],
            }
        },
        windows=[{"rank": 1, "tokens_per_s": 5000.0, "comm_s_per_step": 0.01, "comm_share": 0.1}],
        metrics={
            "ranks": {"1": {"cpu_pct": 97.0, "rss_bytes": 123456789}},
            "gpus": [{"gpu": 0, "util_pct": 88, "mem_used_bytes": 10, "ranks": [1]}],
        },
    )
    st.alarm("throughput_drop", 1)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(JobCollector(st, clock=lambda: 100.0))  # type: ignore[arg-type]
    text = generate_latest(reg).decode()
    lab = 'host="hostA",job="job-7",rank="1"'
    for line in (
        f"shoestring_rank_up{{{lab}}} 1.0",
        f"shoestring_step{{{lab}}} 12.0",
        f"shoestring_tokens_per_second{{{lab}}} 5000.0",
        f"shoestring_process_resident_bytes{{{lab}}} 1.23456789e+08",
        f"shoestring_open_collectives{{{lab}}} 1.0",
        'shoestring_gpu_util_pct{gpu="0",host="hostA",job="job-7"} 88.0',
        'shoestring_alarms_total{host="hostA",job="job-7",kind="throughput_drop",rank="1"} 1.0',
    ):
        assert line in text, (line, text)
