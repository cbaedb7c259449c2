"""``shoestring slurm``: the sbatch script, the requeue decision, and a real requeue.

The last test submits a fine-tune to a real single-node Slurm (tests/slurmcluster.py),
delivers the warning signal the way ``--signal=B:USR1`` does (to the batch shell
only), and checks that the job checkpoints, requeues itself under the same job id,
resumes with no step lost and ends with the adapter of an uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from conftest import CLI, FAST, read_events, sha256
from shoestring import exitcodes
from shoestring.cli import main
from shoestring.supervise.config import RunConfig
from shoestring.supervise.launch import LaunchSpec, Nodes, launch_argv
from shoestring.supervise.slurm import grace_from_events, requeue_after_signal, time_limit_s
from slurmcluster import SlurmCluster, slurm_cluster  # noqa: F401  (session fixture)

#: A finetune config for the script tests.
CONFIG = """\
output_dir: run
train: {max_steps: 40, batch_size: 4, num_threads: 1, warmup_steps: 2}
checkpoint: {every_steps: 5, keep: 3}
data: {max_length: 32, eval: ""}
"""


def render(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *flags: str
) -> str:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG)
    monkeypatch.chdir(tmp_path)
    assert main(["slurm", "--config", str(cfg), *flags]) == exitcodes.OK
    return capsys.readouterr().out


def directives(script: str) -> list[str]:
    return [line.split(" ", 1)[1] for line in script.splitlines() if line.startswith("#SBATCH ")]


def last_command(script: str) -> list[str]:
    """The script's final command line (continuations joined), as argv."""
    body = script.replace("\\\n", " ").splitlines()
    return shlex.split([line for line in body if line.strip()][-1])


# --------------------------------------------------------------------------- the script


