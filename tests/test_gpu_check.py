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


# Benchmark tooling (as benchmarks/scale.py's smoke): its parts are CI's elsewhere, and the
# brief has it run by hand, `--device cpu --small`, before each device call (CI time).
@pytest.mark.slow
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
    assert list(checks) == [  # priority order: what the global budget cuts is the tail
        "promise_16gb",
        "peer_hf",
        "infer",
        "checkpoint_blocking",
        "sigkill_resume",
        "nvml",
        "distributed",
        "fsdp_qlora",  # (e): only with time left
    ]
    for name, c in checks.items():
        assert c["status"] in STATUSES, name
        assert c["status"] == "pass" or c.get("reason"), name

    promise = checks["promise_16gb"]  # (a): the real shapes need CUDA; the code path runs
    assert promise["status"] == "pass"
    for label in ("llama3-8b-bf16", "llama3-8b-fp16", "llama2-7b-bf16"):
        assert promise["runs"][label] == {"status": "not_run", "reason": "no CUDA"}
    tiny = promise["runs"]["tiny-nf4"]
    assert tiny["status"] == "pass" and tiny["tokens_per_s"] > 0
    assert tiny["memory"] == {"status": "not_run", "reason": "no CUDA"}
    assert "cuda_peak_bytes" not in tiny  # never a number that was not measured

    peer = checks["peer_hf"]  # (b): HF Trainer + PEFT beside ours, same examples and order
    assert peer["status"] == "pass", peer.get("reason")
    ours, theirs = peer["ours"], peer["hf_trainer_peft"]
    assert ours["tokens_per_s"] > 0 and theirs["tokens_per_s"] > 0
    assert peer["ours_vs_hf"]["tokens_per_s_ratio"] > 0
    assert len(ours["losses"]) == len(theirs["losses"]) == peer["workload"]["steps"]
    curves = peer["ours_vs_hf"]["loss_curves"]
    # LoRA's B starts at zero on both sides: step 1 is the same model on the same batch
    assert curves["agree"] and curves["first_step_rel_diff"] < 1e-4
    for variant in ("kernels_liger", "compile"):
        assert peer["variants"][variant]["status"] == "not_run"
        assert "no CUDA" in peer["variants"][variant]["reason"]

    resume = checks["sigkill_resume"]
    assert resume["status"] == "pass" and resume["resumed"]
    assert resume["killed_exit_code"] == -9 and resume["resume_exit_code"] == 0
    assert resume["sha256_equal"] and resume["sha256_uninterrupted"] == resume["sha256_resumed"]
    assert isinstance(resume["steps_lost"], int)

    blocking = checks["checkpoint_blocking"]
    assert blocking["status"] == "pass" and blocking["runs"]
    assert all(b["ratio_median"] > 0 for b in blocking["runs"].values())
    parts = blocking["what_blocks"]  # (d): the blocking's parts, measured apart
    assert parts["tensors"] > 0 and parts["bytes"] > 0
    assert parts["stage_ms"] > 0 and parts["coalesced_ms"] > 0 and parts["capture_ms"] > 0

    assert checks["distributed"]["status"] == "skipped"
    assert checks["distributed"]["reason"] == "no CUDA"
    assert checks["nvml"]["status"] == "skipped"
    assert checks["nvml"]["reason"] == "no CUDA/NVML"

    infer = checks["infer"]
    assert infer["status"] == "pass"
    assert infer["exactness"]["greedy_identical"] == infer["exactness"]["prompts"]
    assert "h2d_bytes_per_s" not in infer
    held = infer["structured"]  # answers held to a JSON Schema, on the check's device
    assert held["complete_and_valid"] == held["answers"] == held["equal_to_cpu_fp32"] > 0
    stored = infer["prequant"]  # a bnb 4-bit save streamed as stored, vs transformers'
    assert stored["stored"] and stored["greedy_identical"] == stored["prompts"] > 0

    fsdp = checks["fsdp_qlora"]  # (e): FSDP2 over a mesh of one on the nf4 base (CPU kernels)
    assert fsdp["status"] == "pass", fsdp.get("reason")
    steps = fsdp["workload"]["steps"]
    assert fsdp["workload"]["quantize"] == "nf4" and "nf4_skipped" not in fsdp["workload"]
    sharded, single = fsdp["runs"]["fsdp"], fsdp["runs"]["single"]
    assert (sharded["as_run"]["strategy"], sharded["as_run"]["world_size"]) == ("fsdp", 1)
    assert single["as_run"]["strategy"] == "single"
    assert sharded["tokens_per_s"] > 0 and len(sharded["losses"]) == len(single["losses"]) == steps
    # the same math in one process: the losses agree step by step (measured: equal)
    gaps = [abs(a - b) / abs(b) for a, b in zip(sharded["losses"], single["losses"])]
    assert max(gaps) <= 1e-4 and sharded["losses"][-1] != sharded["losses"][0]
    assert fsdp["losses_vs_single"]["fsdp"]["agree"]
    assert fsdp["losses_vs_single"]["fsdp"]["steps_compared"] == steps
    memory = sharded["memory"]  # the planner's per-rank prediction; measured only on CUDA
    assert memory["plan_peak_bytes"] > 0
    assert memory["status"] == "not_run" and "measured_max_allocated" not in memory
    assert fsdp["runs"]["fsdp_cpu_offload"]["status"] == "not_run"  # refused on CPU
    assert fsdp["sigkill_resume"]["status"] == "not_run"  # --small: CI time
