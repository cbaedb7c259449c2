"""Kill-anywhere: random SIGKILLs (also inside checkpoint writes) end byte-identical."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import pytest

from chaos import run_with_chaos
from conftest import CLI, FAST, read_events, state_digest, wait_for_step
from shoestring import exitcodes
from shoestring.checkpoint.local import committed_steps


# Random kill points repeat what the suite's fixed ones check in CI (SIGKILL at a step, in
# a save, after a commit: test_resume_exact, test_qlora, test_data_e2e, test_preference_run);
# run it, with -m slow, for the moments nobody thought of (CI time).
@pytest.mark.slow
def test_random_sigkills_end_byte_identical(
    cli: CLI, tmp_path: Path, reference: dict[str, str]
) -> None:
    out = tmp_path / "run"
    args = [*FAST, "--checkpoint.every_steps", "2", "--checkpoint.keep", "2"]
    seed = int(os.environ.get("CHAOS_SEED", "1234"))
    modes = random.Random(seed + 1)

    def start(faults: str):  # each restart may use another writer mode (a resume-safe change)
        mode = modes.choice(["thread", "process", "off"])
        return cli.start(
            out, *args, "--checkpoint.async_mode", mode, env={"SHOESTRING_FAULTS": faults}
        )

    res = run_with_chaos(
        start, out, kills=int(os.environ.get("CHAOS_KILLS", "4")), rng=random.Random(seed)
    )
    assert res.kills >= 1
    # The last checkpoint at step 12 must be kept for the comparison.
    assert 12 in committed_steps(out / "checkpoints")
    assert state_digest(out, 12) == reference, res.attempts
    resumes = [e for e in read_events(out) if e["event"] == "resume"]
    assert resumes, "a run that was killed must have resumed at least once"


def test_second_signal_exits_at_once_previous_checkpoint_intact(
    cli: CLI, tmp_path: Path, reference: dict[str, str]
) -> None:
    out = tmp_path / "run"
    # The emergency save (2nd save) stalls before its manifest, like a hung disk.
    p = cli.start(out, *FAST, env={"SHOESTRING_FAULTS": "ckpt.before_manifest@2:hang"})
    wait_for_step(out, 5, p)
    p.send_signal(signal.SIGTERM)
    import time

    time.sleep(2.0)
    assert p.poll() is None  # stuck in the stalled save
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=20) == exitcodes.PREEMPTED_HARD
    assert committed_steps(out / "checkpoints") == [4]
    r = cli.run(out, *FAST)
    assert r.returncode == 0, r.stderr
    assert [e for e in read_events(out) if e["event"] == "resume"][-1]["from_step"] == 4
    assert state_digest(out, 12) == reference


@pytest.mark.slow  # unit tests in test_commit_protocol.py cover each corruption
def test_corrupt_newest_checkpoint_end_to_end(
    cli: CLI, tmp_path: Path, reference: dict[str, str]
) -> None:
    out = tmp_path / "run"
    # Killed right after the step-8 checkpoint commits (a kill at a step's end could come
    # before a slow background save of step 8 committed, and there would be none to corrupt).
    r = cli.run(out, *FAST, env={"SHOESTRING_FAULTS": "ckpt.after_rename@2:kill"})
    assert r.returncode == -9
    ck = out / "checkpoints" / "step-00000008" / "optimizer.safetensors"
    b = bytearray(ck.read_bytes())
    b[len(b) // 3] ^= 0x40
    ck.write_bytes(bytes(b))
    r = cli.run(out, *FAST)
    assert r.returncode == 0, r.stderr
    assert "invalid" in r.stderr and "falling back" in r.stderr
    ev = read_events(out)
    assert [e["step"] for e in ev if e["event"] == "checkpoint_invalid"] == [8]
    assert [e for e in ev if e["event"] == "resume"][-1]["from_step"] == 4
    assert state_digest(out, 12) == reference
