"""``shoestring launch``: a SkyPilot managed-job task, checked by SkyPilot itself.

SkyPilot pins ``click<8.2``, which shoestring's huggingface-hub cannot use, so it lives in
an interpreter of its own: ``SHOESTRING_SKY_PYTHON`` (default ``<repo>/.venv-sky/bin/python``;
create it with ``python3 -m venv .venv-sky && .venv-sky/bin/pip install skypilot==0.14.1``).
The task YAML is parsed there by ``sky.Task.from_yaml`` and submitted by its ``sky`` CLI.
A missing interpreter fails these tests, unless ``SHOESTRING_SKY_TESTS=off`` says to
skip them (a machine that cannot install SkyPilot).

"A new VM after a preemption", locally: the task's ``run`` script, as written, runs in a
fresh empty directory against the suite's S3 server, is SIGTERMed (exit 75, emergency
checkpoint in the bucket), and runs again in another fresh directory: it resumes from
the bucket, ends byte-identical to an uninterrupted run, and the ledger counts both
attempts. SkyPilot's part (finding the machine, running ``setup``) needs a cloud.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import FAST
from s3server import S3Server
from shoestring.cli import main
from shoestring.gpus import CATALOG

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
TOKEN = "hf_PLANTEDsecretTOKEN0123456789"  # must appear nowhere written
SMALL = FAST  # the suite's short run: `reference_run` is its uninterrupted result


def sky_python() -> Path:
    """SkyPilot's own interpreter; fails (not skips) when missing, unless opted out."""
    p = Path(os.environ.get("SHOESTRING_SKY_PYTHON") or REPO / ".venv-sky" / "bin" / "python")
    if p.is_file():
        return p
    if os.environ.get("SHOESTRING_SKY_TESTS") == "off":
        pytest.skip("SHOESTRING_SKY_TESTS=off: SkyPilot checks skipped")
    pytest.fail(
        f"no SkyPilot interpreter at {p}: create it with `python3 -m venv .venv-sky && "
        ".venv-sky/bin/pip install skypilot==0.14.1` (SkyPilot pins click<8.2, so it cannot "
        "share shoestring's venv), or set SHOESTRING_SKY_PYTHON; SHOESTRING_SKY_TESTS=off skips"
    )


