"""End to end: ``--checkpoint.storage s3://…`` against a real S3-compatible server.

Every run is the ``shoestring finetune`` CLI in a subprocess; the server is moto's
standalone S3 server in another process (see ``s3server.py``), reached through
``AWS_ENDPOINT_URL`` exactly as a real bucket would be.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from s3server import S3Server, s3_server  # noqa: F401  (fixture)

MAX_STEPS = 12
EVERY = 4
KEEP = 2
SMALL = ["--train.max_steps", str(MAX_STEPS), "--train.batch_size", "4",
         "--train.num_threads", "1", "--checkpoint.every_steps", str(EVERY),
         "--checkpoint.keep", str(KEEP), "--eval.max_samples", "8", "--data.max_length", "32"]
RUN_TIMEOUT = 300
KILLED = -signal.SIGKILL
DATA_FILES = {"adapter.safetensors", "optimizer.safetensors", "rng_rank0.safetensors",
              "trainer_state.json"}


SRC = Path(__file__).resolve().parents[1] / "src"


# --------------------------------------------------------------------------- helpers
# `cache_dir` (the session's SHOESTRING_CACHE, tiny model materialized) is conftest's.
def _base_env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOESTRING_")}
    pythonpath = [str(SRC), *filter(None, [env.get("PYTHONPATH")])]
    env.update(SHOESTRING_CACHE=str(cache), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=os.pathsep.join(pythonpath))
    return env


def _cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "shoestring", "finetune", "--output_dir", str(out),
            *SMALL, *extra]


def _popen(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    fh = open(log, "wb")
    try:
        return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=fh,
                                stderr=subprocess.STDOUT)
    finally:
        fh.close()  # the child has its own copy


def _wait(proc: subprocess.Popen[bytes], log: Path) -> int:
    try:
        return proc.wait(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"run timed out after {RUN_TIMEOUT}s:\n{_tail(log)}")


def _tail(log: Path, n: int = 4000) -> str:
    try:
        return log.read_text(errors="replace")[-n:]
    except OSError:
        return "(no output)"


def run_cli(out: Path, env: dict[str, str], *extra: str, faults: str | None = None,
            log: Path | None = None) -> tuple[int, str]:
    env = dict(env)
    if faults:
        env["SHOESTRING_FAULTS"] = faults
    log = log or out.parent / f"{out.name}.{len(list(out.parent.glob(out.name + '.*.log')))}.log"
    proc = _popen(_cmd(out, *extra), env, log)
    return _wait(proc, log), _tail(log)


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


def remote_layout(srv: S3Server, prefix: str) -> dict[str, dict[str, int]]:
    """{step dir name: {file name: size}} under ``prefix/`` in the bucket."""
    layout: dict[str, dict[str, int]] = defaultdict(dict)
    for key, size in srv.list_keys(prefix.rstrip("/") + "/").items():
        rel = key[len(prefix.rstrip("/")) + 1:]
        d, _, name = rel.partition("/")
        layout[d][name] = size
    return dict(layout)


def committed(layout: dict[str, dict[str, int]]) -> list[str]:
    return sorted(d for d, files in layout.items() if "manifest.json" in files)


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def assert_remote_consistent(srv: S3Server, prefix: str) -> dict[str, dict[str, int]]:
    """Every committed remote step has each manifest-listed file at the listed size."""
    layout = remote_layout(srv, prefix)
    for d in committed(layout):
        manifest = json.loads(srv.get(f"{prefix}/{d}/manifest.json"))
        assert manifest["step"] == int(d.split("-")[1])
        listed = {name: int(e["size"]) for name, e in manifest["files"].items()}
        assert set(listed) == DATA_FILES, f"{d}: manifest lists {sorted(listed)}"
        have = {n: s for n, s in layout[d].items() if n != "manifest.json"}
        assert have == listed, f"{prefix}/{d}: bucket has {have}, manifest lists {listed}"
    return layout


class Reference:
    """The uninterrupted, local-only run, started in the background on first use."""

    def __init__(self, out: Path, env: dict[str, str]) -> None:
        self.out = out
        self.log = out.parent / "reference.log"
        self.proc = _popen(_cmd(out), env, self.log)
        self._sha: str | None = None

    def sha(self) -> str:
        if self._sha is None:
            rc = _wait(self.proc, self.log)
            assert rc == 0, f"reference run exited {rc}:\n{_tail(self.log)}"
            self._sha = sha256(self.out / "final" / "adapter_model.safetensors")
        return self._sha

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def s3_reference(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path):
    ref = Reference(tmp_path_factory.mktemp("s3-reference") / "out", _base_env(cache_dir))
    yield ref
    ref.stop()


@pytest.fixture
def s3_env(s3_server: S3Server, cache_dir: Path) -> dict[str, str]:  # noqa: F811
    return s3_server.child_env(_base_env(cache_dir))


# --------------------------------------------------------------------------- tests
def test_publish_and_retention(s3_server: S3Server, s3_env: dict[str, str],  # noqa: F811
                               s3_reference: Reference, tmp_path: Path) -> None:
    # `s3_reference` is requested here only to start it early: it trains alongside this run.
    prefix = "publish"
    out = tmp_path / "out"
    rc, log = run_cli(out, s3_env, "--checkpoint.storage", s3_server.url(prefix))
    assert rc == 0, log

    layout = assert_remote_consistent(s3_server, prefix)
    newest = [step_name(s) for s in range(MAX_STEPS, 0, -EVERY)][:KEEP]
    assert committed(layout) == sorted(newest)
    # Retention removes the whole remote dir, not only its manifest.
    assert sorted(layout) == sorted(newest), f"leftover remote dirs: {sorted(layout)}"
    # The remote copy is the locally committed checkpoint, byte for byte.
    for d in newest:
        local = out / "checkpoints" / d
        for name in [*DATA_FILES, "manifest.json"]:
            assert s3_server.get(f"{prefix}/{d}/{name}") == (local / name).read_bytes(), \
                f"{d}/{name} differs between local and remote"
    recs = [r for r in events(out) if r["event"] == "checkpoint"]
    assert [r["step"] for r in recs] == list(range(EVERY, MAX_STEPS + 1, EVERY))
    assert all(r["storage"] == s3_server.url(prefix) and r["upload_ms"] > 0 for r in recs)


def test_resume_from_remote_on_empty_disk(s3_server: S3Server,  # noqa: F811
                                          s3_env: dict[str, str], s3_reference: Reference,
                                          tmp_path: Path) -> None:
    prefix = "empty-disk"
    out = tmp_path / "out"
    # Synchronous saves: step 8 is published before step 9 ends.
    args = ["--checkpoint.storage", s3_server.url(prefix), "--checkpoint.async_mode", "off"]

    rc, log = run_cli(out, s3_env, *args, faults="step.end@9:kill")
    assert rc == KILLED, f"expected SIGKILL at step 9, got {rc}:\n{log}"
    layout = assert_remote_consistent(s3_server, prefix)
    assert committed(layout) == [step_name(4), step_name(8)]

    shutil.rmtree(out)  # a new machine: nothing on local disk
    rc, log = run_cli(out, s3_env, *args)
    assert rc == 0, log

    resumes = [r for r in events(out) if r["event"] == "resume"]
    assert len(resumes) == 1, resumes
    assert resumes[0]["source"] == "remote" and resumes[0]["from_step"] == 8, resumes[0]
    steps = [r["step"] for r in events(out) if r["event"] == "step"]
    assert steps == list(range(9, MAX_STEPS + 1))
    assert sha256(out / "final" / "adapter_model.safetensors") == s3_reference.sha()
    layout = assert_remote_consistent(s3_server, prefix)
    assert sorted(layout) == [step_name(8), step_name(12)]


def test_torn_remote_upload_is_ignored(s3_server: S3Server,  # noqa: F811
                                       s3_env: dict[str, str], s3_reference: Reference,
                                       tmp_path: Path) -> None:
    prefix = "torn"
    out = tmp_path / "out"
    args = ["--checkpoint.storage", s3_server.url(prefix)]  # background (thread) writer

    # The 2nd upload (step 8) dies after its data files, before its manifest.
    rc, log = run_cli(out, s3_env, *args, faults="upload.before_manifest@2")
    assert rc == KILLED, f"expected SIGKILL in the step-8 upload, got {rc}:\n{log}"
    layout = assert_remote_consistent(s3_server, prefix)
    assert committed(layout) == [step_name(4)]
    torn = layout.get(step_name(8), {})
    assert "manifest.json" not in torn and set(torn) == DATA_FILES, torn

    shutil.rmtree(out)
    rc, log = run_cli(out, s3_env, *args)
    assert rc == 0, log

    recs = events(out)
    resumes = [r for r in recs if r["event"] == "resume"]
    assert len(resumes) == 1, resumes
    assert resumes[0]["source"] == "remote" and resumes[0]["from_step"] == 4, resumes[0]
    # The manifest-less step was never tried, so never reported invalid.
    assert not [r for r in recs if r["event"] == "checkpoint_invalid"]
    assert [r["step"] for r in recs if r["event"] == "step"] == list(range(5, MAX_STEPS + 1))
    assert sha256(out / "final" / "adapter_model.safetensors") == s3_reference.sha()
    # Step 8 was re-published completely over the torn upload; step 4 aged out.
    layout = assert_remote_consistent(s3_server, prefix)
    assert sorted(layout) == [step_name(8), step_name(12)]
