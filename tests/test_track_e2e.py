"""Trackers through `shoestring finetune`: TensorBoard, W&B (offline) and MLflow (local
store) fed from rank 0's event log, continuing the same tracker runs after a SIGKILL,
with their ids in run.json and in every checkpoint's manifest."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest

from conftest import CLI, FAST, read_events, run_job
from shoestring import exitcodes
from test_track import mlflow_run, tb_scalars, tracker_env, wandb_attempts


def _args() -> list[str]:
    return [*FAST, "--track.to", "tensorboard,wandb,mlflow", "--track.wandb_mode", "offline"]


@pytest.mark.e2e
# Both cases are slow: tests/test_track.py's CI tests stop and resume a real run under
# SIGKILL and SIGTERM and check each tracker's records (CI time).
@pytest.mark.slow
@pytest.mark.parametrize("stop", ["kill", "term"])
def test_a_stopped_finetune_continues_the_same_tracker_runs(
    cli: CLI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: str
) -> None:
    """Stopped at step 7 — SIGKILL (no notice: resumes from step 4, steps 5..7 redone) or
    SIGTERM (a notice: an emergency checkpoint at 7, nothing redone) — then rerun."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # reading mlruns/ back here
    out = tmp_path / "run"
    env = tracker_env(tmp_path)
    # The kill waits for the step-4 save in flight (``:saved``): it must resume from 4.
    fault = "step.end@7:kill:saved" if stop == "kill" else "step.end@7:term"
    r = cli.run(out, *_args(), env={**env, "SHOESTRING_FAULTS": fault})
    assert r.returncode == (-signal.SIGKILL if stop == "kill" else exitcodes.PREEMPTED)
    first = json.loads((out / "run.json").read_text())["trackers"]
    assert {"wandb", "tensorboard"} <= set(first)
    r = cli.run(out, *_args(), env=env)
    assert r.returncode == 0, r.stderr[-3000:]

    ids = json.loads((out / "run.json").read_text())["trackers"]
    assert ids["wandb"] == first["wandb"] and ids["mlflow"]
    if stop == "term":
        assert ids["mlflow"] == first["mlflow"]
    manifest = json.loads((out / "checkpoints" / "step-00000012" / "manifest.json").read_text())
    assert manifest["meta"]["trackers"] == ids  # travels with the checkpoint to a new VM

    ev = read_events(out)
    logged = {e["step"]: e["loss"] for e in ev if e["event"] == "step" and e["rank"] == 0}
    resumed_from = 4 if stop == "kill" else 7
    assert [e["from_step"] for e in ev if e["event"] == "resume"] == [resumed_from]

    # TensorBoard: each step once, with the values of the attempt that kept them
    tb = tb_scalars(out, "train/loss")
    assert [s for s, _ in tb] == list(range(1, 13))
    assert all(abs(v - logged[s]) < 1e-6 for s, v in tb)

    # W&B: one run id over both attempts; the second logs from the resume point on
    attempts = wandb_attempts(out, ids["wandb"])
    assert len(attempts) == 2 and {a["run_id"] for a in attempts} == {ids["wandb"]}
    second = sorted(s for s in attempts[1]["history"] if s > 0)
    assert second[0] == resumed_from + 1 and second[-1] >= 12 and second == sorted(set(second))
    assert attempts[1]["config"]  # the resolved config, once
    assert attempts[1]["exit_code"] == 0

    # MLflow: one run, finished, every step present; after SIGTERM none twice (after a
    # SIGKILL, 5..7 may hold both attempts' values: MLflow keeps every logged value)
    run, history, runs = mlflow_run(out, ids["mlflow"])
    assert len(runs) == 1 and run.info.status == "FINISHED"
    steps = [s for s, _ in history]
    assert sorted(set(steps)) == list(range(1, 13))
    if stop == "term":
        assert sorted(steps) == list(range(1, 13))
        assert run.data.tags.get("shoestring.preempted") == "true"
    assert run.data.params.get("train.lr") is not None


@pytest.mark.parametrize("name,package", [("mlflow", "mlflow-skinny"), ("wandb", "wandb")])
def test_a_missing_tracker_package_is_refused_before_anything_loads(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    name: str,
    package: str,
) -> None:
    """``track.to`` naming an uninstalled tracker: exit 2 with the install hint, before
    the model or the data is touched (``sys.modules[name] = None`` hides the package)."""
    from shoestring.cli import main

    monkeypatch.setitem(sys.modules, name, None)
    out = tmp_path / "run"
    assert main(["finetune", "--output_dir", str(out), *FAST, "--track.to", name]) == 2
    err = capsys.readouterr().err
    assert f"track.to: {name} needs the {package} package" in err
    assert "pip install 'shoestring[track]'" in err
    assert not out.exists()


@pytest.mark.e2e
def test_shoestring_runs_host_samples_reach_the_tracker(cli: CLI, tmp_path: Path) -> None:
    """`shoestring run` (no --run-dir: it watches the finetune's output_dir) samples the
    host every second; the run's TensorBoard shows them as system/ scalars."""
    out = tmp_path / "run"
    r = run_job(
        cli, out, 1, *FAST, "--track.to", "tensorboard", run_dir=False,
        run_args=("--metrics-interval", "0.5"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    samples = [e for e in read_events(out) if e["event"] == "metrics"]
    assert samples, "shoestring run wrote no host sample"
    cpu = tb_scalars(out, "system/cpu_pct")
    assert cpu and all(0 <= v <= 100 * 64 for _, v in cpu)
