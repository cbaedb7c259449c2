"""Data-parallel and sharded fine-tuning under torchrun (gloo on CPU), launched by
``shoestring run``: restarts after a killed rank, elastic resume across world sizes,
FSDP2 exact resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import CLI, DIST, FAST, read_events, run_job, sha256
from shoestring.train import state as S


def steps(out: Path) -> dict[int, dict[str, Any]]:
    """Step events of rank 0, last record per step (a redone step overwrites)."""
    return {e["step"]: e for e in read_events(out) if e["event"] == "step"}


def assert_losses_close(
    a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]], which: range, rel: float = 1e-6
) -> None:
    for s in which:
        la, lb = a[s]["loss"], b[s]["loss"]
        # events round to 1e-6 absolute; allow that on top of the relative bound
        assert abs(la - lb) <= rel * abs(lb) + 1e-6, (s, la, lb)
        assert a[s]["batch_crc"] == b[s]["batch_crc"], f"step {s}: different samples"


def offline_digests(ck: Path, tmp: Path) -> dict[str, str]:
    """Digests of a checkpoint on disk, read without our loader (DCP or single-file format)."""
    if (ck / ".metadata").exists():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(str(ck), str(tmp / "full.pt"))
        sd = torch.load(tmp / "full.pt", weights_only=False)
        return {
            "adapter_sha": S.digest(sd["model"]),
            "optimizer_sha": S.digest(S.flat_optimizer_state(sd["optim"]["state"])),
        }
    from safetensors.torch import load_file

    doc = json.loads((ck / S.STATE).read_text())
    names = doc["param_names"]
    state: dict[str, dict[str, Any]] = {}
    for key, v in load_file(str(ck / S.OPTIMIZER)).items():
        _, idx, k = key.split(".", 2)
        state.setdefault(names[int(idx)], {})[k] = v
    for key, v in doc["optimizer"]["scalars"].items():
        idx, k = key.split(".", 1)
        state.setdefault(names[int(idx)], {})[k] = v
    return {
        "adapter_sha": S.digest(load_file(str(ck / S.ADAPTER))),
        "optimizer_sha": S.digest(S.flat_optimizer_state(state)),
    }


def resume_records(out: Path) -> list[dict[str, Any]]:
    recs = [e for e in read_events(out) if e["event"] == "resume"]
    for p in sorted((out / "ranks").glob("rank*/events.jsonl")):
        recs += [e for e in read_events(p.parent) if e["event"] == "resume"]
    return recs


@pytest.fixture(scope="module")
def single_ref(cli: CLI, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("single") / "ref"
    r = cli.run(out, *DIST)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_ddp_matches_single_process(ddp_ref: Path, single_ref: Path) -> None:
    start = [e for e in read_events(ddp_ref) if e["event"] == "run_start"][0]
    assert start["world_size"] == 2 and start["strategy"] == "ddp" and start["grad_accum"] == 2
    a, b = steps(ddp_ref), steps(single_ref)
    assert sorted(a) == list(range(1, 13))
    assert_losses_close(a, b, range(1, 13))
    # Every rank committed its shard under one manifest; the run exported a peft adapter.
    ck = ddp_ref / "checkpoints" / "step-00000012"
    manifest = json.loads((ck / "manifest.json").read_text())
    assert {
        "__0_0.distcp",
        "__1_0.distcp",
        ".metadata",
        "rng_rank0.safetensors",
        "rng_rank1.safetensors",
        "trainer_state.json",
    } <= set(manifest["files"])
    assert (ddp_ref / "final" / "adapter_model.safetensors").exists()


@pytest.mark.slow  # a lost rank's restart: tests/test_multinode.py, test_watchdog.py (CI time)
def test_killed_rank_is_restarted_and_result_is_byte_identical(
    cli: CLI, tmp_path: Path, ddp_ref: Path
) -> None:
    out = tmp_path / "run"
    # SIGKILL rank 1 (no notice) after step 6, once its shard of the step-4 checkpoint is
    # written (``saved``: else a slow async shard could still be in flight, and no step-4
    # checkpoint would be committed); the step-4 checkpoint is the last committed.
    faults = "step.end@6:kill:rank1:once:saved"
    r = run_job(cli, out, 2, *DIST, restarts=2, env={"SHOESTRING_FAULTS": faults})
    assert r.returncode == 0, r.stderr[-3000:]
    ev = read_events(out)
    restarts = [e for e in ev if e["event"] == "restart"]
    assert len(restarts) == 1
    resume = [e for e in ev if e["event"] == "resume"]
    assert len(resume) == 1 and resume[0]["from_step"] == 4 and resume[0]["world_size"] == 2
    assert sha256(out / "final" / "adapter_model.safetensors") == sha256(
        ddp_ref / "final" / "adapter_model.safetensors"
    )


def test_warning_signal_to_run_checkpoints_every_rank_and_resumes(
    cli: CLI, tmp_path: Path, ddp_ref: Path
) -> None:
    # A Slurm-style warning (SIGUSR1) to `shoestring run`: torchrun must survive it, every
    # rank must stop at one step, and the emergency checkpoint must be sealed before any
    # rank exits (torchrun stops the others as soon as one leaves).
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "shoestring",
        "run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
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
    ]
    env = cli.env(SHOESTRING_FAULTS="step.forward@1:slow200")  # slower steps, same numbers
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if any(
            e["event"] == "step" and e["step"] >= 5
            for e in read_events(out)
            if (out / "events.jsonl").exists()
        ):
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 75, err[-3000:]
    ev = read_events(out)
    (pre,) = [e for e in ev if e["event"] == "preempt"]
    assert pre["saved"] and pre["reason"] == "SIGUSR1"
    assert (out / "checkpoints" / f"step-{pre['step']:08d}" / "manifest.json").exists()
    assert not [e for e in ev if e["event"] == "restart"]
    r = run_job(cli, out, 2, *DIST)
    assert r.returncode == 0, r.stderr[-3000:]
    (resume,) = [e for e in read_events(out) if e["event"] == "resume"]
    assert resume["from_step"] == pre["step"] and resume["steps_lost"] == 0
    assert sha256(out / "final" / "adapter_model.safetensors") == sha256(
        ddp_ref / "final" / "adapter_model.safetensors"
    )


@pytest.mark.slow  # 2 -> 1 also in tests/test_fsdp_qlora.py (DCP) (CI time)
def test_resume_two_ranks_to_one(cli: CLI, tmp_path: Path, ddp_ref: Path, single_ref: Path) -> None:
    out = tmp_path / "run"
    # Both ranks die after step 9; the synchronous step-8 checkpoint is the newest.
    r = run_job(
        cli,
        out,
        2,
        *DIST,
        "--checkpoint.async_mode",
        "off",
        env={"SHOESTRING_FAULTS": "step.end@9:kill"},
    )
    assert r.returncode != 0
    saved = offline_digests(out / "checkpoints" / "step-00000008", tmp_path)
    r = cli.run(out, *DIST)  # one process, same global batch, continues to step 12
    assert r.returncode == 0, r.stderr[-3000:]
    (res,) = resume_records(out)
    assert (res["from_step"], res["from_world_size"], res["world_size"]) == (8, 2, 1)
    assert res["format"] == "dcp"
    assert {k: res[k] for k in saved} == saved  # optimizer state identical after load
    assert_losses_close(steps(out), steps(ddp_ref), range(9, 13))
    assert_losses_close(steps(out), steps(single_ref), range(9, 13))


@pytest.mark.slow  # the 2 -> 1 direction runs in CI
def test_resume_one_rank_to_two(cli: CLI, tmp_path: Path, ddp_ref: Path, single_ref: Path) -> None:
    out = tmp_path / "run"
    r = cli.run(
        out, *DIST, "--checkpoint.async_mode", "off", env={"SHOESTRING_FAULTS": "step.end@9:kill"}
    )
    assert r.returncode != 0
    saved = offline_digests(out / "checkpoints" / "step-00000008", tmp_path)
    r = run_job(cli, out, 2, *DIST)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = resume_records(out)
    assert sorted(e["rank"] for e in recs) == [0, 1]
    for res in recs:  # both ranks hold exactly the saved state
        assert (res["from_step"], res["from_world_size"], res["world_size"]) == (8, 1, 2)
        assert {k: res[k] for k in saved} == saved
    assert_losses_close(steps(out), steps(single_ref), range(9, 13))
    assert_losses_close(steps(out), steps(ddp_ref), range(9, 13))


@pytest.mark.slow  # CI: tests/test_fsdp_qlora.py runs the same FSDP2 strategy (4-bit base),
# its eval, hang naming and exact resume
def test_fsdp2_trains_and_resumes_exactly(cli: CLI, tmp_path: Path, ddp_ref: Path) -> None:
    fsdp = [*DIST, "--distributed.strategy", "fsdp"]
    ref = tmp_path / "ref"
    # The reference also evaluates (loss + greedy exact match) through the sharded model.
    r = run_job(cli, ref, 2, *fsdp, "--data.eval", "builtin:reverse", "--eval.max_samples", "8")
    assert r.returncode == 0, r.stderr[-3000:]
    ev = read_events(ref)
    assert [e["strategy"] for e in ev if e["event"] == "run_start"] == ["fsdp"]
    assert {e["tag"] for e in ev if e["event"] == "eval"} == {"before", "after"}
    first, last = steps(ref)[1]["loss"], steps(ref)[12]["loss"]
    assert last < first
    # Sharding changes only the reduction order, not the math.
    assert_losses_close(steps(ref), steps(ddp_ref), range(1, 13), rel=1e-5)

    # Rank 1 hangs after step 6: the watchdog names it and the FSDP2 collective rank 0 waits
    # in (FSDP2's own all-gathers/reduce-scatters are traced), kills the job, and the
    # restart resumes from the sharded checkpoint of step 4.
    out = tmp_path / "run"
    r = run_job(
        cli, out, 2, *fsdp, restarts=1, env={"SHOESTRING_FAULTS": "step.end@6:hang:rank1:once"}
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ev = read_events(out)
    (hang,) = [e for e in ev if e["event"] == "hang"]
    assert hang["kind"] == "stuck_rank" and hang["culprits"] == [1], hang["summary"]
    waiting = hang["ranks"]["0"]["waiting_in"]
    assert waiting is not None and waiting.split(" #")[0] in (
        "all_gather_single",
        "reduce_scatter_single",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
    ), hang["summary"]
    assert hang["collective"]["op"] == waiting.split(" #")[0]
    (res,) = [e for e in ev if e["event"] == "resume"]
    assert res["from_step"] == 4 and res["format"] == "dcp"
    assert sha256(out / "final" / "adapter_model.safetensors") == sha256(
        ref / "final" / "adapter_model.safetensors"
    )
    for s in range(5, 13):
        assert steps(out)[s]["loss"] == steps(ref)[s]["loss"]


def test_batch_that_does_not_split_is_rejected_before_work(cli: CLI, tmp_path: Path) -> None:
    r = run_job(
        cli, tmp_path / "bad", 2, *FAST, "--train.batch_size", "6", "--train.micro_batch_size", "2"
    )
    assert r.returncode != 0
    assert "train.batch_size 6" in r.stderr and "train.micro_batch_size" in r.stderr
    assert not (tmp_path / "bad" / "checkpoints").exists()
