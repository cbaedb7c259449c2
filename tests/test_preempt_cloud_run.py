"""Cloud notices during a real run, one per provider, back to back.

One training job (the FAST run, 12 steps) is preempted by an AWS, then a GCP, then an
Azure fake metadata server, each flipping at a random (seeded) moment one or two steps
into the attempt. Every attempt must commit its checkpoint within the provider's deadline
and exit 75; every resume must start at exactly the committed step (no optimizer step
lost); the last attempt finishes, and its final state must be byte-identical to an
undisturbed run. CI runs the chain with GCP alone (the shortest deadline, 30 s): each
provider's watcher (its headers, tokens, long polls and notice shapes) is tested against
its fake server in tests/test_preempt_cloud.py, and the rest of the path is the same.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CLI, DIST, FAST, read_events, run_job, sha256, state_digest, wait_for_step
from shoestring import exitcodes
from shoestring.preempt.fakes import GRACE_S, FakeMetadataServer

PROVIDERS = ("aws", "gcp", "azure")


@pytest.mark.parametrize(
    "providers", [("gcp",), pytest.param(PROVIDERS, marks=pytest.mark.slow)], ids=["gcp", "all"]
)
def test_each_provider_notice_commits_in_time_and_resume_is_exact(
    cli: CLI, tmp_path: Path, reference: dict[str, str], providers: tuple[str, ...]
) -> None:
    rng = random.Random(20261203)  # seeded: a failure replays the same moments
    out = tmp_path / "run"
    resumed_from = 0
    for provider in providers:
        args = [*FAST, "--preempt.cloud", provider, "--preempt.poll_s", "0.05"]
        notice_after_step = resumed_from + rng.randint(1, 2 if provider == "aws" else 1)
        jitter_s = rng.uniform(0.0, 0.06)  # somewhere inside the next step
        with FakeMetadataServer(provider) as fake:
            p = cli.start(out, *args, "--preempt.metadata_url", fake.url)
            wait_for_step(out, notice_after_step, p)
            time.sleep(jitter_s)
            fake.preempt_now()
            try:  # the provider's deadline, enforced: past it the machine would be gone
                code = p.wait(timeout=GRACE_S[provider])
            except subprocess.TimeoutExpired:
                p.kill()
                raise AssertionError(f"{provider}: no exit within the deadline") from None
            log = p.stdout.read() if p.stdout else ""
            assert code == exitcodes.PREEMPTED, f"{provider}: exit {code}\n{log[-3000:]}"
        noticed_at = fake.noticed_at
        assert noticed_at is not None
        ev = read_events(out)
        if resumed_from:  # this attempt started exactly where the last one committed
            resume = [e for e in ev if e["event"] == "resume"][-1]
            assert resume["from_step"] == resumed_from and resume["steps_lost"] == 0
        attempt = ev[max(i for i, e in enumerate(ev) if e["event"] == "run_start") :]
        notice = [e for e in attempt if e["event"] == "notice"]
        pre = [e for e in attempt if e["event"] == "preempt"][-1]
        ckpt = [e for e in attempt if e["event"] == "checkpoint"][-1]
        assert len(notice) == 1 and notice[0]["provider"] == provider, notice
        assert notice[0]["preempting"] and pre["saved"] and pre["reason"] == notice[0]["reason"]
        assert pre["reason"].startswith(provider + " ")
        # The committed checkpoint is the stopping step: nothing trained after it is lost.
        stopped = pre["step"]
        assert notice_after_step <= stopped < 12 and ckpt["step"] == stopped, (provider, stopped)
        assert max(e["step"] for e in attempt if e["event"] == "step") == stopped
        # Committed within the deadline, measured from the moment the fake flipped
        # (so polling latency counts), and before the deadline the notice announced.
        flip_to_commit_s = pre["ts"] - noticed_at
        assert 0 < flip_to_commit_s < GRACE_S[provider]
        assert notice[0]["deadline"] > pre["ts"]
        assert pre["notice_to_commit_ms"] / 1e3 <= flip_to_commit_s + 0.01
        print(
            f"{provider}: notice after step {notice_after_step} (+{jitter_s * 1e3:.0f} ms), "
            f"stopped at {stopped}, flip->commit {flip_to_commit_s * 1e3:.0f} ms "
            f"(flag->commit {pre['notice_to_commit_ms']:.0f} ms, save {pre['save_ms']:.0f} ms)"
        )
        resumed_from = stopped

    # The next machine's metadata service has no notice for us: resume and finish.
    with FakeMetadataServer("azure") as quiet:
        r = cli.run(out, *FAST, "--preempt.cloud", "azure", "--preempt.metadata_url", quiet.url)
    assert r.returncode == 0, r.stderr[-3000:]
    ev = read_events(out)
    resume = [e for e in ev if e["event"] == "resume"][-1]
    assert resume["from_step"] == resumed_from and resume["steps_lost"] == 0
    assert len([e for e in ev if e["event"] == "notice"]) == len(providers)
    assert state_digest(out, 12) == reference


@pytest.mark.slow
def test_notice_seen_by_one_rank_stops_all_ranks_at_one_step(
    cli: CLI, tmp_path: Path, ddp_ref: Path
) -> None:
    """Two ranks, one watcher (local rank 0): the per-step all-reduce of the flag stops
    both after the same step, they save together, and the resume is exact."""
    out = tmp_path / "run"
    with FakeMetadataServer("gcp") as fake:
        cmd = [
            sys.executable,
            "-m",
            "shoestring",
            "run",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "0",
            "--run-dir",
            str(out),
            "--",
            sys.executable,
            "-m",
            "shoestring",
            "finetune",
            "--output_dir",
            str(out),
            *DIST,
            "--preempt.cloud",
            "gcp",
            "--preempt.metadata_url",
            fake.url,
        ]
        p = subprocess.Popen(
            cmd, env=cli.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        wait_for_step(out, 5, p)
        fake.preempt_now()
        code = p.wait(timeout=GRACE_S["gcp"])
        log = p.stdout.read() if p.stdout else ""
    # torchrun reports a worker's 75 as its own failure; the events tell what happened.
    assert code != 0, log[-3000:]
    rank0, rank1 = read_events(out), read_events(out / "ranks" / "rank1")
    pre0 = [e for e in rank0 if e["event"] == "preempt"][-1]
    pre1 = [e for e in rank1 if e["event"] == "preempt"][-1]
    assert pre0["reason"].startswith("gcp ") and pre1["reason"] == "peer"
    assert pre0["step"] == pre1["step"] and pre0["saved"] and pre1["saved"]
    assert [e["provider"] for e in rank0 if e["event"] == "notice"] == ["gcp"]
    assert not [e for e in rank1 if e["event"] == "notice"]  # one watcher per node
    r = run_job(cli, out, 2, *DIST, "--preempt.cloud", "none")
    assert r.returncode == 0, r.stderr[-3000:]
    resume = [e for e in read_events(out) if e["event"] == "resume"][-1]
    assert resume["from_step"] == pre0["step"] and resume["steps_lost"] == 0
    assert sha256(out / "final" / "adapter_model.safetensors") == sha256(
        ddp_ref / "final" / "adapter_model.safetensors"
    )
