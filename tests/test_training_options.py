"""Training options that must not break exactness: gradient checkpointing, packing,
gradient accumulation, time-based saves, --resume PATH."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from conftest import CLI, FAST, read_events, state_digest


def test_gradient_checkpointing_matches_plain_run(
    cli: CLI, tmp_path: Path, reference: dict[str, str]
) -> None:
    out = tmp_path / "gc"
    r = cli.run(out, *FAST, "--model.gradient_checkpointing", "true")
    assert r.returncode == 0, r.stderr
    # Recompute replays dropout with the saved RNG state, so the update is the same bits.
    assert state_digest(out, 12) == reference


@pytest.mark.slow  # packing + resume: tests/test_data_e2e.py; accumulation + resume: DDP/FSDP tests
def test_packing_text_data_with_grad_accum_resumes_exactly(cli: CLI, tmp_path: Path) -> None:
    data = tmp_path / "text.jsonl"
    words = ["spot", "gpu", "cheap", "resume", "adapter", "token", "shard", "bucket"]
    with open(data, "w") as f:
        for i in range(300):
            f.write(json.dumps({"text": " ".join(words[(i * k) % 8] for k in range(1, 9))}) + "\n")
    args = [
        *FAST,
        "--data.train",
        str(data),
        "--data.packing",
        "true",
        "--train.batch_size",
        "8",
        "--train.micro_batch_size",
        "4",
    ]
    ref = tmp_path / "ref"
    assert cli.run(ref, *args).returncode == 0
    steps = [e for e in read_events(ref) if e["event"] == "step"]
    assert all(e["tokens"] == 8 * 32 for e in steps)  # packed blocks, no padding
    out = tmp_path / "run"
    # Killed right after the step-4 checkpoint commits: the rerun must resume from it (a
    # kill at a step's end could beat a slow save; a rerun from scratch also ends equal).
    assert (
        cli.run(out, *args, env={"SHOESTRING_FAULTS": "ckpt.after_rename@1:kill"}).returncode
        == -signal.SIGKILL
    )
    r = cli.run(out, *args)
    assert r.returncode == 0, r.stderr
    assert [e["from_step"] for e in read_events(out) if e["event"] == "resume"] == [4]
    assert state_digest(out, 12) == state_digest(ref, 12)


def test_time_based_saves_and_resume_from_path(
    cli: CLI, tmp_path: Path, reference: dict[str, str]
) -> None:
    out = tmp_path / "run"
    r = cli.run(
        out,
        *FAST,
        "--checkpoint.every_steps",
        "0",
        "--checkpoint.every_seconds",
        "0.000001",
        "--checkpoint.keep",
        "20",
    )
    assert r.returncode == 0, r.stderr
    ck = [e for e in read_events(out) if e["event"] == "checkpoint"]
    assert [e["step"] for e in ck] == list(range(1, 13))
    assert {e["reason"] for e in ck} == {"seconds"}
    # --resume PATH continues from exactly that checkpoint, in another output dir.
    other = tmp_path / "from-path"
    r = cli.run(other, *FAST, "--resume", str(out / "checkpoints" / "step-00000005"))
    assert r.returncode == 0, r.stderr
    res = [e for e in read_events(other) if e["event"] == "resume"]
    assert res[0]["from_step"] == 5 and res[0]["source"] == "path"
    assert state_digest(other, 12) == reference


def test_longer_max_steps_on_resume_uses_the_new_schedule() -> None:
    # train.max_steps may change on resume; the next step's lr must come from the new
    # cosine schedule, not from the param group saved under the old one.
    import torch

    from shoestring.train.learner import Learner, lr_lambda
    from shoestring.train.state import _load_schedule

    def learner(opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LambdaLR) -> Learner:
        return Learner(None, torch.nn.Module(), {}, opt, sched, None)

    def make(total: int) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(2, total, 0.1))

    opt, sched = make(8)
    for _ in range(6):
        opt.step()
        sched.step()
    saved = {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"}
    opt2, sched2 = make(12)
    opt2.load_state_dict(opt.state_dict())  # carries the old schedule's lr
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    _load_schedule({"scheduler": saved, "scaler": None}, learner(opt2, sched2))
    assert opt2.param_groups[0]["lr"] == 1e-3 * lr_lambda(2, 12, 0.1)(6)
    assert opt2.param_groups[0]["lr"] != opt.param_groups[0]["lr"]
    # Unchanged max_steps: the same value as before (exact resume is untouched).
    opt3, sched3 = make(8)
    opt3.load_state_dict(opt.state_dict())
    _load_schedule({"scheduler": saved, "scaler": None}, learner(opt3, sched3))
    assert opt3.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
