"""End to end: ``--checkpoint.storage s3://…`` against a real S3-compatible server.

Every run is the ``shoestring finetune`` CLI in a subprocess; the server is moto's
standalone S3 server in another process (see ``s3server.py``), reached through
``AWS_ENDPOINT_URL`` exactly as a real bucket would be.

Each CLI start costs seconds of imports, so the scenarios (each a short sequence of
runs under its own bucket prefix) are launched together by a module fixture, two
processes at a time, and each test asserts on its scenario's recorded outcome.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from s3server import S3Server  # the session fixture s3_server comes from conftest

MAX_STEPS = 12
EVERY = 4
KEEP = 2
SMALL = [
    "--train.max_steps",
    str(MAX_STEPS),
    "--train.batch_size",
    "4",
    "--train.num_threads",
    "1",
    "--checkpoint.every_steps",
    str(EVERY),
    "--checkpoint.keep",
    str(KEEP),
    "--eval.max_samples",
    "8",
    "--data.max_length",
    "32",
]
RUN_TIMEOUT = 300
PARALLEL = 2  # CLI processes at once (each trains with one thread)
KILLED = -signal.SIGKILL
DATA_FILES = {
    "adapter.safetensors",
    "optimizer.safetensors",
    "rng_rank0.safetensors",
    "trainer_state.json",
}
SRC = Path(__file__).resolve().parents[1] / "src"
ADAPTER = Path("final") / "adapter_model.safetensors"

Layout = dict[str, dict[str, int]]  # {step dir: {file name: size}}


# --------------------------------------------------------------------------- helpers
def step_name(step: int) -> str:
    return f"step-{step:08d}"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def events(out: Path) -> list[dict[str, Any]]:
    recs = []
    for line in (out / "events.jsonl").read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by a kill
    return recs


DATA_CACHE = "data-cache"  # the tokenized data the run publishes beside its checkpoints
ATTEMPT_LOGS = "events"  # each attempt's event log (checkpoint/attemptlog.py)


def remote_layout(srv: S3Server, prefix: str) -> Layout:
    """The checkpoint dirs under ``prefix`` (the published data cache and the attempts'
    event logs are not)."""
    layout: Layout = defaultdict(dict)
    for key, size in srv.list_keys(prefix + "/").items():
        d, _, name = key[len(prefix) + 1 :].partition("/")
        if d not in (DATA_CACHE, ATTEMPT_LOGS):
            layout[d][name] = size
    return dict(layout)


def committed(layout: Layout) -> list[str]:
    return sorted(d for d, files in layout.items() if "manifest.json" in files)


def check_remote(srv: S3Server, prefix: str) -> Layout:
    """Every committed remote step has each manifest-listed file at the listed size."""
    layout = remote_layout(srv, prefix)
    for d in committed(layout):
        manifest = json.loads(srv.get(f"{prefix}/{d}/manifest.json"))
        assert manifest["step"] == int(d.split("-")[1])
        listed = {name: int(e["size"]) for name, e in manifest["files"].items()}
        assert set(listed) == DATA_FILES, f"{prefix}/{d}: manifest lists {sorted(listed)}"
        have = {n: s for n, s in layout[d].items() if n != "manifest.json"}
        assert have == listed, f"{prefix}/{d}: bucket has {have}, manifest lists {listed}"
    return layout


@dataclass
class Run:
    rc: int
    log: str


@dataclass
class Outcome:
    """What one scenario did: its runs, the bucket between them, its output dir."""

    out: Path
    prefix: str = ""
    runs: list[Run] = field(default_factory=list)
    layout_after_kill: Layout | None = None


class Launcher:
    """Runs the CLI in subprocesses with the session's model cache; kills leftovers."""

    def __init__(self, cache: Path, srv: S3Server) -> None:
        base = {k: v for k, v in os.environ.items() if not k.startswith("SHOESTRING_")}
        pythonpath = [str(SRC), *filter(None, [base.get("PYTHONPATH")])]
        base.update(
            SHOESTRING_CACHE=str(cache),
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
            TOKENIZERS_PARALLELISM="false",
            PYTHONPATH=os.pathsep.join(pythonpath),
        )
        self.local_env = base
        self.s3_env = srv.child_env(base)
        self._live: set[subprocess.Popen[bytes]] = set()
        self._lock = threading.Lock()
        self.closing = False

    def run(self, out: Path, *args: str, s3: bool = True, faults: str = "") -> Run:
        env = dict(self.s3_env if s3 else self.local_env)
        if faults:
            env["SHOESTRING_FAULTS"] = faults
        log = out.parent / f"{out.name}.run{len(list(out.parent.glob('*.log')))}.log"
        cmd = [
            sys.executable,
            "-m",
            "shoestring",
            "finetune",
            "--output_dir",
            str(out),
            *SMALL,
            *args,
        ]
        with open(log, "wb") as fh, self._lock:
            if self.closing:
                raise RuntimeError("test module finished; not starting another run")
            proc = subprocess.Popen(
                cmd, env=env, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT
            )
            self._live.add(proc)
        try:
            rc = proc.wait(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = None
        finally:
            with self._lock:
                self._live.discard(proc)
        text = log.read_text(errors="replace")[-4000:]
        if rc is None:
            raise AssertionError(f"{' '.join(cmd)}: timed out after {RUN_TIMEOUT}s:\n{text}")
        return Run(rc, text)

    def kill_all(self) -> None:
        with self._lock:
            self.closing = True
            for proc in self._live:
                if proc.poll() is None:
                    proc.kill()


# --------------------------------------------------------------------------- scenarios
def scenario_reference(cli: Launcher, srv: S3Server, root: Path) -> Outcome:
    """Uninterrupted, local storage only."""
    o = Outcome(root / "out")
    o.runs.append(cli.run(o.out, s3=False))
    return o


def scenario_publish(cli: Launcher, srv: S3Server, root: Path) -> Outcome:
    o = Outcome(root / "out", "publish")
    o.runs.append(cli.run(o.out, "--checkpoint.storage", srv.url(o.prefix)))
    return o


def scenario_empty_disk(cli: Launcher, srv: S3Server, root: Path) -> Outcome:
    """Killed after step 8 was published; rerun on an empty disk."""
    o = Outcome(root / "out", "empty-disk")
    # Synchronous saves: step 8 is committed and published before step 9 ends.
    args = ["--checkpoint.storage", srv.url(o.prefix), "--checkpoint.async_mode", "off"]
    o.runs.append(cli.run(o.out, *args, faults="step.end@9:kill"))
    if o.runs[-1].rc != KILLED:
        return o
    o.layout_after_kill = remote_layout(srv, o.prefix)
    shutil.rmtree(o.out)  # a new machine: nothing on local disk
    o.runs.append(cli.run(o.out, *args))
    return o


def scenario_torn(cli: Launcher, srv: S3Server, root: Path) -> Outcome:
    """Killed inside the 2nd upload (step 8), between its data files and its manifest."""
    o = Outcome(root / "out", "torn")
    args = ["--checkpoint.storage", srv.url(o.prefix)]  # default background (thread) writer
    o.runs.append(cli.run(o.out, *args, faults="upload.before_manifest@2"))
    if o.runs[-1].rc != KILLED:
        return o
    o.layout_after_kill = remote_layout(srv, o.prefix)
    shutil.rmtree(o.out)
    o.runs.append(cli.run(o.out, *args))
    return o


SCENARIOS: dict[str, Callable[[Launcher, S3Server, Path], Outcome]] = {
    # Submission order = start order: the one-run scenarios first, then the two-run ones.
    "reference": scenario_reference,
    "publish": scenario_publish,
    "empty_disk": scenario_empty_disk,
    "torn": scenario_torn,
}


# The scenarios each test reads; only those of the selected tests are run.
NEEDS = {
    "test_publish_and_retention": {"publish", "reference"},
    "test_resume_from_remote_on_empty_disk": {"empty_disk", "reference"},
    "test_torn_remote_upload_is_ignored": {"torn", "reference"},
}


@pytest.fixture(scope="module")
def scenarios(
    request: pytest.FixtureRequest,
    s3_server: S3Server,
    cache_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Future[Outcome]]]:
    """The selected tests' scenarios, started at once, PARALLEL processes at a time.

    ``cache_dir`` (SHOESTRING_CACHE with the tiny model materialized) comes from conftest.
    """
    wanted: set[str] = set()
    for item in request.session.items:
        if getattr(item, "module", None) is request.module:
            wanted |= NEEDS.get(getattr(item, "originalname", item.name), set(SCENARIOS))
    cli = Launcher(cache_dir, s3_server)
    pool = ThreadPoolExecutor(max_workers=PARALLEL, thread_name_prefix="s3-scenario")
    futures = {
        name: pool.submit(fn, cli, s3_server, tmp_path_factory.mktemp(f"s3-{name}"))
        for name, fn in SCENARIOS.items()
        if name in wanted
    }
    try:
        yield futures
    finally:
        for f in futures.values():
            f.cancel()
        cli.kill_all()
        pool.shutdown(wait=True)


