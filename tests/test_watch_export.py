"""Degradation alarms, metric samples, the webhook and a real Prometheus server, on one
2-process run: throughput halves and the gradient all-reduce slows down mid-run."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest

from conftest import CLI, DIST, read_events

PROMETHEUS = shutil.which("prometheus")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Receiver(BaseHTTPRequestHandler):
    got: list[dict[str, Any]] = []

    def do_POST(self) -> None:  # noqa: N802
        Receiver.got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *a: object) -> None:
        pass


def prom_query(port: int, query: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return list(body["data"]["result"])


@pytest.mark.skipif(
    PROMETHEUS is None,
    reason="needs Debian's prometheus (apt-get install prometheus; .ci/run installs it)",
)
# Needs a quiet machine: the injected drop (3x) and delay (+200 ms a step) are smaller
# than the swings of a CI machine running two other test workers on 2 cores. In the two
# failing CI runs of 2026-12-06 the baselines were set while it was busiest (rank 1's
# communication 0.56 s a step against 0.03 s once it quieted), so the injected change
# never left the noise for three windows in a row; alone it passes (49 s). CI keeps the
# detector's unit tests (tests/test_degrade.py: windows, alarms, webhook, collector).
# Since then the baseline is the best level held (a slow start is forgotten); re-tried
# 2026-12-06 at load 3.5-4.4: 4 of 5 runs passed, 79-114 s each (too long for CI). The
# failure: rank 1's communication before the injection ranged 0.06-0.24 s a step, so a
# window with the injected +0.2 s was less than 0.1 s above the 0.141 s baseline (the old
# first-windows median on the same windows: 0.144 s, the same failure).
@pytest.mark.slow
def test_degradation_alarms_reach_log_webhook_and_prometheus(cli: CLI, tmp_path: Path) -> None:
    assert PROMETHEUS is not None
    exporter, web = free_port(), free_port()
    (tmp_path / "prom.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n  - job_name: shoestring\n    honor_labels: true\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{exporter}']}}]\n"
    )
    prom = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={tmp_path / 'prom.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    Receiver.got = []
    hook = HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    out = tmp_path / "run"
    # From step 100 on, every forward of both ranks takes 3x as long (throughput drops)
    # and rank 1's gradient all-reduces (2 buckets a step) complete 100 ms later.
    env = cli.env(SHOESTRING_FAULTS="step.forward@200:slow200,comm.ddp@200:delay100:rank1")
    cmd = [
        sys.executable,
        "-m",
        "shoestring",
        "run",
        "--nproc-per-node",
        "2",
        "--run-dir",
        str(out),
        "--job-id",
        "deg-1",
        "--window",
        "1",
        "--metrics-interval",
        "1",
        "--prometheus-port",
        str(exporter),
        "--alert-webhook",
        f"http://127.0.0.1:{hook.server_port}/hook",
        "--",
        sys.executable,
        "-m",
        "shoestring",
        "finetune",
        "--output_dir",
        str(out),
        *DIST,
        "--train.max_steps",
        "160",
        "--checkpoint.every_steps",
        "1000",
    ]
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict[str, list[dict[str, Any]]] = {}
    try:
        while job.poll() is None:
            time.sleep(1.0)
            try:
                for q in (
                    "shoestring_step",
                    "shoestring_process_resident_bytes",
                    "shoestring_tokens_per_second",
                    "shoestring_alarms_total",
                ):
                    res = prom_query(web, q)
                    if res:
                        seen[q] = res
            except OSError:
                continue  # Prometheus still starting
        _, err = job.communicate(timeout=300)
    finally:
        prom.terminate()
        prom.wait(timeout=30)
        hook.shutdown()
    assert job.returncode == 0, err[-3000:]

    ev = read_events(out)
    # (Alarms before step 100 are possible on a machine shared with other work: they
    # would be true alarms. The no-false-alarm property is tested with noisy windows in
    # test_degrade.py and by the healthy runs of test_watchdog.py.)
    # An alarm is raised once per episode: on a VM whose speed drifts, a throughput alarm
    # may already be open before step 100; the injected drop must then keep it open.
    alarms = [e for e in ev if e["event"] == "alarm"]
    kinds = {(a["kind"], a["rank"]) for a in alarms}
    assert ("throughput_drop", 0) in kinds and ("throughput_drop", 1) in kinds, alarms
    assert ("comm_degraded", 1) in kinds, alarms
    windows = [e for e in ev if e["event"] == "window"]
    t101 = next(e["ts"] for e in ev if e["event"] == "step" and e["step"] >= 101)
    for rank in (0, 1):
        drop = [a for a in alarms if a["kind"] == "throughput_drop" and a["rank"] == rank][-1]
        late = [w for w in windows if w["rank"] == rank and w["t0"] > drop["ts"]]
        late_after = [w for w in late if w["t0"] >= t101]
        assert late_after and all(
            w["tokens_per_s"] < 0.95 * drop["baseline"] for w in late_after
        )  # still below: the episode goes on
        assert min(w["tokens_per_s"] for w in late_after) < 0.6 * drop["baseline"]
    # Rank 1's communication episode (opened by the injected +2 x 100 ms per step, or
    # already open from drift, as in one CI run where it opened at step 92) stays open
    # through the injected delay: every later window is above the alarm's baseline.
    comm = [a for a in alarms if a["kind"] == "comm_degraded" and a["rank"] == 1][-1]
    comm_after = [w for w in windows if w["rank"] == 1 and w["t0"] >= max(t101, comm["ts"])]
    assert comm_after and all(w["comm_s_per_step"] > 1.10 * comm["baseline"] for w in comm_after)
    assert min(w["comm_s_per_step"] for w in comm_after) > comm["baseline"] + 0.1
    windows = [e for e in ev if e["event"] == "window"]
    assert {w["rank"] for w in windows} == {0, 1}
    assert all(w["steps"] >= 5 and w["tokens_per_s"] > 0 for w in windows)
    # Host metrics of both rank processes, sampled every second into the event log.
    samples = [e for e in ev if e["event"] == "metrics" and len(e["ranks"]) == 2]
    assert len(samples) >= 5
    assert all(r["rss_bytes"] > 50e6 for s in samples for r in s["ranks"].values())
    assert max(r.get("cpu_pct", 0) for s in samples for r in s["ranks"].values()) > 20

    # The same alarms, posted to the webhook with a Slack-compatible text line.
    posted = {(b["kind"], b.get("rank")) for b in Receiver.got}
    assert kinds <= posted, (kinds, posted)
    assert all(
        b["text"].startswith("shoestring deg-1: ") and b["job"] == "deg-1" for b in Receiver.got
    )

    # A real Prometheus server scraped the endpoint; its query API returns our series.
    assert {r["metric"]["rank"] for r in seen["shoestring_step"]} == {"0", "1"}
    assert all(r["metric"]["job"] == "deg-1" for r in seen["shoestring_step"])
    assert max(float(r["value"][1]) for r in seen["shoestring_step"]) > 0
    assert all(float(r["value"][1]) > 50e6 for r in seen["shoestring_process_resident_bytes"])
    assert seen.get("shoestring_tokens_per_second")
    assert {r["metric"]["kind"] for r in seen.get("shoestring_alarms_total", [])} >= {
        "throughput_drop"
    }
