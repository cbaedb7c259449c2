"""The embedded default: `shoestring finetune` with no config learns visibly."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from conftest import CLI, read_events


def _default_run(cli: CLI, out: Path, *args: str) -> tuple[dict[str, Any], dict[str, Any]]:
    # Only --output_dir (and, for the short run, the length): every other setting is the
    # default, threads included.
    r = cli.run(out, *args, env={"OMP_NUM_THREADS": str(os.cpu_count() or 1)}, timeout=900)
    assert r.returncode == 0, r.stderr
    evals = {e["tag"]: e for e in read_events(out) if e["event"] == "eval"}
    before, after = evals["before"], evals["after"]
    assert before["samples"] == after["samples"] >= 100
    assert before["exact_match"] < 0.05  # a random model cannot reverse words
    assert "before: " in r.stderr and "after: " in r.stderr
    assert (out / "final" / "adapter_model.safetensors").exists()
    return before, after


def test_default_run_shortened_learns(cli: CLI, tmp_path: Path) -> None:
    """The default job cut to 300 of its 1000 steps (~50 s): the loss falls 4x and the
    first reversals come out right (measured: 8.58 -> 1.05, exact match 0 % -> 10 %).

    Under load (2026-12-05, 2-core VM, other sessions' tests running too): 70 s beside
    one `python -c "while True: pass"`, 80 s beside two. It timed out at 900 s on a
    loaded AMD VM while libgomp's threads spun (10-30x slower steps); the CLI's short
    OpenMP spin (`shoestring.cli.openmp_defaults`) is what keeps it near 200 ms a step
    there (benchmarks/busy_neighbour.py)."""
    before, after = _default_run(cli, tmp_path / "short", "--train.max_steps", "300")
    assert after["loss"] < before["loss"] / 4
    assert after["exact_match"] > before["exact_match"]


@pytest.mark.slow  # the whole default job, ~3 min on 2 cores; the README's command (a)
def test_default_run_learns_and_prints_before_after(cli: CLI, tmp_path: Path) -> None:
    before, after = _default_run(cli, tmp_path / "default")
    assert after["exact_match"] >= 0.5 and after["loss"] < before["loss"] / 2