def outcome(scenarios: dict[str, Future[Outcome]], name: str) -> Outcome:
    return scenarios[name].result(timeout=4 * RUN_TIMEOUT)


def reference_sha(scenarios: dict[str, Future[Outcome]]) -> str:
    ref = outcome(scenarios, "reference")
    assert ref.runs[0].rc == 0, f"reference run exited {ref.runs[0].rc}:\n{ref.runs[0].log}"
    return sha256(ref.out / ADAPTER)


# --------------------------------------------------------------------------- tests
def test_publish_and_retention(scenarios: dict[str, Future[Outcome]], s3_server: S3Server) -> None:
    o = outcome(scenarios, "publish")
    assert o.runs[0].rc == 0, o.runs[0].log

    layout = check_remote(s3_server, o.prefix)
    newest = sorted(step_name(s) for s in range(MAX_STEPS, 0, -EVERY)[:KEEP])
    assert committed(layout) == newest
    # Retention removes the whole remote dir, not only its manifest.
    assert sorted(layout) == newest, f"leftover remote dirs: {sorted(layout)}"
    # The remote copy is the locally committed checkpoint, byte for byte.
    for d in newest:
        for name in [*DATA_FILES, "manifest.json"]:
            assert (
                s3_server.get(f"{o.prefix}/{d}/{name}")
                == (o.out / "checkpoints" / d / name).read_bytes()
            ), f"{d}/{name}: local != remote"
    recs = [r for r in events(o.out) if r["event"] == "checkpoint"]
    assert [r["step"] for r in recs] == list(range(EVERY, MAX_STEPS + 1, EVERY))
    assert all(r["storage"] == s3_server.url(o.prefix) and r["upload_ms"] > 0 for r in recs)
    # Publishing does not change training.
    assert sha256(o.out / ADAPTER) == reference_sha(scenarios)