def launch(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``shoestring launch ARGS`` in this process (the env is this process's)."""
    rc = main(["launch", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


SKY_READ = """\
import json, sys
import sky
task = sky.Task.from_yaml(sys.argv[1])
filled = sky.Task.from_yaml_config(
    __import__("yaml").safe_load(open(sys.argv[1])), secrets_overrides=[("HF_TOKEN", "v")]
)
damaged = __import__("yaml").safe_load(open(sys.argv[1]))
damaged["resources"]["ordered"][0]["accelerator"] = "L4"  # a misspelt key
try:
    sky.Task.from_yaml_config(damaged)
    rejected = ""
except Exception as e:
    rejected = str(e)
res = [
    {"accelerators": r.accelerators, "use_spot": r.use_spot, "job_recovery": r.job_recovery}
    for r in task.resources
]
print(json.dumps({
    "name": task.name,
    "resources": res,
    "ordered": isinstance(task.resources, list),
    "envs": task.envs,
    "secret_refs": [ref.name for ref in task._managed_secret_refs],
    "secrets_after_override": sorted(filled.secrets),
    "setup": task.setup,
    "workdir": task.workdir,
    "run": task.run,
    "rejected": rejected,
}))
"""


def sky_read(task_yaml: Path, home: Path) -> dict[str, Any]:
    r = subprocess.run(
        [str(sky_python()), "-c", SKY_READ, str(task_yaml)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": os.environ.get("PATH", ""), "HOME": str(home)},
    )
    assert r.returncode == 0, f"SkyPilot refused the task:\n{r.stderr[-3000:]}"
    doc: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return doc


def test_task_yaml_is_read_by_skypilot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio.internal:9000")
    task = tmp_path / "task.yaml"
    rc, out, err = launch(
        capsys,
        "--checkpoint.storage",
        "s3://bucket/runs/x",
        "--output",
        str(task),
        "--env",
        "AWS_ENDPOINT_URL",
        "--max-restarts-on-errors",
        "1",
        *SMALL,
    )
    assert rc == 0, err
    text = task.read_text()
    assert TOKEN not in text + out + err
    doc = sky_read(task, tmp_path)
    assert "accelerator" in doc["rejected"]  # the parser is strict: a misspelt key fails
    # The builtin model fits every GPU of the catalog: the three cheapest spot ones, in order.
    cheapest = sorted(CATALOG.values(), key=lambda g: g.spot_usd_h)[:3]
    names = {"A100-40GB": "A100"}
    assert doc["ordered"] is True
    assert [list(r["accelerators"]) for r in doc["resources"]] == [
        [names.get(g.name, g.name)] for g in cheapest
    ]
    assert all(r["use_spot"] for r in doc["resources"])
    recovery = doc["resources"][0]["job_recovery"]
    assert recovery["max_restarts_on_errors"] == 1
    assert sorted(recovery["recover_on_exit_codes"]) == [75, 76]
    assert recovery["strategy"] == "EAGER_NEXT_REGION"
    assert doc["envs"] == {"AWS_ENDPOINT_URL": "http://minio.internal:9000"}
    # HF_TOKEN travels as a secret reference, filled in by `sky jobs launch --secret`.
    assert doc["secret_refs"] == ["HF_TOKEN"]
    assert doc["secrets_after_override"] == ["HF_TOKEN"]
    # Run from this checkout: SkyPilot syncs it as the workdir and setup installs it.
    assert doc["workdir"] == str(REPO)
    assert "pip install --upgrade '.[s3,gcs]'" in doc["setup"]
    assert "shoestring finetune --config finetune.yaml" in doc["run"]
    assert "--checkpoint.storage s3://bucket/runs/x --resume auto" in doc["run"]


def test_named_gpus_and_on_demand(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("HF_TOKEN", "WANDB_API_KEY", "SHOESTRING_ALERT_WEBHOOK"):
        monkeypatch.delenv(name, raising=False)
    rc, out, err = launch(
        capsys,
        "--checkpoint.storage",
        "gs://b/x",
        "--gpu",
        "A100-80GB",
        "--gpu",
        "l4",
        "--no-spot",
        "--dry-run",
    )
    assert rc == 0, err
    doc = yaml.safe_load(out)
    assert doc["resources"]["use_spot"] is False
    assert doc["resources"]["ordered"] == [
        {"accelerators": {"A100-80GB": 1}},
        {"accelerators": {"L4": 1}},
    ]
    assert "secrets" not in doc
    assert "market: on_demand" in doc["run"]  # the ledger charges what was asked for
    rc, out, err = launch(capsys, "--checkpoint.storage", "gs://b/x", "--gpu", "L4",
                          "--install", "shoestring[gcs]==0.1.0", "--dry-run")  # fmt: skip
    doc = yaml.safe_load(out)
    assert rc == 0 and "workdir" not in doc  # a named package: nothing to sync
    assert "pip install --upgrade 'shoestring[gcs]==0.1.0'" in doc["setup"]


def test_a_wheel_install_sets_up_this_version_from_the_index(tmp_path: Path) -> None:
    from shoestring import __version__
    from shoestring.supervise.sky import default_install

    wheel = tmp_path / "site-packages" / "shoestring" / "supervise" / "sky.py"
    assert default_install(str(wheel)) == (f"shoestring[s3,gcs]=={__version__}", "")
    assert default_install(str(SRC / "shoestring" / "supervise" / "sky.py")) == (
        ".[s3,gcs]",
        str(REPO),
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--checkpoint.storage", "/tmp/ckpt"], "is not a bucket URL"),
        ([], "is not a bucket URL"),
        (["--checkpoint.storage", "s3://b/x", "--model.path", "."], "is a folder on this machine"),
        (["--checkpoint.storage", "s3://b/x", "--gpu", "V99"], "gpu: unknown GPU 'V99'"),
        (["--checkpoint.storage", "s3://b/x", "--env", "MY_API_KEY"], "looks like a credential"),
        (["--checkpoint.storage", "s3://b/x", "--secret", "NOT_SET_ANYWHERE"], "not set"),
        (
            ["--checkpoint.storage", "s3://b/x", "--yes", "--sky", "/no/sky"],
            "pipx install skypilot",
        ),
    ],
)
def test_bad_input_exits_2(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    rc, out, err = launch(capsys, *args)
    assert rc == 2 and message in err, err
    assert out == ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.e2e
def test_yes_submits_through_skypilots_cli(tmp_path: Path) -> None:
    """``--yes`` runs SkyPilot's own ``sky jobs launch`` on the task. No cloud or API
    server here: SkyPilot parses the YAML and the flags (``--secret HF_TOKEN`` read from
    the environment), then fails to reach its API server, which is as far as a machine
    without an account goes. A task it refuses fails earlier, with another message."""
    sky = sky_python().parent / "sky"
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp_path),
        "PYTHONPATH": str(SRC),
        "HF_TOKEN": TOKEN,
        "SKYPILOT_API_SERVER_ENDPOINT": f"http://127.0.0.1:{free_port()}",
    }
    task = tmp_path / "task.yaml"
    cmd = [sys.executable, "-m", "shoestring", "launch", "--checkpoint.storage", "s3://b/x"]
    cmd += ["--yes", "--sky", str(sky), "--output", str(task)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 1, r.stderr
    assert (
        f"jobs launch {task} --yes --detach-run --name shoestring-finetune --secret HF_TOKEN"
        in (r.stderr)
    )
    assert "Could not connect to SkyPilot API server" in r.stderr, r.stderr[-3000:]
    assert "Invalid" not in r.stderr and "Usage:" not in r.stderr
    assert TOKEN not in task.read_text() + r.stdout + r.stderr


# --------------------------------------------------------------------------- a new VM


def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def records(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


class Machine:
    """A fresh machine SkyPilot would give the job: an empty working directory, the task's
    envs and secrets in the environment, ``shoestring`` on PATH (what setup installs)."""

    def __init__(self, root: Path, task: dict[str, Any], env: dict[str, str]) -> None:
        root.mkdir(parents=True)
        self.root = root
        bin_dir = root.parent / f"{root.name}-bin"
        bin_dir.mkdir()
        shim = bin_dir / "shoestring"  # the console script `pip install shoestring` writes
        shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m shoestring "$@"\n')
        shim.chmod(0o755)
        self.env = {**env, **task.get("envs", {}), "PATH": f"{bin_dir}:{env['PATH']}"}
        self.run_script = task["run"]

    @property
    def run_dir(self) -> Path:
        return self.root / "finetune"

    def start(self) -> subprocess.Popen[str]:
        return subprocess.Popen(
            ["bash", "-c", self.run_script],
            cwd=self.root,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )


def write_task(tmp: Path, storage: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    path = tmp / f"{storage.rsplit('/', 1)[-1]}.sky.yaml"
    rc, _out, err = launch(
        capsys,
        "--checkpoint.storage",
        storage,
        "--output",
        str(path),
        "--env",
        "AWS_ENDPOINT_URL",
        "--secret",
        "AWS_ACCESS_KEY_ID",
        "--secret",
        "AWS_SECRET_ACCESS_KEY",
        *SMALL,
    )
    assert rc == 0, err
    assert TOKEN not in path.read_text()
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    return doc


def wait_step(m: Machine, proc: subprocess.Popen[str], step: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(
            r["event"] == "step" and r["step"] >= step for r in records(m.run_dir / "events.jsonl")
        ):
            return
        assert proc.poll() is None, f"exited {proc.returncode} before step {step}"
        time.sleep(0.1)
    raise AssertionError(f"no step {step} in {timeout} s")


def test_preempted_job_resumes_on_a_fresh_machine(
    tmp_path: Path,
    s3_server: S3Server,
    cache_dir: Path,
    reference_run: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # a secret the job gets and must write nowhere
    job = s3_server.url("launch-job")
    task = write_task(tmp_path, job, capsys)
    assert task["secrets"] == {
        "AWS_ACCESS_KEY_ID": None,
        "AWS_SECRET_ACCESS_KEY": None,
        "HF_TOKEN": None,
    }
    env = s3_server.child_env(
        {k: v for k, v in os.environ.items() if not k.startswith("SHOESTRING_")},
        SHOESTRING_CACHE=str(cache_dir),
        PYTHONPATH=str(SRC),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_TOKEN=TOKEN,  # what `--secret HF_TOKEN` hands the job
    )
    first = Machine(tmp_path / "vm1", task, env)
    p1 = first.start()
    wait_step(first, p1, 6)
    p1.send_signal(signal.SIGTERM)  # the shutdown of a preempted machine
    log1 = p1.communicate(timeout=180)[0]
    assert p1.returncode == 75, log1[-3000:]
    stopped = [r for r in records(first.run_dir / "events.jsonl") if r["event"] == "preempt"]
    assert stopped and stopped[0]["saved"], stopped
    at = stopped[0]["step"]
    assert f"launch-job/step-{at:08d}/manifest.json" in s3_server.list_keys("launch-job/")

    second = Machine(tmp_path / "vm2", task, env)  # another machine: an empty disk
    p2 = second.start()
    log2 = p2.communicate(timeout=300)[0]
    assert p2.returncode == 0, log2[-3000:]
    recs = records(second.run_dir / "events.jsonl")
    resumed = [r for r in recs if r["event"] == "resume"]
    assert resumed and resumed[0]["source"] == "remote" and resumed[0]["from_step"] == at
    adapter = Path("final") / "adapter_model.safetensors"
    # The same as `shoestring finetune` with these flags, uninterrupted, on one disk.
    assert sha256(second.run_dir / adapter) == sha256(reference_run / adapter)

    # One ledger across both machines: the bucket holds each attempt's log.
    attempts = [k for k in s3_server.list_keys("launch-job/events/") if k.endswith(".jsonl")]
    assert len(attempts) == 2, attempts
    cost = [r for r in recs if r["event"] == "cost"][-1]
    assert cost["attempts"] == 2 and cost["preemptions"] == 1, cost
    assert cost["steps"] == 12 and cost["steps_recomputed"] == 0, cost
    from shoestring.report.ledger import compute
    from shoestring.report.timeline import load

    alone = compute(load(first.run_dir))
    assert 0 < alone.wall_hours < cost["wall_hours"]  # the first attempt's time is in it
    # After the job (its machines gone): the report from the bucket alone.
    monkeypatch.chdir(tmp_path)
    assert main(["report", job, "-o", str(tmp_path / "job.html")]) == 0
    assert "2 attempt log(s)" in capsys.readouterr().out
    whole = compute(load(tmp_path / "launch-job.report"))
    assert (whole.attempts, whole.preemptions, whole.steps) == (2, 1, 12)
    assert "preemption" in (tmp_path / "job.html").read_text()

    # No secret in the logs, the run directories or the bucket.
    assert TOKEN not in log1 + log2
    for d in (first.root, second.root):
        for f in d.rglob("*"):
            if f.is_file():
                assert TOKEN.encode() not in f.read_bytes(), f
    for key in s3_server.list_keys("launch-job/"):
        assert TOKEN.encode() not in s3_server.get(key), key


def test_attempt_logs_travel_through_the_store(tmp_path: Path) -> None:
    """Each machine uploads only the records its attempt appended; a start copies the
    other machines' logs (another run id), never its own, into OUTPUT/attempts/."""
    from shoestring.checkpoint import RemoteStore
    from shoestring.checkpoint.attemptlog import AttemptLog
    from shoestring.events import EventLog
    from shoestring.report.timeline import load
    from shoestring.rundir import RunDir

    store = RemoteStore(str(tmp_path / "bucket"))
    a, b = RunDir(tmp_path / "vm1"), RunDir(tmp_path / "vm2")
    a.root.mkdir()
    with EventLog(a.events, run_id="aaa") as ev:  # an earlier attempt on the same disk
        ev.emit("start", process_start=1.0)
        ev.emit("step", step=1)
    first = AttemptLog.open(store, a, "aaa")
    with EventLog(a.events, run_id="aaa") as ev:
        ev.emit("start", process_start=2.0)
        ev.emit("step", step=2)
    first.push()
    (obj,) = (tmp_path / "bucket" / "events").glob("aaa-*.jsonl")
    assert [json.loads(x)["step"] for x in obj.read_text().splitlines() if '"step"' in x] == [2]
    assert AttemptLog.open(store, a, "aaa").pull(a.attempts, "aaa") == []  # its own: no
    b.root.mkdir()
    AttemptLog.open(store, b, "bbb")
    assert [p.name for p in b.attempts.iterdir()] == [obj.name]
    with EventLog(b.events, run_id="bbb") as ev:
        ev.emit("start", process_start=3.0)
        ev.emit("step", step=3)
    tl = load(b.root)
    assert [e.get("step") for e in tl.of("step")] == [2, 3]
    assert len(tl.attempts) == 2


def test_a_notice_then_the_shutdowns_sigterm_is_one_stop() -> None:
    """On a spot VM the cloud's notice (watched) and the shutdown's SIGTERM (sent by the
    VM going down, which is what a preemption under SkyPilot looks like) both arrive: one
    emergency save, not the hard stop a second signal means."""
    from shoestring.preempt import PreemptionFlag, SignalSource

    flag, exits = PreemptionFlag(), []
    with SignalSource(flag, hard_exit=exits.append):
        flag.set("gcp preemption (instance/preempted=TRUE)")  # the notice watcher
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert exits == [] and flag.reason.startswith("gcp")
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal: stop now, exit 76
        time.sleep(0.05)
    assert exits == [76]
