"""The embedded default: `shoestring finetune` with no config learns visibly."""

from __future__ import annotations

import os
from pathlib import Path

from conftest import CLI, read_events


def test_default_run_learns_and_prints_before_after(cli: CLI, tmp_path: Path) -> None:
    out = tmp_path / "default"
    # Only --output_dir: every other setting is the default, threads included.
    r = cli.run(out, env={"OMP_NUM_THREADS": str(os.cpu_count() or 1)}, timeout=900)
    assert r.returncode == 0, r.stderr
    evals = {e["tag"]: e for e in read_events(out) if e["event"] == "eval"}
    before, after = evals["before"], evals["after"]
    assert before["samples"] == after["samples"] >= 100
    assert before["exact_match"] < 0.05  # a random model cannot reverse words
    assert after["exact_match"] >= 0.5 and after["loss"] < before["loss"] / 2
    assert "before: " in r.stderr and "after: " in r.stderr
    assert (out / "final" / "adapter_model.safetensors").exists()
