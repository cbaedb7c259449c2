"""Credentials stay out of everything a run writes: ``config.yaml``, checkpoints, the
event log, the supervisor's records, hang verdicts, log lines. The live values are
still the ones used to connect (the checkpoints reach the store, the webhook is tried)."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CLI, FAST, read_events
from shoestring.config import to_flat
from shoestring.events import EventLog
from shoestring.secrets import RedactingFilter, redact, redact_text, redact_url, redact_webhook
from shoestring.train.config import FinetuneConfig
from shoestring.train.resume import check_compatible
from shoestring.watch.alerts import WebhookSink

TOKEN = "PLANTEDsecretTOKEN42"


@pytest.mark.parametrize(
    "url,want",
    [
        ("s3://bucket/prefix", "s3://bucket/prefix"),
        ("/plain/path", "/plain/path"),
        (
            f"https://b.s3.amazonaws.com/k?X-Amz-Credential=AK%2F1&X-Amz-Signature={TOKEN}&x=1",
            "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&x=1",
        ),
        (
            f"https://a.blob.core.windows.net/c?sv=2022&sig={TOKEN}",
            "https://a.blob.core.windows.net/c?sv=2022&sig=***",
        ),
        (
            f"https://storage.googleapis.com/b/o?GoogleAccessId=me&Signature={TOKEN}",
            "https://storage.googleapis.com/b/o?GoogleAccessId=***&Signature=***",
        ),
        (f"sftp://bob:{TOKEN}@host:22/ckpt", "sftp://bob:***@host:22/ckpt"),
        ("sftp://bob@host/ckpt", "sftp://bob@host/ckpt"),
        ("https://git@github.com/o/r", "https://git@github.com/o/r"),
        (f"https://ghp_{TOKEN}@github.com/o/r.git", "https://***@github.com/o/r.git"),
        (f"https://hf_{TOKEN}@huggingface.co/o/m", "https://***@huggingface.co/o/m"),
        (f"https://hooks.slack.com/services/T0/B0/{TOKEN}", "https://hooks.slack.com/***"),
        (f"https://discord.com/api/webhooks/1/{TOKEN}", "https://discord.com/***"),
        (f"http://127.0.0.1:9/my-hook/{TOKEN}", "http://127.0.0.1:9/***"),
        (
            f"https://x.org/cb#access_token={TOKEN}&state=1",
            "https://x.org/cb#access_token=***&state=1",
        ),
    ],
)
def test_redact_url(url: str, want: str) -> None:
    assert redact_url(url) == want
    assert redact_url(want) == want  # idempotent: stored forms compare equal


def test_redact_finds_urls_in_text_and_structures() -> None:
    line = f"upload to 's3://b/p?token={TOKEN}' failed (https://u:{TOKEN}@h/x)"
    assert TOKEN not in redact_text(line)
    assert "s3://b/p?token=***" in redact_text(line)
    hook = f"http://10.0.0.1/services/{TOKEN}"  # no 'hook' in the path: known by value
    assert TOKEN in redact_text(hook) and redact_text(hook, known=[hook]) == redact_webhook(hook)
    doc = {"argv": ["--checkpoint.storage", f"file:///s?sig={TOKEN}"], "n": 3, "ok": None}
    assert TOKEN not in repr(redact(doc)) and redact(doc)["n"] == 3
    assert doc["argv"][1].endswith(TOKEN)  # a copy: the live value is untouched


def test_event_log_and_trackers_get_redacted_records(tmp_path: Path) -> None:
    seen: list[dict[str, object]] = []
    with EventLog(tmp_path / "events.jsonl", run_id="r") as ev:
        ev.add_listener(seen.append)
        ev.emit("checkpoint", storage=f"s3://b/p?X-Amz-Security-Token={TOKEN}", step=1)
    assert TOKEN not in (tmp_path / "events.jsonl").read_text()
    assert seen and TOKEN not in repr(seen)


def test_webhook_failure_names_the_host_only(caplog: pytest.LogCaptureFixture) -> None:
    port = _closed_port()
    url = f"http://127.0.0.1:{port}/services/T0/B0/{TOKEN}"
    sink = WebhookSink(url, "job", "host", retries=1, timeout_s=2)
    with caplog.at_level(logging.WARNING, logger="shoestring.alerts"):
        sink.send("straggler", {"rank": 1, "message": "slow"})
        sink.close()
        sink._thread.join(timeout=10)
    assert sink.failed == 1
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert f"127.0.0.1:{port}/***" in text and TOKEN not in text


def test_logging_filter_redacts_messages() -> None:
    rec = logging.LogRecord("x", logging.INFO, "f", 1, "store %s", (f"s3://b?sig={TOKEN}",), None)
    assert RedactingFilter().filter(rec) and TOKEN not in rec.getMessage()


def test_resume_compares_redacted_config() -> None:
    # A checkpoint stores the config redacted; the live config has the credential. A
    # credential-bearing data source (resume-relevant) must not read as a config change.
    live = FinetuneConfig()
    live.data.train = [f"https://h/data.jsonl?sig={TOKEN}"]  # type: ignore[list-item]
    saved = redact(to_flat(live))
    assert TOKEN not in repr(saved)
    check_compatible(saved, live, "step-4")


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


@pytest.mark.e2e
def test_no_planted_secret_in_any_file_or_log_of_a_supervised_run(cli: CLI, tmp_path: Path) -> None:
    """``shoestring run`` with a webhook whose path is its token (the port is closed, so
    the post fails and is logged) over ``finetune`` publishing to a storage URL with a
    signature; a hang of step 6 makes a verdict, an alarm and a restart. Then no file
    under the run directory, nor the captured output, contains either token."""
    out, store = tmp_path / "run", tmp_path / "store"
    hook = f"http://127.0.0.1:{_closed_port()}/services/T0/B0/{TOKEN}"
    # A storage URL with a query string is refused (test above) and a local store takes
    # no password: the token is planted in the webhook; the store is searched too.
    storage = f"file://{store}"
    cmd = [
        *(sys.executable, "-m", "shoestring", "run", "--max-restarts", "1"),
        *("--run-dir", str(out), "--alert-webhook", hook, "--hang-floor", "2"),
        *("--", sys.executable, "-m", "shoestring", "finetune", "--output_dir", str(out)),
        *FAST,
        *("--checkpoint.storage", storage, "--train.max_steps", "8"),
    ]
    env = cli.env(SHOESTRING_FAULTS="step.end@6:hang:once")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ev = read_events(out)
    assert [e["reason"] for e in ev if e["event"] == "restart"] == ["hang"]
    # The live values were used: checkpoints reached the store, the webhook was tried.
    assert any(p.name == "manifest.json" for p in tmp_path.glob("store*/step-*/*"))
    assert "alert webhook http://127.0.0.1:" in r.stderr and "failed after" in r.stderr
    leaks = [
        f"stdout/stderr: {s[max(s.find(TOKEN) - 80, 0) :][:160]!r}"
        for s in (r.stdout, r.stderr)
        if TOKEN in s
    ]
    for p in sorted([*out.rglob("*"), *store.rglob("*")]):
        if TOKEN in p.name:
            leaks.append(f"name: {p}")
        if p.is_file() and not p.is_symlink():
            data = p.read_bytes()
            at = data.find(TOKEN.encode())
            if at >= 0:
                leaks.append(f"{p}: {data[max(at - 80, 0) : at + 40]!r}")
    assert not leaks, "\n".join(leaks)


def test_an_exception_raised_in_a_thread_is_printed_redacted() -> None:
    """Python's own thread hook prints an exception raised in a thread (a tracker's, the
    checkpoint uploader's) straight to stderr, URL and all: the CLI's hook redacts it."""
    code = (
        "import sys, threading\n"
        "from shoestring import cli\n"
        "cli.main(['--version'])  # what every verb starts with: the CLI's hooks\n"
        "def boom(): raise OSError('cannot reach s3://b/p?X-Amz-Signature=' + sys.argv[1])\n"
        "t = threading.Thread(target=boom, name='up'); t.start(); t.join()\n"
    )
    r = subprocess.run([sys.executable, "-c", code, TOKEN], capture_output=True, text=True)
    assert "Exception in thread up:" in r.stderr and "X-Amz-Signature=***" in r.stderr
    assert TOKEN not in r.stderr and "OSError" in r.stderr


@pytest.mark.parametrize("key", ["checkpoint.storage", "data.cache_storage"])
def test_a_storage_url_with_a_query_string_is_refused_before_anything_runs(
    key: str, tmp_path: Path
) -> None:
    """fsspec keeps ``?…`` in the path, so every object stored would carry the signature
    in its name (a bucket listing shows it): refused at the start, the value redacted."""
    out = tmp_path / "run"
    url = f"file://{tmp_path / 'store'}?X-Amz-Signature={TOKEN}"
    cmd = [sys.executable, "-m", "shoestring", "finetune", "--output_dir", str(out)]
    r = subprocess.run([*cmd, f"--{key}", url], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"'{key}' has a query string" in r.stderr and TOKEN not in r.stderr
    assert not out.exists() and not list(tmp_path.glob("store*"))


def test_webhook_from_the_environment() -> None:
    from shoestring.supervise.config import RunConfig
    from shoestring.supervise.supervisor import SupervisorConfig

    url = f"https://hooks.slack.com/services/{TOKEN}"
    env = {"SHOESTRING_ALERT_WEBHOOK": url}
    assert SupervisorConfig.from_run(RunConfig(), env).webhook == url
    assert SupervisorConfig.from_run(RunConfig(alert_webhook="http://a/h"), env).webhook == (
        "http://a/h"
    )
    assert SupervisorConfig.from_run(RunConfig(), {}).webhook is None
