"""A real single-node Slurm cluster for tests: munged + slurmctld + slurmd.

Everything lives under one temporary directory: the munge key and socket, the
slurm.conf, state and spool directories, pid and log files. Clients find the
cluster through ``SLURM_CONF`` (in :attr:`SlurmCluster.env`), and a job keeps
that variable because sbatch exports the submitting environment, so ``scontrol``
inside a job reaches the same controller. Nothing global is touched: the daemons
listen on free ports and munged on a private socket, so a system Slurm (or a
second test session) is not disturbed.

The daemons run as the current user (``SlurmUser``/``SlurmdUser``), root or not;
jobs then run as that user too. Works without systemd and without cgroups
(``proctrack/linuxproc``, ``task/none``), e.g. in a gVisor container. Needs the
Debian packages ``slurm-wlm`` and ``munge``; :func:`missing` says what is absent
so tests can skip with a reason.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

BINARIES = (
    "munged",
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "scontrol",
    "sinfo",
    "squeue",
    "scancel",
)


def missing() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


def _exe(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class SlurmCluster:
    root: Path
    host: str
    env: dict[str, str]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def run(
        self, *cmd: str, check: bool = True, timeout: float = 30, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(
            list(cmd),
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and r.returncode != 0:
            raise AssertionError(
                f"{' '.join(cmd)} exited {r.returncode}: {r.stdout}{r.stderr}\n{self.logs()}"
            )
        return r

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o``, as a dict (JobState, RestartCnt, ExitCode, Requeue ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        fields: dict[str, str] = {}
        for tok in out.split():
            k, sep, v = tok.partition("=")
            if sep:
                fields[k] = v
        return fields

    def node_state(self) -> str:
        """``sinfo``'s state of the one node: idle, allocated, completing, down ..."""
        return _node_state(self)

    def logs(self, tail: int = 60) -> str:
        parts = []
        for name in ("slurmctld", "slurmd", "munged"):
            p = self.root / f"{name}.log"
            text = p.read_text(errors="replace").splitlines()[-tail:] if p.exists() else []
            parts.append(f"--- {name}.log (last {tail} lines)\n" + "\n".join(text))
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel what still runs (a failed test's job), then stop the daemons."""
        if self.procs.get("slurmctld") is not None and self.procs["slurmctld"].poll() is None:
            try:
                ids = self.run("squeue", "-h", "-o", "%i", check=False, timeout=10).stdout.split()
                if ids:
                    self.run("scancel", *ids, check=False, timeout=10)
                    deadline = time.monotonic() + 15
                    while (
                        time.monotonic() < deadline
                        and self.run(
                            "squeue", "-h", "-o", "%i", check=False, timeout=10
                        ).stdout.strip()
                    ):
                        time.sleep(0.2)
            except subprocess.TimeoutExpired:
                pass
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def _slurm_conf(root: Path, host: str, munge_socket: Path) -> str:
    cpus = os.cpu_count() or 1
    user = pwd.getpwuid(os.geteuid()).pw_name
    return f"""\
ClusterName=shoestring-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
JobRequeue=1
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MinJobAge=600
KillWait=30
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def start(root: Path, timeout: float = 60) -> SlurmCluster:
    """Start munged, slurmctld and slurmd under ``root``; return once the node is idle."""
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)  # munged refuses group/world-writable directories
    for d in ("state", "spool", "munge"):
        (root / d).mkdir(exist_ok=True)
        os.chmod(root / d, 0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o600)
    munge_socket = root / "munge" / "munge.socket"
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root, host, munge_socket))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for k in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
        if k != "SLURM_CONF":
            del env[k]  # a test run inside a Slurm job must not talk to the outer cluster
    cluster = SlurmCluster(root, host, env)
    try:
        cluster.procs["munged"] = _spawn(
            root,
            "munged",
            [
                _exe("munged"),
                "-F",
                "-f",
                f"--socket={munge_socket}",
                f"--key-file={key}",
                f"--pid-file={root / 'munge' / 'munged.pid'}",
                f"--log-file={root / 'munged.log'}",
                f"--seed-file={root / 'munge' / 'munged.seed'}",
            ],
            env,
        )
        _wait_for(lambda: munge_socket.exists(), 10, "munged socket", cluster)
        cluster.procs["slurmctld"] = _spawn(
            root, "slurmctld", [_exe("slurmctld"), "-D", "-i", "-f", str(conf)], env
        )
        cluster.procs["slurmd"] = _spawn(
            root, "slurmd", [_exe("slurmd"), "-D", "-f", str(conf), "-N", host], env
        )
        _wait_for(lambda: _node_state(cluster) == "idle", timeout, "the node to be idle", cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _spawn(root: Path, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    out = open(root / f"{name}.stdout", "wb")
    try:
        return subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    finally:
        out.close()


def _node_state(cluster: SlurmCluster) -> str:
    try:
        r = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%T"],
            env=cluster.env,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except subprocess.TimeoutExpired:
        return ""
    return r.stdout.strip()


def _wait_for(ready: Callable[[], bool], timeout: float, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        for name, proc in cluster.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited {proc.returncode} while waiting for {what}:\n"
                    f"{_stdout(cluster, name)}\n{cluster.logs()}"
                )
        time.sleep(0.2)
    raise RuntimeError(
        f"timed out after {timeout:.0f}s waiting for {what} "
        f"(sinfo: {_node_state(cluster)!r}):\n{cluster.logs()}"
    )


def _stdout(cluster: SlurmCluster, name: str) -> str:
    p = cluster.root / f"{name}.stdout"
    return p.read_text(errors="replace")[-4000:] if p.exists() else ""


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A running single-node cluster for the session; skips when Slurm is not installed."""
    absent = missing()
    if absent:
        pytest.skip(
            f"Slurm is not installed (missing {', '.join(absent)}); "
            "apt-get install -y slurm-wlm munge"
        )
    try:
        cluster = start(tmp_path_factory.mktemp("slurm"))
    except RuntimeError as first:  # e.g. a free port taken meanwhile: once more, new ports
        print(f"Slurm did not start; retrying once:\n{first}")
        cluster = start(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.stop()