def test_single_node_script(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    script = render(
        tmp_path,
        capsys,
        monkeypatch,
        "--gpus-per-node",
        "4",
        "--time",
        "04:00:00",
        "--partition",
        "gpu",
        "--account",
        "acme",
        "--cpus-per-task",
        "16",
        "--sbatch-arg=--mem=64G",
        "--train.max_steps",
        "50",
    )
    run = tmp_path / "run"
    assert directives(script) == [
        "--job-name=shoestring-run",
        "--nodes=1",
        "--ntasks-per-node=1",
        "--gpus-per-node=4",
        "--cpus-per-task=16",
        "--time=04:00:00",
        "--partition=gpu",
        "--account=acme",
        "--requeue",
        "--signal=B:USR1@120",
        "--open-mode=append",
        f"--output={run}/slurm-%j.out",
        f"--error={run}/slurm-%j.err",
        f"--chdir={tmp_path}",
        "--mem=64G",
    ]
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    argv = last_command(script)
    py = [sys.executable, "-m", "shoestring"]
    sep = argv.index("--")
    # The batch shell becomes `shoestring run` (exec, no srun on one node), so the B:
    # signal reaches it, and only it, and it forwards the signal once.
    assert argv[:sep] == [
        "exec",
        *py,
        "run",
        "--nproc-per-node",
        "4",
        "--max-restarts",
        "3",
        "--run-dir",
        str(run),
    ]
    assert argv[sep + 1 :] == [
        *py,
        "finetune",
        "--config",
        str(tmp_path / "cfg.yaml"),
        "--train.max_steps",
        "50",
        "--output_dir",
        str(run),
    ]
    assert script.count("exec ") == 1 and "\ntrap " not in script and "exec srun" not in script


TOKEN = "sk-planted-0123456789abcdef"


def test_secret_values_reach_the_job_through_the_environment_not_the_script(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A credential on the command line (a webhook, a URL with a password) is not written
    into the script, which bash may print, copy or keep for months; the script reads it
    from the environment sbatch hands the job, and the job gets the live value."""
    hook = f"https://bob:{TOKEN}@mlflow.example.com/"
    store = f"sftp://bob:{TOKEN}@host/ckpt"
    script = render(
        tmp_path, capsys, monkeypatch, "--track.mlflow_uri", hook, "--checkpoint.storage", store
    )
    assert TOKEN not in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    assert "SHOESTRING_SECRET_1 = the value of --track.mlflow_uri" in script
    assert "SHOESTRING_SECRET_2 = the value of --checkpoint.storage" in script
    # Run the script's last command with `printf` in place of exec'ing the job: the
    # words the job would get, as bash expands them in the job's environment.
    body = script.replace("\\\n", " ").splitlines()
    last = [line for line in body if line.strip()][-1].removeprefix("exec ")
    env = {"PATH": os.environ["PATH"], "SHOESTRING_SECRET_1": hook, "SHOESTRING_SECRET_2": store}
    got = subprocess.run(
        ["bash", "-c", f"printf '%s\\n' {last}"], env=env, capture_output=True, text=True
    )
    words = got.stdout.splitlines()
    assert words[words.index("--track.mlflow_uri") + 1] == hook
    assert words[words.index("--checkpoint.storage") + 1] == store
    # Without the variable the job stops at once, naming it.
    del env["SHOESTRING_SECRET_2"]
    got = subprocess.run(
        ["bash", "-c", f"printf '%s\\n' {last}"], env=env, capture_output=True, text=True
    )
    assert got.returncode != 0 and "SHOESTRING_SECRET_2: is not set" in got.stderr


def test_multi_node_script_and_rendezvous(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    script = render(tmp_path, capsys, monkeypatch, "--nodes", "2", "--gpus-per-node", "8")
    assert "--nodes=2" in directives(script) and "--gpus-per-node=8" in directives(script)
    argv = last_command(script)
    assert argv[:6] == [
        "exec",
        "srun",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=0",
        "--gpus-per-node=8",
    ]
    # What each node's `shoestring run` then starts, given the variables srun sets there.
    sep = argv.index("--")
    env = {
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_JOB_ID": "4242",
    }
    nodes = Nodes.resolve(RunConfig(), env)
    torchrun = launch_argv(LaunchSpec(tuple(argv[sep + 1 :]), nproc_per_node=8, nodes=nodes))
    joined = " ".join(torchrun)
    for part in (
        "--nproc-per-node 8",
        "--nnodes 2",
        "--rdzv-endpoint gpu07:29400",
        "--rdzv-id 4242",
        "--rdzv-conf is_host=0",
        "--no-python",
    ):
        assert part in joined


def test_signal_follows_preempt_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    script = render(tmp_path, capsys, monkeypatch, "--preempt.signal", "SIGUSR2", "--grace", "300")
    assert "--signal=B:USR2@300" in directives(script)
    assert last_command(script)[-4:-2] == ["--preempt.signal", "SIGUSR2"]
    assert main(["slurm", "--config", "cfg.yaml", "--preempt.signal", "none"]) == exitcodes.USAGE
    assert "preempt.signal is 'none'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, error",
    [
        (["--time", "00:01:30"], "warning would come before the job starts"),
        (["--time", "4h"], "not a Slurm time limit"),
        (["--nodes", "0"], "--nodes: 'nodes' must be >= 1"),
        (["--train.lr", "fast"], "train.lr"),
    ],
)
def test_bad_flags_exit_2(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    error: str,
) -> None:
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    monkeypatch.chdir(tmp_path)
    assert main(["slurm", "--config", "cfg.yaml", *flags]) == exitcodes.USAGE
    assert error in capsys.readouterr().err


def test_time_limits() -> None:
    assert [
        time_limit_s(t)
        for t in ("90", "1:30", "04:00:00", "1-12", "1-0:30", "2-00:00:10", "UNLIMITED")
    ] == [5400, 90, 14400, 129600, 88200, 172810, None]


def test_grace_from_measured_saves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert grace_from_events([])[0] == 120
    steps = [{"event": "step", "step_ms": 2000.0}]
    ckpt = [{"event": "checkpoint", "blocking_ms": 500.0, "background_ms": 40000.0}]
    assert grace_from_events(steps + ckpt)[0] == 115  # 2 x (2 + 40.5) + 30
    preempt = [{"event": "preempt", "saved": True, "notice_to_commit_ms": 90000.0}]
    assert grace_from_events(steps + ckpt + preempt)[0] == 210  # 2 x 90 + 30
    assert grace_from_events(steps)[0] == 60  # never below the minimum
    # The CLI reads the run directory's log from an earlier run.
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in steps + ckpt) + '{"torn'
    )
    script = render(tmp_path, capsys, monkeypatch)
    assert "--signal=B:USR1@115" in directives(script)
    assert "step + save took up to 42.5 s" in script


# --------------------------------------------------------------------------- requeue decision


class FakeScontrol:
    def __init__(self, show: str = "JobId=7 Requeue=1 BatchFlag=1", rc: int = 0) -> None:
        self.show, self.rc, self.calls = show, rc, []

    def __call__(self, argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv[1:])
        out = self.show if argv[1] == "show" else ""
        return subprocess.CompletedProcess(
            argv, self.rc if argv[1] == "requeue" else 0, out, "requeue refused" if self.rc else ""
        )


SLURM = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_RESTART_COUNT": "2"}


@pytest.mark.parametrize(
    "policy, env, sig, rc, show, requeued, event",
    [
        ("auto", SLURM, signal.SIGUSR1, 75, "Requeue=1 BatchFlag=1", True, "requeue"),
        ("auto", SLURM, signal.SIGUSR2, 76, "Requeue=1 BatchFlag=1", True, "requeue"),
        ("auto", SLURM, signal.SIGTERM, 75, "Requeue=1 BatchFlag=1", False, "no_requeue"),
        ("auto", SLURM, signal.SIGUSR1, 1, "Requeue=1 BatchFlag=1", True, "requeue"),  # torchrun
        ("auto", SLURM, signal.SIGUSR1, 2, "Requeue=1 BatchFlag=1", False, "no_requeue"),
        ("auto", SLURM, signal.SIGUSR1, 75, "Requeue=0 BatchFlag=1", False, "no_requeue"),
        ("auto", SLURM, signal.SIGUSR1, 75, "Requeue=1 BatchFlag=0", False, "no_requeue"),
        ("never", SLURM, signal.SIGUSR1, 75, "Requeue=1 BatchFlag=1", False, None),
        ("auto", {}, signal.SIGUSR1, 75, "Requeue=1 BatchFlag=1", False, None),
        (
            "auto",
            {**SLURM, "SLURM_PROCID": "1"},
            signal.SIGUSR1,
            75,
            "Requeue=1 BatchFlag=1",
            False,
            None,
        ),
    ],
)
def test_requeue_decision(
    policy: str,
    env: dict[str, str],
    sig: int,
    rc: int,
    show: str,
    requeued: bool,
    event: str | None,
) -> None:
    fake = FakeScontrol(show)
    events: list[tuple[str, dict[str, Any]]] = []
    got = requeue_after_signal(
        policy, env, sig, rc, emit=lambda e, **f: events.append((e, f)), run=fake
    )
    assert got is requeued
    assert (["requeue", "7"] in fake.calls) is requeued
    assert [e for e, _ in events] == ([event] if event else [])
    if event:
        assert events[0][1]["job_id"] == "7" and events[0][1]["restart_count"] == 2


def test_refused_requeue_is_recorded() -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    assert not requeue_after_signal(
        "auto",
        SLURM,
        signal.SIGUSR1,
        75,
        run=FakeScontrol(rc=1),
        emit=lambda e, **f: events.append((e, f)),
    )
    assert [e for e, _ in events] == ["requeue", "no_requeue"]
    assert events[1][1]["scontrol_rc"] == 1 and "requeue refused" in events[1][1]["reason"]


def test_a_requeue_whose_scontrol_slurm_kills_is_done_not_refused() -> None:
    """A successful requeue ends the job at once: Slurm's SIGTERM can reach scontrol
    before it exits (seen in CI on the real cluster). That is no refusal."""
    events: list[tuple[str, dict[str, Any]]] = []
    assert requeue_after_signal(
        "auto",
        SLURM,
        signal.SIGUSR1,
        75,
        run=FakeScontrol(rc=-signal.SIGTERM),
        emit=lambda e, **f: events.append((e, f)),
    )
    assert [e for e, _ in events] == ["requeue"]


CHILD = """\
import signal, sys, time, pathlib
signal.signal(signal.SIGUSR1, lambda *a: sys.exit(75))
signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))
pathlib.Path(sys.argv[1]).write_text("ready")
time.sleep(60)
"""


def test_supervisor_requeues_after_warning(tmp_path: Path) -> None:
    """`shoestring run` inside a (pretend) Slurm job, with a stand-in scontrol on PATH."""
    bindir, out, ready = tmp_path / "bin", tmp_path / "run", tmp_path / "ready"
    bindir.mkdir()
    calls = tmp_path / "scontrol.calls"
    (bindir / "scontrol").write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\n'
        '[ "$1" = show ] && echo "JobId=31 Requeue=1 BatchFlag=1"\n'
        "exit 0\n"
    )
    (bindir / "scontrol").chmod(0o755)
    (tmp_path / "child.py").write_text(CHILD)
    env = {
        **os.environ,
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "31",
        "SLURM_PROCID": "0",
        "PYTHONPATH": str(Path(__file__).parents[1] / "src"),
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shoestring",
            "run",
            "--no-watch",
            "--run-dir",
            str(out),
            "--",
            sys.executable,
            str(tmp_path / "child.py"),
            str(ready),
        ],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == exitcodes.PREEMPTED, err
    assert calls.read_text().splitlines() == ["show job -o 31", "requeue 31"], err
    req = [e for e in read_events(out) if e["event"] == "requeue"]
    assert [(e["job_id"], e["signal"], e["exit_code"], e["rank"]) for e in req] == [
        ("31", "SIGUSR1", 75, -1)
    ]


@pytest.mark.parametrize("flags, policy", [([], "auto"), (["--slurm-requeue", "never"], "never")])
def test_run_flag_reaches_the_supervisor(
    monkeypatch: pytest.MonkeyPatch, flags: list[str], policy: str
) -> None:
    from shoestring.supervise.supervisor import Supervisor

    seen: list[str] = []
    monkeypatch.setattr(Supervisor, "run", lambda self: seen.append(self.cfg.slurm_requeue) or 0)
    assert main(["run", *flags, "--", "true"]) == 0 and seen == [policy]


# --------------------------------------------------------------------------- real Slurm


def _wait(what: str, cond: Any, cluster: SlurmCluster, timeout: float = 180) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}\n{cluster.logs()}")


def test_real_slurm_requeue_resumes_exactly(
    slurm_cluster: SlurmCluster,  # noqa: F811
    cli: CLI,
    reference: dict[str, str],
    tmp_path: Path,
) -> None:
    cluster = slurm_cluster
    (tmp_path / "cfg.yaml").write_text("output_dir: run\n")
    # FAST's 12 steps, each forward made 4x slower (a sleep: the numbers do not change)
    # so that the signal surely lands mid-run; sbatch passes the environment on.
    env = cli.env(SLURM_CONF=cluster.env["SLURM_CONF"], SHOESTRING_FAULTS="step.forward@1:slow300")
    sub = subprocess.run(
        [
            sys.executable,
            "-m",
            "shoestring",
            "slurm",
            "--config",
            "cfg.yaml",
            "--gpus-per-node",
            "0",
            "--cpus-per-task",
            "1",
            "--time",
            "10",
            "--submit",
            *FAST,
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip()
    out = tmp_path / "run"

    def log() -> str:
        p = out / f"slurm-{job}.err"
        return (p.read_text(errors="replace") if p.exists() else "") + "\n" + cluster.logs()

    def stepped() -> bool:
        if cluster.job(job)["JobState"] not in ("PENDING", "RUNNING"):
            raise AssertionError(f"job ended before the signal: {cluster.job(job)}\n{log()}")
        return any(e["event"] == "step" and e["step"] >= 2 for e in read_events(out))

    _wait("step 2", stepped, cluster)
    # What --signal=B:USR1 does before the time limit: USR1 to the batch shell only.
    cluster.run("scancel", "--signal=USR1", "--batch", job)

    def requeued() -> dict[str, str] | None:
        info = cluster.job(job)
        restarts = info.get("Restarts", info.get("RestartCnt"))  # renamed in later Slurm
        if restarts == "1" and info["JobState"] == "PENDING":
            return info
        assert info["JobState"] in ("RUNNING", "COMPLETING", "REQUEUED", "PENDING"), (
            f"{info}\n{log()}"
        )
        return None

    info = _wait("the requeue", requeued, cluster, timeout=60)
    seen = time.time()
    # Slurm holds a requeued job back about two minutes; a test need not wait that long,
    # but must let the node finish the old run: slurmd revokes the job id's credentials
    # as of the kill, to the second, so a relaunch within that second is refused
    # ("Job N already killed, do not launch batch job") and the job fails.
    # The hold is the job's begin time moved on; its Reason reads BeginTime only once the
    # scheduler's next pass has looked at it (None until then).
    assert info["Reason"] in ("BeginTime", "None"), info
    held = datetime.fromisoformat(info["EligibleTime"]) - datetime.now()
    assert held.total_seconds() > 30, info
    _wait("the node to be idle", lambda: cluster.node_state() == "idle", cluster, timeout=60)
    time.sleep(max(0.0, math.floor(seen) + 1.1 - time.time()))
    cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    done = _wait(
        "the job to finish",
        lambda: (
            cluster.job(job)
            if cluster.job(job)["JobState"] not in ("PENDING", "RUNNING", "COMPLETING")
            else None
        ),
        cluster,
    )
    assert (done["JobState"], done["ExitCode"], done.get("Restarts", done.get("RestartCnt"))) == (
        "COMPLETED",
        "0:0",
        "1",
    ), f"{done}\n{log()}"

    ev = read_events(out)
    kinds = [e["event"] for e in ev]
    assert (
        kinds.count("preempt"),
        kinds.count("requeue"),
        kinds.count("resume"),
        kinds.count("no_requeue"),
    ) == (1, 1, 1, 0)
    preempt = next(e for e in ev if e["event"] == "preempt")
    assert preempt["reason"] == "SIGUSR1" and preempt["saved"] and preempt["step"] < 12
    assert [e["exit_code"] for e in ev if e["event"] == "attempt_end"] == [75, 0]
    req = next(e for e in ev if e["event"] == "requeue")
    assert (req["job_id"], req["signal"], req["exit_code"], req["restart_count"]) == (
        job,
        "SIGUSR1",
        75,
        0,
    )
    resume = next(e for e in ev if e["event"] == "resume")
    assert resume["from_step"] == preempt["step"] and resume["steps_lost"] == 0
    assert (
        kinds.index("preempt")
        < kinds.index("requeue")
        < kinds.index("resume")
        < kinds.index("run_end")
    )
    # One log, appended across the requeue: both starts of the same job id.
    banners = [line.split() for line in log().splitlines() if line.startswith("shoestring: job ")]
    assert [b[2:5] for b in banners] == [[job, "start", "0"], [job, "start", "1"]]
    assert (
        sha256(out / "final" / "adapter_model.safetensors")
        == reference["final/adapter_model.safetensors"]
    )
