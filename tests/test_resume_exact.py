"""Bit-exact resume: N steps straight == K steps, kill, resume to N (dropout on)."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import CLI, FAST, read_events, state_digest, wait_for_step
from shoestring import exitcodes


# Every byte-equality test of the suite compares against the reference: a nondeterministic
# one fails them (CI time).
@pytest.mark.slow
def test_reference_is_deterministic(cli: CLI, tmp_path: Path, reference: dict[str, str]) -> None:
    # Guards the other tests: if two clean runs differed, "equal after resume" would mean nothing.
    r = cli.run(tmp_path / "again", *FAST)
    assert r.returncode == 0, r.stderr
    assert state_digest(tmp_path / "again", 12) == reference


# The process writer is also covered by tests/test_writers.py; CI runs the thread mode e2e.
@pytest.mark.parametrize(
    "mode",
    [
        "thread",
        pytest.param("process", marks=pytest.mark.slow),
        pytest.param("off", marks=pytest.mark.slow),
    ],
)
def test_sigkill_without_notice_then_resume_is_bit_exact(
    cli: CLI, tmp_path: Path, mode: str, reference: dict[str, str]
) -> None:
    # SIGKILL once a checkpoint is committed and a later step is done, whenever the writer
    # (the process writer is a fresh interpreter: spawn + import torch) got there; slower
    # steps (same numbers) leave it the time on a loaded machine.
    out = tmp_path / "run"
    args = [*FAST, "--checkpoint.async_mode", mode]
    p = cli.start(out, *args, env={"SHOESTRING_FAULTS": "step.forward@1:slow300"})
    committed, last = _kill_after_a_commit(out, p)
    assert p.wait(timeout=60) == -signal.SIGKILL
    assert not (out / "final").exists()
    r = cli.run(out, *args)
    assert r.returncode == 0, r.stderr
    (resume,) = [e for e in read_events(out) if e["event"] == "resume"]
    assert resume["from_step"] == committed and resume["steps_lost"] == last - committed
    assert state_digest(out, 12) == reference
    _rerun_loses_nothing(cli, out, args, reference)


def _rerun_loses_nothing(cli: CLI, out: Path, args: list[str], reference: dict[str, str]) -> None:
    """The same command again, on a finished run: it trains no step and changes nothing;
    ``--resume never`` refuses to write over its checkpoints."""
    r = cli.run(out, *args)
    assert r.returncode == 0, r.stderr
    starts = [e for e in read_events(out) if e["event"] == "run_start"]
    assert len(starts) == 3 and starts[-1]["step"] == 12
    assert not [e for e in read_events(out) if e["event"] == "step" and e["ts"] > starts[-1]["ts"]]
    assert state_digest(out, 12) == reference
    r = cli.run(out, *args, "--resume", "never")
    assert r.returncode == exitcodes.USAGE and "already has checkpoints" in r.stderr


def _kill_after_a_commit(out: Path, p: subprocess.Popen[str]) -> tuple[int, int]:
    """SIGKILL ``p`` at its first step after its first committed checkpoint; return the
    checkpoint's step and the last step logged."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        ev = read_events(out)
        commits = [e["step"] for e in ev if e["event"] == "checkpoint"]
        later = [
            e["step"] for e in ev if e["event"] == "step" and commits and e["step"] > commits[0]
        ]
        if later:
            p.kill()
            p.wait()
            ev = read_events(out)
            return commits[0], max(e["step"] for e in ev if e["event"] == "step")
        assert p.poll() is None, p.stdout.read() if p.stdout else ""
        time.sleep(0.05)
    p.kill()
    raise AssertionError("no checkpoint committed in time")


def test_sigterm_preempts_with_emergency_checkpoint(
    cli: CLI, tmp_path: Path, reference: dict[str, str]
) -> None:
    out = tmp_path / "run"
    p = cli.start(out, *FAST, "--checkpoint.every_steps", "0")
    wait_for_step(out, 5, p)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=120) == exitcodes.PREEMPTED
    ev = read_events(out)
    pre = [e for e in ev if e["event"] == "preempt"][-1]
    assert pre["saved"] and pre["reason"] == "SIGTERM"
    saved = [e for e in ev if e["event"] == "checkpoint"]
    assert saved and saved[-1]["reason"] == "emergency" and saved[-1]["step"] == pre["step"]
    r = cli.run(out, *FAST, "--checkpoint.every_steps", "0")
    assert r.returncode == 0, r.stderr
    resume = [e for e in read_events(out) if e["event"] == "resume"][-1]
    assert resume["from_step"] == pre["step"] and resume["steps_lost"] == 0
    d = state_digest(out, 12)
    assert d == reference


@pytest.mark.slow  # refusal: tests/test_early_errors.py; the new schedule: test_training_options
def test_changed_config_refuses_resume_but_max_steps_may_change(cli: CLI, tmp_path: Path) -> None:
    out = tmp_path / "run"
    # Killed right after the step-4 checkpoint commits (not at a step's end: a slow save
    # could still be in flight there).
    r = cli.run(out, *FAST, env={"SHOESTRING_FAULTS": "ckpt.after_rename@1:kill"})
    assert r.returncode == -signal.SIGKILL
    r = cli.run(out, *FAST, "--train.lr", "0.001")
    assert r.returncode == exitcodes.USAGE
    assert "config changed" in r.stderr and "train.lr: 0.002 -> 0.001" in r.stderr
    # Extending the run is declared safe.
    r = cli.run(out, *FAST, "--train.max_steps", "14")
    assert r.returncode == 0, r.stderr
    assert [e for e in read_events(out) if e["event"] == "resume"][-1]["from_step"] == 4
    assert (out / "checkpoints" / "step-00000014").is_dir()


@pytest.mark.slow  # bf16 autocast is the GPU path (gpu_check sigkill_resume); CPU runs fp32
def test_bf16_autocast_deterministic_run_resumes_bit_exact(
    cli: CLI, tmp_path: Path, reference: dict[str, str]
) -> None:
    """The GPU default path (bf16 autocast, train.deterministic) on the CPU: SIGKILL right
    after the step-4 checkpoint commits, resume from 4, and every byte of state equals an
    uninterrupted bf16 run's."""
    args = [*FAST, "--train.precision", "bf16", "--train.deterministic", "true"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert cli.run(straight, *args).returncode == 0
    r = cli.run(killed, *args, env={"SHOESTRING_FAULTS": "ckpt.after_rename@1:kill"})
    assert r.returncode == -signal.SIGKILL
    r = cli.run(killed, *args)
    assert r.returncode == 0, r.stderr
    assert [e["from_step"] for e in read_events(killed) if e["event"] == "resume"] == [4]
    assert state_digest(killed, 12) == state_digest(straight, 12)
    # autocast was in effect: bf16 matmuls train a different adapter than fp32
    assert state_digest(straight, 12)["adapter.safetensors"] != reference["adapter.safetensors"]
    start = next(e for e in read_events(straight) if e["event"] == "run_start")
    assert (start["precision"], start["deterministic"], start["train_device"]) == (
        "bf16",
        True,
        "cpu",
    )
