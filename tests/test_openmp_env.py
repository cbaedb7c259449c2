"""Every shoestring command shortens OpenMP's spin-wait before torch loads its OpenMP
runtime (GNU libgomp, which reads the environment once, as it loads), so that a busy
neighbour on the machine does not stall torch's threads (benchmarks/busy_neighbour.py);
the processes it starts inherit it, and a policy the user set is left alone.

libgomp shows what it read with ``OMP_DISPLAY_ENV=VERBOSE``: ``GOMP_SPINCOUNT = '3000'``
as the CLI sets it, ``'300000'`` by libgomp's default, ``'0'`` under a passive policy."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shoestring.cli import OMP_SPIN_COUNT, openmp_defaults

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e  # starts processes

#: In a fresh interpreter: import the CLI as ``python -m shoestring`` does, check it did
#: not import torch, run the entry point, then load torch (and with it libgomp).
CHILD = """\
import sys
from shoestring.cli import main
assert "torch" not in sys.modules, "importing the CLI loaded torch before main() ran"
main(["--version"])
import torch
torch.ones(64, 64).sum()
"""


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
    }
    env.update(PYTHONPATH=str(REPO / "src"), OMP_DISPLAY_ENV="VERBOSE", **extra)
    return env


def _spin_counts(cmd: list[str], env: dict[str, str]) -> list[str]:
    """GOMP_SPINCOUNT as each libgomp the command loaded read it."""
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return re.findall(r"GOMP_SPINCOUNT = '(\d+)'", r.stdout + r.stderr)


def test_the_cli_entry_sets_a_short_spin_before_torch_loads_openmp() -> None:
    assert _spin_counts([sys.executable, "-c", CHILD], _env()) == [str(OMP_SPIN_COUNT)]
    # Without the CLI: libgomp's default spinning (what every command got before).
    assert _spin_counts([sys.executable, "-c", "import torch"], _env()) == ["300000"]


def test_processes_started_by_shoestring_run_inherit_it() -> None:
    cmd = [sys.executable, "-m", "shoestring", "run", "--", sys.executable, "-c", "import torch"]
    counts = _spin_counts(cmd, _env())
    assert counts and set(counts) == {str(OMP_SPIN_COUNT)}


def test_a_policy_from_the_environment_is_kept() -> None:
    assert _spin_counts([sys.executable, "-c", CHILD], _env(GOMP_SPINCOUNT="300000")) == ["300000"]
    passive = _env(OMP_WAIT_POLICY="PASSIVE")
    assert _spin_counts([sys.executable, "-c", CHILD], passive) == ["0"]
    assert openmp_defaults({"OMP_WAIT_POLICY": "active"}) == {}
    assert openmp_defaults({}) == {"GOMP_SPINCOUNT": "3000"}
