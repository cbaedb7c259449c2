"""Kill-anywhere driver shared by tests/test_chaos.py and benchmarks/chaos_soak.py.

Restarts the same command until it exits 0. Each start either carries a fault
point inside the checkpoint writer (SIGKILL at an exact moment of a save) or is
SIGKILLed from outside at a random moment after it has made progress.
"""

from __future__ import annotations

import random
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

FAULT_POINTS = [
    "ckpt.partial_file",
    "ckpt.after_file",
    "ckpt.before_manifest",
    "ckpt.before_rename",
    "ckpt.after_rename",
    "ckpt.retention",
    "resume.after_load",
    "step.end",
]


@dataclass
class ChaosResult:
    attempts: list[tuple[str, int]] = field(default_factory=list)  # (how, returncode)

    @property
    def kills(self) -> int:
        return sum(1 for _how, rc in self.attempts if rc == -9)


def _steps_seen(out: Path) -> int:
    p = out / "events.jsonl"
    if not p.exists():
        return 0
    return p.read_text().count('"event":"step"')


def run_with_chaos(
    start: Callable[[str], subprocess.Popen[str]],
    out: Path,
    kills: int,
    rng: random.Random,
    *,
    fault_prob: float = 0.5,
    max_delay: float = 1.5,
    max_attempts: int | None = None,
) -> ChaosResult:
    res = ChaosResult()
    for _ in range(max_attempts or kills * 3 + 5):
        chaos = res.kills < kills
        faults = ""
        if chaos and rng.random() < fault_prob:
            faults = f"{rng.choice(FAULT_POINTS)}@{rng.randint(1, 3)}"
        proc = start(faults)
        how = faults or "clean"
        if chaos:
            # Also kill from outside, so a fault point that is never reached still costs a kill.
            seen = _steps_seen(out)
            deadline = time.time() + 120
            while proc.poll() is None and _steps_seen(out) <= seen and time.time() < deadline:
                time.sleep(0.02)
            time.sleep(rng.uniform(0, max_delay))
            if proc.poll() is None:
                proc.kill()
                how = f"{faults}+external-sigkill" if faults else "external-sigkill"
        rc = proc.wait(timeout=300)
        if proc.stdout:
            proc.stdout.read()
        res.attempts.append((how, rc))
        if rc == 0:
            return res
        assert rc == -9, f"unexpected exit {rc} after {how}"
    raise AssertionError(f"did not finish: {res.attempts}")
