"""Cloud notice sources against the fake metadata servers, over real HTTP on 127.0.0.1.

Protocol details (IMDSv2 tokens, GCP long polls and ETags, Azure headers, warm-up
and event filtering), the watcher's error handling, and provider detection.
The end-to-end runs (notice -> checkpoint -> exit 75 -> exact resume) are in
test_preempt_cloud_run.py.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from shoestring.config import ConfigError
from shoestring.preempt import NoticeWatcher, PreemptionFlag, cloud_watcher, detect_cloud
from shoestring.preempt.aws import AwsSpotSource
from shoestring.preempt.azure import AzureScheduledEventsSource
from shoestring.preempt.cloud import make_source
from shoestring.preempt.fakes import FakeMetadataServer
from shoestring.preempt.gcp import GcpPreemptedSource
from shoestring.train.config import PreemptConfig

REPO = Path(__file__).resolve().parents[1]


def raw(url: str, headers: dict[str, str] | None = None, method: str = "GET") -> int:
    """Status of a plain request (no client logic): what the fake enforces."""
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code


class Events:
    """Collects ``emit(...)`` calls like an EventLog would receive them."""

    def __init__(self) -> None:
        self.recs: list[dict[str, Any]] = []

    def __call__(self, event: str, **fields: Any) -> None:
        self.recs.append({"event": event, **fields})


def wait_until(cond: Any, timeout: float = 5.0) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("condition not met in time")
        time.sleep(0.002)
    return time.monotonic() - t0


# ----------------------------------------------------------------------------- AWS


def test_aws_imdsv2_token_is_enforced_and_notice_parsed() -> None:
    with FakeMetadataServer("aws") as fake:
        action_url = fake.url + "/latest/meta-data/spot/instance-action"
        assert raw(action_url) == 401  # IMDSv2 only: no token, no answer
        assert raw(fake.url + "/latest/api/token", method="PUT") == 400  # TTL header required
        src = AwsSpotSource(fake.url, interval_s=0.01)
        assert src.poll() is None  # 404: no interruption scheduled
        t = fake.preempt_now()
        n = src.poll()
        assert n is not None and n.preempting and n.provider == "aws"
        assert n.action == "terminate" and n.reason.startswith("aws spot interruption (action=")
        assert n.deadline is not None and abs(n.deadline - (t + 120)) < 1.5  # whole seconds
        assert ("PUT", "/latest/api/token", 200) in fake.requests


def test_aws_token_refreshed_before_expiry_and_after_401() -> None:
    now = [0.0]
    with FakeMetadataServer("aws") as fake:
        src = AwsSpotSource(fake.url, token_ttl_s=100, clock=lambda: now[0])
        puts = lambda: sum(1 for m, p, s in fake.requests if m == "PUT")  # noqa: E731
        src.poll()
        src.poll()
        assert puts() == 1  # the token is reused
        now[0] = 81.0  # past 80 % of the TTL: refreshed before the server would refuse it
        src.poll()
        assert puts() == 2
        fake.expire_tokens()  # e.g. IMDS restarted: one 401, then a new token
        assert src.poll() is None
        assert puts() == 3 and any(s == 401 for _, _, s in fake.requests)


def test_aws_rebalance_is_an_early_warning_only() -> None:
    flag, events = PreemptionFlag(), Events()
    with FakeMetadataServer("aws") as fake:
        with NoticeWatcher(AwsSpotSource(fake.url, interval_s=0.01), flag, events):
            fake.rebalance_now()
            wait_until(lambda: events.recs)
            time.sleep(0.05)
            assert not flag.is_set() and len(events.recs) == 1  # logged once, not acted on
            assert events.recs[0]["action"] == "rebalance" and not events.recs[0]["preempting"]
            fake.preempt_now()
            wait_until(flag.is_set)
    assert [e["action"] for e in events.recs] == ["rebalance", "terminate"]
    assert flag.reason == events.recs[1]["reason"]


# ----------------------------------------------------------------------------- GCP


def test_gcp_header_required_and_long_poll_wakes_on_flip() -> None:
    with FakeMetadataServer("gcp") as fake:
        url = fake.url + "/computeMetadata/v1/instance/preempted"
        assert raw(url) == 403
        assert raw(url, {"Metadata-Flavor": "Google"}) == 200
        src = GcpPreemptedSource(fake.url, wait_s=30)
        assert src.poll() is None and src.interval_s == 0  # got an ETag: long polls from now
        got: list[Any] = []
        t = threading.Thread(target=lambda: got.append(src.poll()))
        t.start()
        time.sleep(0.2)
        assert not got  # the long poll is holding
        flipped = fake.preempt_now()
        t.join(5)
        assert got and got[0] is not None and got[0].reason.startswith("gcp preemption")
        assert time.time() - flipped < 1.0  # woke on the flip, not at timeout_sec


def test_gcp_flip_between_polls_is_not_missed() -> None:
    with FakeMetadataServer("gcp") as fake:
        src = GcpPreemptedSource(fake.url, wait_s=30, timeout_s=10)
        assert src.poll() is None
        fake.preempt_now()  # no request in flight: only last_etag can reveal the change
        t0 = time.monotonic()
        n = src.poll()
        assert n is not None and time.monotonic() - t0 < 5.0  # not the 30 s long poll
        assert any("last_etag=" in p for _, p, _ in fake.requests)


# ----------------------------------------------------------------------------- Azure


def test_azure_headers_required_and_only_this_vms_events_count() -> None:
    with FakeMetadataServer("azure", vm_name="vm-a") as fake:
        url = fake.url + "/metadata/scheduledevents"
        assert raw(url + "?api-version=2020-07-01") == 400  # no Metadata: true
        assert raw(url, {"Metadata": "true"}) == 400  # no api-version
        src = AzureScheduledEventsSource(fake.url)
        assert src.poll() is None
        fake.preempt_now(resources=["vm-b"])  # a neighbour in the scale set
        assert src.poll() is None
        fake.preempt_now(event_type="Reboot")  # ours, but a warning only
        fake.preempt_now(event_type="Terminate")
        n = src.poll()  # both in one document: the stop comes first
        assert n is not None and n.preempting and n.action == "Terminate"
        w = src.poll()  # the document is read again for the warning
        assert w is not None and not w.preempting and w.action == "Reboot"
        assert src.poll() is None  # same DocumentIncarnation: nothing new
        assert n.deadline is not None and n.deadline > time.time() + 25  # NotBefore ~ +30 s


def test_azure_slow_first_call_warms_up_in_the_background() -> None:
    flag = PreemptionFlag()
    with FakeMetadataServer("azure", first_call_delay_s=0.5) as fake:
        src = AzureScheduledEventsSource(fake.url, interval_s=0.01)
        t0 = time.monotonic()
        with NoticeWatcher(src, flag):
            assert time.monotonic() - t0 < 0.2  # training does not wait for the warm-up
            fake.preempt_now()
            wait_until(flag.is_set)
        assert time.monotonic() - t0 >= 0.5
    assert flag.reason.startswith("azure scheduled event (EventType=Preempt")


# ----------------------------------------------------------------------------- watcher


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_watcher_survives_an_outage_and_warns_once(
    provider: str, caplog: pytest.LogCaptureFixture
) -> None:
    flag, events = PreemptionFlag(), Events()
    with FakeMetadataServer(provider) as fake:
        fake.fail_next(4, 503)
        with caplog.at_level(logging.DEBUG, "shoestring.preempt"):
            with NoticeWatcher(
                make_source(provider, fake.url, 0.01), flag, events, max_backoff_s=0.05
            ) as w:
                wait_until(lambda: w.errors >= 1)
                fake.preempt_now()
                wait_until(flag.is_set)
    assert flag.reason.startswith(provider) and [e["event"] for e in events.recs] == ["notice"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "retrying" in r.msg]
    assert len(warnings) == 1


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_timed_notice_is_seen_within_one_poll(provider: str) -> None:
    flag, events = PreemptionFlag(), Events()
    with FakeMetadataServer(provider, notice_after_s=0.2) as fake:
        with NoticeWatcher(make_source(provider, fake.url, 0.02), flag, events):
            wait_until(flag.is_set)
    assert fake.noticed_at is not None and flag.set_at is not None
    assert 0 <= flag.set_at - fake.noticed_at < 0.2  # GCP: the long poll wakes at the flip
    assert events.recs[0]["deadline_in_s"] > 25  # AWS 120 s, GCP and Azure 30 s


def test_watcher_without_a_server_never_raises_and_stops_promptly() -> None:
    with FakeMetadataServer("aws") as fake:
        url = fake.url  # closed below: connection refused from now on
    flag = PreemptionFlag()
    with NoticeWatcher(make_source("aws", url, 0.01), flag, max_backoff_s=0.05) as w:
        wait_until(lambda: w.errors >= 3)
    assert not flag.is_set() and w._thread is not None and not w._thread.is_alive()


def test_watcher_exit_does_not_wait_for_a_long_poll() -> None:
    with FakeMetadataServer("gcp") as fake:
        w = NoticeWatcher(GcpPreemptedSource(fake.url, wait_s=30), PreemptionFlag())
        with w:
            wait_until(lambda: len(fake.requests) >= 1)
            time.sleep(0.1)  # now inside the 30 s long poll
            t0 = time.monotonic()
        assert time.monotonic() - t0 < 1.0


# ----------------------------------------------------------------------------- selection


@pytest.mark.parametrize(
    "files,expected",
    [
        ({"sys_vendor": "Amazon EC2", "product_name": "g5.xlarge"}, "aws"),
        ({"sys_vendor": "Xen", "bios_version": "4.11.amazon"}, "aws"),
        ({"sys_vendor": "Google", "product_name": "Google Compute Engine"}, "gcp"),
        (
            {
                "sys_vendor": "Microsoft Corporation",
                "product_name": "Virtual Machine",
                "chassis_asset_tag": "7783-7084-3265-9085-8269-3286-77",
            },
            "azure",
        ),
        ({"sys_vendor": "Microsoft Corporation", "chassis_asset_tag": "None"}, None),  # Hyper-V
        ({"sys_vendor": "Dell Inc."}, None),
        ({}, None),  # no DMI at all (containers, ARM boards)
    ],
)
def test_detect_cloud_from_dmi(tmp_path: Path, files: dict[str, str], expected: str | None) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text + "\n")
    assert detect_cloud(tmp_path, tmp_path / "no-hypervisor-uuid") == expected


def test_cloud_watcher_selection(tmp_path: Path) -> None:
    flag = PreemptionFlag()
    (tmp_path / "sys_vendor").write_text("Amazon EC2\n")

    def w(**kw: Any) -> object:
        local_rank = kw.pop("local_rank", 0)
        return cloud_watcher(PreemptConfig(**kw), flag, local_rank=local_rank, dmi_dir=tmp_path)

    assert isinstance(w(cloud="none"), contextlib.nullcontext)
    assert isinstance(w(cloud="auto"), NoticeWatcher)  # detected: aws
    assert isinstance(w(cloud="gcp", metadata_url="http://127.0.0.1:1"), NoticeWatcher)
    assert isinstance(w(cloud="aws", local_rank=1), contextlib.nullcontext)  # one per node
    assert isinstance(
        cloud_watcher(PreemptConfig(), flag, dmi_dir=tmp_path / "none"), contextlib.nullcontext
    )
    with pytest.raises(ConfigError, match="must name the provider"):
        w(cloud="auto", metadata_url="http://127.0.0.1:1")


def test_fake_server_cli_rehearsal() -> None:
    """``python -m shoestring.preempt.fakes aws --notice-after S`` serves a notice."""
    p = subprocess.Popen(
        [sys.executable, "-m", "shoestring.preempt.fakes", "aws", "--notice-after", "0.5"],
        stdout=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
        env={"PYTHONPATH": str(REPO / "src")},
    )
    try:
        assert p.stdout is not None
        first = p.stdout.readline()
        url = first.split(" at ")[1].strip()
        assert "--preempt.metadata_url " + url in p.stdout.readline()
        src, got = AwsSpotSource(url), []
        wait_until(lambda: got.append(src.poll()) or got[-1] is not None, timeout=10)
        assert got[-1].action == "terminate" and got[-1].deadline is not None
    finally:
        p.terminate()
        p.wait(5)