@pytest.mark.slow  # tests/test_launch.py's fresh machine resumes from the bucket (CI time)
def test_resume_from_remote_on_empty_disk(
    scenarios: dict[str, Future[Outcome]], s3_server: S3Server
) -> None:
    o = outcome(scenarios, "empty_disk")
    assert o.runs[0].rc == KILLED, (
        f"expected SIGKILL at step 9, got {o.runs[0].rc}:\n{o.runs[0].log}"
    )
    assert o.layout_after_kill is not None
    assert committed(o.layout_after_kill) == [step_name(4), step_name(8)]
    assert o.runs[1].rc == 0, o.runs[1].log

    recs = events(o.out)
    resumes = [r for r in recs if r["event"] == "resume"]
    assert len(resumes) == 1, resumes
    assert resumes[0]["source"] == "remote" and resumes[0]["from_step"] == 8, resumes[0]
    assert [r["step"] for r in recs if r["event"] == "step"] == list(range(9, MAX_STEPS + 1))
    assert sha256(o.out / ADAPTER) == reference_sha(scenarios)
    layout = check_remote(s3_server, o.prefix)
    assert sorted(layout) == [step_name(8), step_name(12)]
    # Each machine's attempt left its event log beside the checkpoints; the second one
    # copied the first's: it knows the last step logged there (8: the kill came before
    # step 9's record) and its cost ledger counts both attempts.
    logs = [k for k in s3_server.list_keys(f"{o.prefix}/{ATTEMPT_LOGS}/") if k.endswith(".jsonl")]
    assert len(logs) == 2, logs
    assert resumes[0]["last_logged_step"] == 8, resumes[0]
    cost = [r for r in recs if r["event"] == "cost"][-1]
    assert cost["attempts"] == 2, cost


def test_torn_remote_upload_is_ignored(
    scenarios: dict[str, Future[Outcome]], s3_server: S3Server
) -> None:
    o = outcome(scenarios, "torn")
    assert o.runs[0].rc == KILLED, (
        f"expected SIGKILL in the step-8 upload, got {o.runs[0].rc}:\n{o.runs[0].log}"
    )
    after_kill = o.layout_after_kill
    assert after_kill is not None
    assert committed(after_kill) == [step_name(4)]
    torn = after_kill.get(step_name(8), {})
    assert "manifest.json" not in torn and set(torn) == DATA_FILES, torn
    assert o.runs[1].rc == 0, o.runs[1].log

    recs = events(o.out)
    resumes = [r for r in recs if r["event"] == "resume"]
    assert len(resumes) == 1, resumes
    assert resumes[0]["source"] == "remote" and resumes[0]["from_step"] == 4, resumes[0]
    # The manifest-less step was never tried, so never reported invalid.
    assert not [r for r in recs if r["event"] == "checkpoint_invalid"]
    assert [r["step"] for r in recs if r["event"] == "step"] == list(range(5, MAX_STEPS + 1))
    assert sha256(o.out / ADAPTER) == reference_sha(scenarios)
    # Step 8 was re-published completely over the torn upload; step 4 aged out.
    layout = check_remote(s3_server, o.prefix)
    assert sorted(layout) == [step_name(8), step_name(12)]


def test_unreachable_bucket_fails_before_training(
    s3_server: S3Server, cache_dir: Path, tmp_path: Path
) -> None:
    env = s3_server.child_env(
        dict(os.environ), SHOESTRING_CACHE=str(cache_dir), PYTHONPATH=str(SRC)
    )
    env.pop("SHOESTRING_FAULTS", None)
    out = tmp_path / "out"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "shoestring",
            "finetune",
            "--output_dir",
            str(out),
            *SMALL,
            "--checkpoint.storage",
            "s3://no-such-bucket/x",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert r.returncode == 2, r.stderr
    assert "checkpoint.storage: cannot use 's3://no-such-bucket/x'" in r.stderr
    assert not (out / "checkpoints").exists()
