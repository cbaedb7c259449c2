"""One job per run directory: an fcntl lock that dies with its holder."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import CLI, FAST
from shoestring import exitcodes
from shoestring.events import read_events
from shoestring.rundir import LOCK, RunDirBusy, hold


def test_a_second_holder_is_refused_naming_the_first(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with hold(run, "use another output_dir"):
        (run / "events.jsonl").write_text("")
        with pytest.raises(RunDirBusy) as e:
            with hold(run, "use another output_dir"):
                pass
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in str(e.value)
        assert str(run) in str(e.value) and "use another output_dir" in str(e.value)
    with hold(run, "x"):  # released on exit
        pass
    assert (run / "events.jsonl").exists()


def test_a_directory_the_job_left_empty_is_removed(tmp_path: Path) -> None:
    run = tmp_path / "new"
    with pytest.raises(ValueError), hold(run, "x"):
        raise ValueError("bad input, refused before anything was written")
    assert not run.exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    with hold(existing, "x"):
        pass
    assert existing.exists()  # not ours to remove


def test_a_sigkilled_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    run = tmp_path / "run"
    code = (
        "import sys, time; from pathlib import Path; from shoestring.rundir import hold\n"
        "with hold(Path(sys.argv[1]), 'x'):\n"
        "    print('held', flush=True); time.sleep(60)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code, str(run)], stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == b"held"
        with pytest.raises(RunDirBusy, match=f"pid {p.pid} "):
            with hold(run, "x"):
                pass
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert (run / LOCK).exists()  # the file stays; the lock died with its process
    with hold(run, "x"):
        pass


@pytest.mark.e2e
def test_a_second_finetune_on_a_busy_output_dir_exits_2_at_once(cli: CLI, tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, "-m", "shoestring", "finetune", "--output_dir", str(out), *FAST],
        env=cli.env(SHOESTRING_FAULTS="step.end@2:hang"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not (out / "events.jsonl").exists():  # the first job is past its start
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        t0 = time.monotonic()
        r = cli.run(out, *FAST)
        assert r.returncode == exitcodes.USAGE, r.stderr[-2000:]
        assert f"is in use: pid {first.pid} on host {socket.gethostname()}" in r.stderr
        assert time.monotonic() - t0 < 60  # refused before any model or data is loaded
        assert "Traceback" not in r.stderr
    finally:
        first.kill()
        first.wait()
    with hold(out, "x"):  # the killed job left no stale lock
        pass


@pytest.mark.parametrize("where", ["is_a_file", "under_a_file"])
def test_an_output_dir_that_cannot_be_a_directory_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    """A file where the run directory (or its parent) should be: one line naming the
    path, exit 2, before anything loads (was a FileExistsError traceback)."""
    from shoestring.cli import main

    blocker = tmp_path / "taken"
    blocker.write_text("a file")
    out = blocker if where == "is_a_file" else blocker / "run"
    assert main(["finetune", "--output_dir", str(out), *FAST]) == exitcodes.USAGE
    err = capsys.readouterr().err
    assert f"{out}: cannot be used as the run directory" in err and "Traceback" not in err
    assert blocker.read_text() == "a file"


HOLDER = (
    "import sys, time; from pathlib import Path; from shoestring.rundir import hold\n"
    "with hold(Path(sys.argv[1]), 'x'):\n"
    "    print('held', flush=True); time.sleep(60)\n"
)


def test_a_holder_whose_launcher_was_killed_is_named_an_exiting_orphan(tmp_path: Path) -> None:
    # A launcher (its command line names shoestring, as `shoestring run` and torchrun's
    # do) starts the holder, then is SIGKILLed: the holder lives on for a moment.
    run = tmp_path / "run"
    launcher = (
        "import subprocess, sys  # stands in for the shoestring run supervisor\n"
        "p = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]])\n"
        "print(p.pid, flush=True); p.wait()\n"
    )
    sup = subprocess.Popen(
        [sys.executable, "-c", launcher, HOLDER, str(run)], stdout=subprocess.PIPE, text=True
    )
    assert sup.stdout is not None
    holder = int(sup.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while not (run / LOCK).exists() or b"parents" not in (run / LOCK).read_bytes():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(RunDirBusy) as alive:
            with hold(run, "x"):
                pass
        assert f"pid {holder} " in str(alive.value) and "orphan" not in str(alive.value)
        sup.kill()
        sup.wait()
        with pytest.raises(RunDirBusy) as orphaned:
            with hold(run, "x"):
                pass
        assert (
            f"it is an orphan of a killed job (its launcher pid {sup.pid} is gone) and is "
            "exiting after its emergency save: retry in a few seconds"
        ) in str(orphaned.value)
    finally:
        os.kill(holder, signal.SIGKILL)


@pytest.mark.e2e
def test_a_killed_supervisor_preempts_its_job_which_saves_and_exits(
    cli: CLI, tmp_path: Path
) -> None:
    # `shoestring run` SIGKILLed (the OOM killer, kill -9): its job gets SIGHUP from the
    # kernel (once per supervisor thread: one notice, not "now"), saves where it is and
    # exits, instead of training on unwatched; the same command then resumes there.
    out = tmp_path / "run"
    job = [sys.executable, "-m", "shoestring", "finetune", "--output_dir", str(out), *FAST]
    sup = subprocess.Popen(
        [sys.executable, "-m", "shoestring", "run", "--run-dir", str(out), "--", *job],
        env=cli.env(SHOESTRING_FAULTS="step.forward@1:slow500"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 180
        while not any(e.get("event") == "step" for e in read_events(out / "events.jsonl")):
            assert sup.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        rank = json.loads((out / LOCK).read_text())["pid"]
        sup.kill()
        sup.wait()
        t0 = time.monotonic()
        while psutil.pid_exists(rank) and psutil.Process(rank).status() != "zombie":
            assert time.monotonic() - t0 < 60, "the job trained on after its supervisor died"
            time.sleep(0.1)
    finally:
        if sup.poll() is None:
            sup.kill()
    (pre,) = [e for e in read_events(out / "events.jsonl") if e["event"] == "preempt"]
    assert pre["saved"] is True and pre["step"] < 12
    r = subprocess.run(job, env=cli.env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (resumed,) = [e for e in read_events(out / "events.jsonl") if e["event"] == "resume"]
    assert resumed["from_step"] == pre["step"]
