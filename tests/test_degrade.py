"""Degradation windows, alerts and the Prometheus collector, on hand-made snapshots
and a fake clock (no processes)."""

from __future__ import annotations

import json
import random
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


def test_a_slow_start_is_forgotten_and_a_later_rise_alarms() -> None:
    # The machine is busy when the job starts (everything 2x slower for 6 windows), then
    # the job runs at its true speed; then rank 1's collectives take 30 % longer. A
    # baseline set once by the first windows would be 2x too slow to see that.
    slow = [[(0.2, 0.020)] * 2] * 6
    true = [[(0.1, 0.010)] * 2] * 6
    rise = [[(0.1, 0.010), (0.103, 0.013)]] * 4
    _, alarms = drive(slow + true + rise)
    assert [(a["kind"], a["rank"]) for a in alarms] == [("comm_degraded", 1)]
    (a,) = alarms
    assert a["baseline"] == pytest.approx(0.010) and a["change"] == pytest.approx(0.30, abs=1e-6)
    # The baseline was held by the first three windows at true speed (7-9), and the
    # record says so: window numbers and times, and the message names them.
    assert a["baseline_windows"] == [7, 9]
    assert (a["baseline_t0"], a["baseline_t1"]) == (600.0, 900.0)
    assert "windows 7-9" in a["message"] and "+30%" in a["message"]


def test_lucky_windows_do_not_lower_the_baseline() -> None:
    # Two unusually fast windows in a row (a neighbour paused) are not a level the rank
    # held: the baseline stays at 10 ms, so a steady 10.3 ms afterwards is no alarm. (The
    # best *median* of three windows would be 9 ms here, and 10.3 ms is +14 % of it.)
    steady = [[(0.1, 0.010)]] * 4
    lucky = [[(0.1, 0.009)]] * 2
    after = [[(0.1, 0.0103)]] * 8
    _, alarms = drive(steady + lucky + after)
    assert alarms == []


def test_steady_noisy_run_never_alarms_over_many_windows() -> None:
    # Window-to-window noise within about half of each margin: communication +-5 %
    # (margin 10 %), step time +-2 % (throughput margin 5 %), 400 windows (6.7 h of
    # one-minute windows), two ranks, several seeds, the default policy. The baseline
    # only improves, so it drifts to the lucky side of the noise; not so far that noise
    # alarms.
    for seed in range(5):
        rng = random.Random(seed)
        spec = [
            [(0.1 * (1 + rng.uniform(-0.02, 0.02)), 0.01 * (1 + rng.uniform(-0.05, 0.05)))] * 2
            for _ in range(400)
        ]
        windows, alarms = drive(spec, DegradePolicy())
        assert len(windows) == 800 and alarms == [], (seed, alarms)


def test_a_gradual_degradation_alarms_against_the_best_level_not_its_own_drift() -> None:
    # Communication creeps up 2 % a window. Each window is close to the last, but the
    # baseline only improves, so the alarm comes once the creep passes the 10 % margin
    # for three windows (creep windows 6, 7, 8) and measures it against the true level.
    base = [[(0.1, 0.010)]] * 6
    creep = [[(0.1, 0.010 * (1 + 0.02 * i))] for i in range(1, 21)]
    windows, alarms = drive(base + creep)
    (a,) = alarms
    assert a["kind"] == "comm_degraded" and a["baseline"] == pytest.approx(0.010)
    assert a["current"] == pytest.approx(0.0114)  # the median of creep windows 6-8
    assert a["baseline_windows"][1] <= 6  # held before the creep began


def test_a_new_process_starts_over_with_its_own_warm_up_and_baseline() -> None:
    mon = DegradationMonitor(POLICY)
    t = 0.0

    def window(f: FakeRank, step_s: float, comm_s: float) -> list[dict[str, Any]]:
        nonlocal t
        f.advance(100, step_s, comm_s)
        t += 100.0
        return mon.observe(t, {0: f.snap(0)})[1]

    old = FakeRank()
    mon.observe(t, {0: old.snap(0)})
    assert [a for _ in range(6) for a in window(old, 0.1, 0.010)] == []
    # Restarted (its step counter went back) on a node 1.5x slower, with a slow first
    # window: judged against the old process's baseline, every window would alarm.
    new = FakeRank()
    mon.observe(t + 1, {0: new.snap(0)})
    t += 1
    assert window(new, 0.45, 0.045) == []  # its warm-up
    assert [a for _ in range(6) for a in window(new, 0.15, 0.015)] == []
    # ... and its own baseline (its windows 2-4) catches its own slowdown.
    alarms = [a for _ in range(3) for a in window(new, 0.15, 0.0195)]
    assert [a["kind"] for a in alarms] == ["comm_degraded"]
    assert alarms[0]["baseline"] == pytest.approx(0.015) and alarms[0]["baseline_windows"] == [2, 4]


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
