"""benchmarks/gpu_check.py's CPU smoke path: every check reports an honest status."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.e2e

STATUSES = {"pass", "fail", "skipped", "not_run"}


def test_gpu_check_cpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.json"
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "gpu_check.py"),
            "--device",
            "cpu",
            "--small",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert json.loads(r.stdout) == report  # what it prints is what it wrote
    assert report["device"] == "cpu" and report["small"] is True and report["total_s"] > 0
    assert report["torch"] and "date" in report and "git_commit" in report
    checks = report["checks"]
    assert set(checks) == {
        "lora_bf16",
        "qlora_nf4",
        "sigkill_resume",
        "checkpoint_blocking",
        "distributed",
        "infer",
        "nvml",
    }
    for name, c in checks.items():
        assert c["status"] in STATUSES, name
        assert c["status"] == "pass" or c.get("reason"), name

    for name in ("lora_bf16", "qlora_nf4"):
        assert checks[name]["status"] == "pass"
        assert checks[name]["precision"]["used"] == "fp32"  # bf16 becomes fp32 on CPU
        tiny = checks[name]["runs"]["tiny"]
        assert tiny["tokens_per_s"] > 0
        assert tiny["memory"] == {"status": "not_run", "reason": "no CUDA"}
        assert "cuda_peak_bytes" not in tiny  # never a number that was not measured

    resume = checks["sigkill_resume"]
    assert resume["status"] == "pass" and resume["resumed"]
    assert resume["killed_exit_code"] == -9 and resume["resume_exit_code"] == 0
    assert resume["sha256_equal"] and resume["sha256_uninterrupted"] == resume["sha256_resumed"]
    assert isinstance(resume["steps_lost"], int)

    blocking = checks["checkpoint_blocking"]
    assert blocking["status"] == "pass" and blocking["runs"]
    assert all(b["ratio_median"] > 0 for b in blocking["runs"].values())

    assert checks["distributed"]["status"] == "skipped"
    assert checks["distributed"]["reason"] == "no CUDA"
    assert checks["nvml"]["status"] == "skipped"
    assert checks["nvml"]["reason"] == "no CUDA/NVML"

    infer = checks["infer"]
    assert infer["status"] == "pass"
    assert infer["exactness"]["greedy_identical"] == infer["exactness"]["prompts"]
    assert "h2d_bytes_per_s" not in infer
