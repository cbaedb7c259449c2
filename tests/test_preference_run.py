"""Preference tuning end to end through the CLI: a DPO run killed with SIGKILL and rerun
ends byte-identical to an uninterrupted one (its precomputed reference log-probs live in
the data cache, verified on open); the synthetic preference task is learned."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import CLI, FAST, read_events, state_digest
from shoestring.train.reflogps import MANIFEST, VALUES, cached_reference


def _pairs_file(path: Path, n: int = 8) -> Path:
    """``n`` reversal pairs (chosen: reversed word; rejected: the word itself)."""
    rng = random.Random(7)
    lines = []
    for _ in range(n):
        w = "".join(rng.sample("abcdefghijklmnopqrstuvwxyz", rng.randint(3, 6)))
        row = {"prompt": f"reverse: {w} =", "chosen": f" {w[::-1]}", "rejected": f" {w}"}
        lines.append(json.dumps(row) + "\n")
    path.write_text("".join(lines))
    return path


#: FAST, shorter: 6 steps of 2 pairs, checkpoints at 2, 4, 6.
SHORT = [
    *FAST,
    "--train.max_steps",
    "6",
    "--train.batch_size",
    "2",
    "--checkpoint.every_steps",
    "2",
]


def _args(data: Path) -> list[str]:
    return [
        *SHORT,
        "--train.objective",
        "dpo",
        "--dpo.precompute_ref",
        "--dpo.beta",
        "0.5",
        "--data.train",
        str(data),
    ]


def _kill_after_a_commit(out: Path, p: subprocess.Popen[str]) -> int:
    """SIGKILL ``p`` at a step after its first committed checkpoint; that checkpoint's step."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        ev = read_events(out)
        commits = [e["step"] for e in ev if e["event"] == "checkpoint"]
        if commits and any(e["event"] == "step" and e["step"] > commits[0] for e in ev):
            p.kill()
            p.wait()
            return commits[0]
        assert p.poll() is None, p.stdout.read() if p.stdout else ""
        time.sleep(0.05)
    p.kill()
    raise AssertionError("no checkpoint committed in time")


def test_dpo_sigkill_then_rerun_is_byte_identical(cli: CLI, tmp_path: Path) -> None:
    data = _pairs_file(tmp_path / "prefs.jsonl")
    straight = tmp_path / "straight"
    r = cli.run(straight, *_args(data))
    assert r.returncode == 0, r.stderr
    ev = read_events(straight)
    steps = [e for e in ev if e["event"] == "step"]
    assert all("rewards/accuracies" in e and "rewards/margins" in e for e in steps)
    assert steps[-1]["rewards/chosen"] != 0.0  # the policy left its reference
    (summary,) = [e for e in ev if e["event"] == "data"]
    ref_dir = cli.cache / "data" / summary["reference_logps"]
    assert (ref_dir / MANIFEST).is_file() and (ref_dir / VALUES).is_file()

    out = tmp_path / "killed"
    p = cli.start(out, *_args(data), env={"SHOESTRING_FAULTS": "step.forward@1:slow300"})
    committed = _kill_after_a_commit(out, p)
    assert p.returncode == -signal.SIGKILL and not (out / "final").exists()
    r = cli.run(out, *_args(data))
    assert r.returncode == 0, r.stderr
    (resume,) = [e for e in read_events(out) if e["event"] == "resume"]
    assert resume["from_step"] == committed
    assert state_digest(out, 4) == state_digest(straight, 4)


def test_reference_cache_is_verified_and_recomputed_when_torn(tmp_path: Path) -> None:
    calls: list[int] = []

    def compute() -> np.ndarray:
        calls.append(1)
        return np.arange(6, dtype=np.float64) - 3.5

    path = tmp_path / "data" / "ref-x"
    first = cached_reference(path, 6, compute)
    again = cached_reference(path, 6, compute)
    assert calls == [1] and np.array_equal(first, again)
    raw = bytearray((path / VALUES).read_bytes())
    raw[-1] ^= 0xFF  # one flipped byte: the sha256 in the manifest no longer matches
    (path / VALUES).write_bytes(bytes(raw))
    healed = cached_reference(path, 6, compute)
    assert calls == [1, 1] and np.array_equal(healed, first)
    assert cached_reference(path, 6, compute) is not None and calls == [1, 1]


@pytest.mark.slow  # ~50 s each (2 threads): the learning curve, not a mechanism
@pytest.mark.parametrize(
    "objective", [["dpo"], ["simpo", "--dpo.beta", "2.0"]], ids=["dpo", "simpo"]
)  # SimPO 2026-12-06: reward accuracy 49.5 % -> 100 %, eval loss 1.063 -> 0.087
def test_synthetic_preferences_are_learned(cli: CLI, tmp_path: Path, objective: list[str]) -> None:
    """builtin:prefer-reverse: held-out reward accuracy from chance to > 95 %."""
    out = tmp_path / "run"
    r = cli.run(out, *LEARN, "--train.objective", *objective, timeout=900)
    assert r.returncode == 0, r.stderr
    evals = {e["tag"]: e for e in read_events(out) if e["event"] == "eval"}
    assert 0.3 < evals["before"]["logps/accuracies"] < 0.7
    assert evals["after"]["rewards/accuracies"] > 0.95


LEARN = [
    "--data.train",
    "builtin:prefer-reverse",
    "--train.max_steps",
    "30",
    "--train.num_threads",
    "2",
    "--eval.max_samples",
    "200",
]
