"""`shoestring run` watches every rank: an injected hang is caught within its budget,
the verdict names the culprit rank and the collective the others wait in, carries
every rank's Python stacks, and the restarted job ends exactly like an undisturbed one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import CLI, DIST, read_events, run_job, sha256


@pytest.mark.parametrize(
    "fault,culprit,frame,run_dir",
    [
        # a rank that stops after a step; `shoestring run` given no --run-dir watches the
        # finetune command's output_dir all the same
        ("step.end@6:hang:rank1:once", 1, "in hit", False),
        pytest.param(
            "step.data@13:hang:rank0:once",
            0,
            "in hit",  # stuck loading data (step 7)
            True,
            marks=pytest.mark.slow,
        ),
    ],
)
def test_hang_is_caught_named_and_restarted(
    cli: CLI, tmp_path: Path, ddp_ref: Path, fault: str, culprit: int, frame: str, run_dir: bool
) -> None:
    out = tmp_path / "run"
    env = {"SHOESTRING_FAULTS": fault}
    r = run_job(cli, out, 2, *DIST, restarts=1, env=env, run_dir=run_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    ev = read_events(out)
    (hang,) = [e for e in ev if e["event"] == "hang"]
    assert hang["kind"] == "stuck_rank" and hang["culprits"] == [culprit]
    other = 1 - culprit
    # The healthy rank is named as waiting in the gradient all-reduce the culprit never joined.
    assert hang["ranks"][str(other)]["waiting_in"].startswith("allreduce[ddp] #")
    assert hang["ranks"][str(culprit)]["waiting_in"] is None
    assert hang["collective"]["op"] == "allreduce[ddp]"
    # Within the budget: max(3 x p99 step, 10 s floor) plus one poll; not minutes.
    budget = hang["ranks"][str(culprit)]["budget_s"]
    assert budget == 10.0 and 10.0 <= hang["detected_after_s"] <= budget + 3.0
    verdict = json.loads(Path(hang["verdict_file"]).read_text())
    assert frame in verdict["ranks"][str(culprit)]["stacks"]  # live stack of the stuck rank
    assert "in train_step" in verdict["ranks"][str(other)]["stacks"]
    (restart,) = [e for e in ev if e["event"] == "restart"]
    assert restart["reason"] == "hang"
    assert sha256(out / "final" / "adapter_model.safetensors") == sha256(
        ddp_ref / "final" / "adapter_model.safetensors"
    )


def test_rank_that_never_joins_is_named_and_restarted(
    cli: CLI, tmp_path: Path, ddp_ref: Path
) -> None:
    # Rank 1 is stuck before it joins the process group (the first attempt only); rank 0
    # has announced itself and waits in init_process_group. No collective timeout, no
    # step: named after the first-phase timeout (30 s here: the restarted ranks' setup
    # must fit in it on a loaded 2-core machine), then the job restarts.
    out = tmp_path / "run"
    r = run_job(
        cli,
        out,
        2,
        *DIST,
        restarts=1,
        env={"SHOESTRING_FAULTS": "start.init@1:hang:rank1:once"},
        run_args=("--first-phase-timeout", "30"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ev = read_events(out)
    (hang,) = [e for e in ev if e["event"] == "hang"]
    assert hang["kind"] == "not_started" and hang["culprits"] == [1]
    assert hang["ranks"]["0"]["status"] == "starting" and "1" not in hang["ranks"]
    # Within a poll or so of the timeout — or of rank 0's announcement, when a loaded
    # machine took longer than that to import and start it.
    assert hang["detected_after_s"] >= 30.0
    assert hang["detected_after_s"] <= 34.0 or hang["ranks"]["0"]["in_phase_s"] <= 4.0
    verdict = json.loads(Path(hang["verdict_file"]).read_text())
    assert "in init_process_group" in verdict["ranks"]["0"]["stacks"]
    (restart,) = [e for e in ev if e["event"] == "restart"]
    assert restart["reason"] == "hang"
    assert sha256(out / "final" / "adapter_model.safetensors") == sha256(
        ddp_ref / "final" / "adapter_model.safetensors"
    )


def test_mismatched_collective_is_named_and_restarted(
    cli: CLI, tmp_path: Path, ddp_ref: Path
) -> None:
    # Rank 1 issues an extra, mis-shaped all_reduce (float64 of 3) during step 5.
    out = tmp_path / "run"
    r = run_job(
        cli, out, 2, *DIST, restarts=1, env={"SHOESTRING_FAULTS": "step.agree@5:extra:rank1:once"}
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ev = read_events(out)
    (hang,) = [e for e in ev if e["event"] == "hang"]
    assert hang["kind"] == "collective_mismatch" and hang["culprits"] == [1]
    assert hang["collective"]["op"] == "all_reduce" and hang["collective"]["shapes"] == [[3]]
    assert "rank 1: all_reduce" in hang["summary"]
    assert hang["detected_after_s"] <= hang["ranks"]["1"]["budget_s"] + 3.0
    assert sha256(out / "final" / "adapter_model.safetensors") == sha256(
        ddp_ref / "final" / "adapter_model.safetensors"
    )


def test_healthy_run_with_saves_and_rank0_evals_raises_no_alarm(cli: CLI, tmp_path: Path) -> None:
    """Passed 2026-12-05 beside one and beside two CPU burners (`python -c "while True:
    pass"`) on the 2-core VM, 15-16 s (with other sessions' tests running too)."""
    # Rank 0 evaluates alone (DDP) while rank 1 waits in the next all-reduce, checkpoints
    # are written every 5 steps and the run crosses epoch boundaries (tiny dataset): none
    # of that is a hang or a straggler, even with a 2 s floor and a first-phase timeout
    # far below an eval.
    # The straggler threshold is raised to 25 %: on this 2-core VM, with both ranks and the
    # supervisor sharing the CPUs, identical ranks measured up to 8 % apart (three runs of
    # this job at the default 10 %: no alarm, largest gap +8 %); a CI run with the old
    # per-token measure saw 15-29 %. An eval, a save or an epoch boundary leaking into the
    # work timings would be several times that (an eval here takes > 3 steps), so this
    # still fails if the judgement counts them.
    out = tmp_path / "run"
    data = tmp_path / "small.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"{w} ->", "completion": f" {w[::-1]}"}) + "\n"
            for w in [
                "spot",
                "gpu",
                "cheap",
                "resume",
                "adapter",
                "token",
                "shard",
                "bucket",
                "slurm",
                "node",
                "rank",
                "step",
            ]
            * 4
        )
    )
    r = run_job(
        cli,
        out,
        2,
        *DIST,
        "--train.max_steps",
        "40",
        "--data.train",
        str(data),
        "--data.eval",
        "builtin:reverse",
        "--eval.max_samples",
        "48",
        "--eval.every_steps",
        "10",
        "--checkpoint.every_steps",
        "5",
        run_args=(
            "--hang-floor",
            "2",
            "--first-phase-timeout",
            "60",
            "--straggler-threshold",
            "0.25",
        ),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ev = read_events(out)
    assert not [e for e in ev if e["event"] in ("hang", "straggler", "restart")]
    evals = [e for e in ev if e["event"] == "eval"]
    steps = [e for e in ev if e["event"] == "step"]
    assert len(evals) == 5 and max(e["eval_ms"] for e in evals) > 3 * max(
        e["step_ms"] for e in steps
    )
    assert steps[-1]["epoch"] >= 4  # 48 samples, 8 per step: several epoch boundaries
    # The straggler check did judge this run (enough quiet steps on every rank).
    for r in (0, 1):
        live = json.loads((out / "ranks" / f"rank{r}" / "live.json").read_text())
        assert len(live["work"]["forward"]) >= 20


@pytest.mark.parametrize(
    "slow",
    [
        # A rank twice as slow; slow in CI too (CI time): the straggler rule itself is
        # CI's in tests/test_hang_analysis.py, and the hang and never-joins tests here
        # check the same watch path end to end. The 20 % and 10 % cases need a quiet machine: with a
        # CPU burner per core beside the job (2026-12-05), the ranks' forward times moved
        # apart by more than 20 % from contention alone (rank 0 slower than the slow20
        # rank 1 on most steps) and slow20 raised no alarm in 50 steps.
        pytest.param("slow100", marks=pytest.mark.slow),
        # Quiet machine: measured 20-22 %, flagged.
        pytest.param("slow20", marks=pytest.mark.slow),
        # The 10 %: flagged in 3 of 3 runs here (steps 39-40, measured 11-13 % slower),
        # but that is at the threshold.
        pytest.param("slow10", marks=pytest.mark.slow),
    ],
)
def test_slow_rank_is_flagged_with_its_slow_phase(cli: CLI, tmp_path: Path, slow: str) -> None:
    """slow100 flagged beside one and beside two CPU burners (2026-12-05, 2-core VM,
    15-16 s); slow20 was not flagged beside two."""
    out = tmp_path / "run"
    # Every forward pass of rank 1 takes 100 % (20 %, 10 %) longer from the first step on.
    # 50 steps, the bound: a judgement needs 20 quiet steps (not overlapping a
    # save) on every rank, and a report the same verdict as of 10 steps in a row, all
    # seen in one published snapshot (published every second, so a few steps late).
    # Saves every 10 steps (not DIST's 4: each drops the steps its writer overlaps).
    r = run_job(
        cli,
        out,
        2,
        *DIST,
        "--train.max_steps",
        "50",
        "--checkpoint.every_steps",
        "10",
        env={"SHOESTRING_FAULTS": f"step.forward@1:{slow}:rank1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ev = read_events(out)
    (alarm,) = [e for e in ev if e["event"] == "straggler"]
    assert alarm["rank"] == 1 and alarm["part"] == "forward"
    assert alarm["slower_by"] > 0.10 and alarm["step"] <= 50
    assert alarm["step"] - alarm["slower_since_step"] >= 9
    assert not [e for e in ev if e["event"] in ("hang", "restart")]
