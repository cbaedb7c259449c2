"""Slurm: an sbatch script for a fine-tune, and the requeue after a warning signal.

Slurm sends nothing before a job's time limit unless asked: ``--signal=B:USR1@G``
sends USR1 to the batch shell G seconds before it (the man page allows it to
come up to 60 s earlier). ``--requeue`` lets the job go back to the queue
with the same job id. Together with ``shoestring run`` this gives:

    time limit - G  USR1 -> the batch shell, which has exec'd into ``shoestring run``
                    (one node) or srun (several) -> the ranks finish the step,
                    commit an emergency checkpoint, exit 75
    shoestring run  (on the first node) sees the job end after the forwarded USR1
                    and runs ``scontrol requeue $SLURM_JOB_ID`` (:func:`requeue_after_signal`)
    requeued job    runs the same script again; ``--resume auto`` picks up the
                    checkpoint; the log files are appended to (``--open-mode=append``)

A SIGTERM is deliberately not requeued: it is what ``scancel`` and the time limit send,
and under ``PreemptMode=REQUEUE`` Slurm requeues the job itself.
"""

from __future__ import annotations

import logging
import math
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoestring import exitcodes
from shoestring.events import read_tail
from shoestring.rundir import RunDir
from shoestring.secrets import redact_text
from shoestring.supervise.config import time_limit_s

if TYPE_CHECKING:
    from shoestring.config import Invocation
    from shoestring.supervise.config import SlurmConfig

__all__ = [
    "SbatchOptions",
    "grace_from_events",
    "render",
    "requeue_after_signal",
    "run_slurm",
    "time_limit_s",
]

log = logging.getLogger("shoestring.run")

#: Seconds of warning when nothing was measured: room for a step and a multi-GB save.
DEFAULT_GRACE_S = 120
#: Never ask for less: a measured save is a small sample (the next one may meet a busy
#: filesystem), and a warning that comes too early costs only that much compute.
MIN_GRACE_S = 60
#: Added to the measured (step + emergency save) x 2: requeue, process exit, log flush.
GRACE_MARGIN_S = 30

#: preempt.signal of the fine-tune config -> the name sbatch --signal takes.
SIGNAL_NAMES = {"SIGUSR1": "USR1", "SIGUSR2": "USR2"}

#: The warning signals ``shoestring run`` requeues after (never SIGTERM: see above).
REQUEUE_SIGNALS = frozenset({signal.SIGUSR1, signal.SIGUSR2})

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


# --------------------------------------------------------------------------- the script


@dataclass(frozen=True)
class SbatchOptions:
    """Everything the script says. Paths are absolute: the job may start in another
    directory and, after a requeue, hours later."""

    run_dir: Path
    workdir: Path
    shoestring: tuple[str, ...]  # how to invoke shoestring on the compute nodes
    finetune_args: tuple[str, ...] = ()  # --config FILE and dotted overrides
    job_name: str = "shoestring"
    nodes: int = 1
    gpus_per_node: int = 1  # 0: CPU-only (no --gpus-per-node), one rank per node
    cpus_per_task: int | None = None  # CPUs for one node's whole `shoestring run`
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    warn_signal: str = "USR1"  # sbatch's name for preempt.signal
    grace_s: int = DEFAULT_GRACE_S
    grace_why: str = f"default {DEFAULT_GRACE_S} s (no measured save)"
    max_restarts: int = 3
    extra: tuple[str, ...] = ()  # more "#SBATCH" options, verbatim

    @property
    def nproc_per_node(self) -> int:
        return max(self.gpus_per_node, 1)


def _slurm_path(p: Path) -> str:
    return str(p).replace("%", "%%")  # sbatch expands %j etc. in --output/--error


def _directives(o: SbatchOptions) -> list[str]:
    """The #SBATCH options."""
    d = [f"--job-name={o.job_name}", f"--nodes={o.nodes}", "--ntasks-per-node=1"]
    if o.gpus_per_node > 0:
        d.append(f"--gpus-per-node={o.gpus_per_node}")
    if o.cpus_per_task:
        d.append(f"--cpus-per-task={o.cpus_per_task}")
    if o.time:
        d.append(f"--time={o.time}")
    if o.partition:
        d.append(f"--partition={o.partition}")
    if o.account:
        d.append(f"--account={o.account}")
    return d + [
        "--requeue",
        f"--signal=B:{o.warn_signal}@{o.grace_s}",
        "--open-mode=append",
        f"--output={_slurm_path(o.run_dir)}/slurm-%j.out",
        f"--error={_slurm_path(o.run_dir)}/slurm-%j.err",
        f"--chdir={o.workdir}",
        *o.extra,
    ]


def _launch(o: SbatchOptions, cont: str) -> tuple[str, str]:
    """How the warning signal reaches the job (a comment block) and the exec line."""
    q = shlex.quote
    run = [
        *o.shoestring,
        "run",
        "--nproc-per-node",
        str(o.nproc_per_node),
        "--max-restarts",
        str(o.max_restarts),
        "--run-dir",
        str(o.run_dir),
    ]
    if o.nodes == 1:
        return SINGLE_NODE.format(sig=o.warn_signal), f"exec {' '.join(map(q, run))}"
    # --kill-on-bad-exit=0: the other nodes exit 75 too, and a cluster-wide
    # KillOnBadExit=1 could kill node 0's `shoestring run` before it has requeued.
    srun = ["srun", f"--nodes={o.nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=0"]
    if o.cpus_per_task:  # srun >= 22.05 no longer inherits --cpus-per-task from sbatch
        srun.append(f"--cpus-per-task={o.cpus_per_task}")
    if o.gpus_per_node > 0:
        srun.append(f"--gpus-per-node={o.gpus_per_node}")
    launch = f"exec {' '.join(map(q, srun))}{cont}{' '.join(map(q, run))}"
    return MULTI_NODE.format(sig=o.warn_signal), launch


@dataclass(frozen=True)
class HiddenSecrets:
    """The finetune arguments as the script writes them: each one holding a credential
    (what :func:`redact_text` would change: a signed URL, a webhook) becomes a reference
    to an environment variable, and ``env`` maps those variables to the live values.
    sbatch hands the submitting environment to the job (``--export=ALL``, its default),
    and Slurm keeps it for every requeue, so the job gets the values and the file none."""

    words: tuple[str, ...]  # shell words, quoted
    env: dict[str, str]  # variable -> live value
    knobs: dict[str, str]  # variable -> the option it is the value of

    @classmethod
    def of(cls, args: Iterable[str]) -> HiddenSecrets:
        words: list[str] = []
        env: dict[str, str] = {}
        knobs: dict[str, str] = {}
        prev = ""
        for a in args:
            if redact_text(a) == a:
                words.append(shlex.quote(a))
            else:
                name = f"{SECRET_PREFIX}{len(env) + 1}"
                env[name], knobs[name] = a, prev if prev.startswith("--") else a.split("=")[0]
                words.append(f'"${{{name}:?is not set: export it before sbatch}}"')
            prev = a
        return cls(tuple(words), env, knobs)

    def comment(self) -> str:
        """The script's note on where its secret values come from ("" when none)."""
        if not self.env:
            return ""
        lines = [f"#   {v} = the value of {self.knobs[v]}" for v in self.env]
        return (
            "# Secrets are not written here: these come from the environment sbatch was\n"
            "# run in (Slurm keeps it for requeues):\n" + "\n".join(lines) + "\n"
        )


#: Variables that carry the finetune arguments' secret values into the job.
SECRET_PREFIX = "SHOESTRING_SECRET_"


def render(o: SbatchOptions) -> str:
    """The batch script. ``bash -n`` clean; every value shell-quoted; no credential."""
    q = shlex.quote
    d = _directives(o)
    secrets = HiddenSecrets.of(o.finetune_args)
    head = " ".join(map(q, [*o.shoestring, "finetune"]))
    tail = " ".join(map(q, ["--output_dir", str(o.run_dir)]))
    job = " ".join([head, *secrets.words, tail])
    cont = " \\\n    "
    how, launch = _launch(o, cont)
    return f"""#!/bin/bash
# Generated by `shoestring slurm`. Submit with: sbatch THIS_FILE
{chr(10).join("#SBATCH " + x for x in d)}
{secrets.comment()}
# Warning signal: {o.warn_signal} {o.grace_s} s before the time limit; {o.grace_why}.
#
# With B: Slurm signals only this batch shell, and bash cannot pass a signal on
# while it waits for a foreground child: it runs a trap only after the child
# exits, and an untrapped {o.warn_signal} simply kills bash, ending the job with no
# checkpoint. So the last line *execs*: this shell process becomes the program
# that receives the signal itself. Nothing may follow the exec: it never returns.
{how}set -euo pipefail
echo "shoestring: job ${{SLURM_JOB_ID}} start ${{SLURM_RESTART_COUNT:-0}} on $(hostname)" \\
     "at $(date -u +%Y-%m-%dT%H:%M:%SZ)" >&2
{launch}{cont}-- {job}
"""


SINGLE_NODE = """\
#
# One node: no srun. `shoestring run` gets the {sig} and forwards it once to the
# job; the ranks finish the step, commit an emergency checkpoint and exit 75;
# `shoestring run` then runs `scontrol requeue $SLURM_JOB_ID`, so the job comes
# back with the same id, runs this script again and resumes from that
# checkpoint (--resume auto).
"""

MULTI_NODE = """\
#
# Several nodes: this shell becomes srun, which forwards the {sig} to its step:
# one `shoestring run` per node, each starting torchrun with --nnodes
# $SLURM_NNODES --node-rank $SLURM_NODEID and the c10d rendezvous on the first
# node of $SLURM_JOB_NODELIST (shoestring/supervise/launch.py). Slurm signals
# every process of a step, so the ranks get the signal both directly and through
# `shoestring run` (see docs/slurm.md, "Several nodes"); they checkpoint and
# exit, and `shoestring run` on the first node requeues the job.
"""


# --------------------------------------------------------------------------- grace


def grace_from_events(records: Iterable[Mapping[str, Any]]) -> tuple[int, str]:
    """Seconds of warning the job needs, and why, from a previous run's event log.

    Needs: finishing the step in flight + the emergency save, doubled (the disk or
    the object store may be slower next time), + a margin for the requeue. The
    emergency save is measured directly by ``preempt`` records (``notice_to_commit_ms``
    includes the step); otherwise a periodic save (``checkpoint``: blocking +
    background or seal) stands in for it. The longest of each is used.
    """
    step_ms = notice_ms = save_ms = 0.0
    for r in records:
        ev = r.get("event")
        if ev == "step":
            step_ms = max(step_ms, float(r.get("step_ms") or 0))
        elif ev == "preempt" and r.get("saved"):
            notice_ms = max(notice_ms, float(r.get("notice_to_commit_ms") or 0))
        elif ev == "checkpoint":
            total = sum(float(r.get(k) or 0) for k in ("blocking_ms", "background_ms", "seal_ms"))
            save_ms = max(save_ms, total)
    needed_s = max(notice_ms, step_ms + save_ms) / 1000
    if needed_s <= 0:
        return DEFAULT_GRACE_S, f"default {DEFAULT_GRACE_S} s (no measured save)"
    grace = max(MIN_GRACE_S, math.ceil(2 * needed_s + GRACE_MARGIN_S))
    what = (
        f"emergency save took up to {needed_s:.1f} s"
        if notice_ms
        else f"step + save took up to {needed_s:.1f} s"
    )
    return min(grace, 65535), (
        f"{what} in the last run, so 2 x that + {GRACE_MARGIN_S} s (at least {MIN_GRACE_S} s)"
    )


def recent_records(path: Path) -> list[dict[str, Any]]:
    """The recent history of a run's log (its last 16 MB, across a rotation)."""
    return list(read_tail(path, 16 << 20))


# --------------------------------------------------------------------------- requeue


def requeue_after_signal(
    policy: str,
    env: Mapping[str, str],
    signum: int,
    rc: int,
    emit: Callable[..., None],
    run: Runner = subprocess.run,
) -> bool:
    """After the job stopped on a forwarded signal: requeue this Slurm job, if it should.

    ``auto`` requeues only after the warning signal (USR1/USR2), and only a batch job
    that allows it (``Requeue=1``: ``--requeue``, or the cluster's ``JobRequeue=1``).
    Whatever the exit code, except 2 (a config the job rejects fails again): 75 means
    an emergency checkpoint, 76 or a rank killed mid-save still leaves the last
    committed one, and torchrun reports its ranks' 75 as 1. Not requeueing would
    leave the run stopped until someone resubmits it.
    Silent (no event) when not in a Slurm job, with policy ``never``, and on every node
    but the first: one requeue per job.

    The ``requeue`` event is written *before* ``scontrol requeue``: a successful requeue
    kills this job step at once (srun forwards the SIGTERM and then kills its tasks), so
    afterwards there may be no time to write anything (scontrol itself may be killed on
    its way out: that is the requeue working). A refusal leaves us running, and is
    recorded as ``no_requeue``, like every reason not to try. Returns whether Slurm
    accepted the requeue.
    """
    job_id = env.get("SLURM_JOB_ID", "")
    if policy == "never" or not job_id or env.get("SLURM_PROCID", "0") != "0":
        return False
    fields: dict[str, Any] = {
        "job_id": job_id,
        "signal": signal.Signals(signum).name,
        "exit_code": rc,
        "restart_count": int(env.get("SLURM_RESTART_COUNT") or 0),
    }

    def no(reason: str, **more: Any) -> bool:
        log.warning("not requeueing Slurm job %s: %s", job_id, reason)
        emit("no_requeue", **fields, reason=reason, **more)
        return False

    if signum not in REQUEUE_SIGNALS:
        return no(
            f"{fields['signal']} is a cancel, a time limit or Slurm's own preemption, "
            "not the --signal warning"
        )
    if rc == exitcodes.USAGE:
        return no("the job rejected its config (exit 2); it would fail again")
    try:
        return _scontrol_requeue(job_id, run, lambda: emit("requeue", **fields), no)
    except (OSError, subprocess.TimeoutExpired) as e:
        return no(f"scontrol: {e}")


def _scontrol_requeue(
    job_id: str, run: Runner, announce: Callable[[], None], no: Callable[..., bool]
) -> bool:
    """Requeue ``job_id`` if Slurm allows it; ``no(reason)`` records why not."""
    show = run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30
    )
    if show.returncode != 0:
        return no(f"scontrol show job: {(show.stdout + show.stderr).strip()[:300]}")
    info = dict(t.partition("=")[::2] for t in show.stdout.split() if "=" in t)
    if info.get("BatchFlag") != "1" or info.get("Requeue") != "1":
        return no(
            f"the job does not allow requeues (BatchFlag={info.get('BatchFlag')}, "
            f"Requeue={info.get('Requeue')}); submit it with --requeue"
        )
    log.warning("requeueing Slurm job %s (scontrol requeue)", job_id)
    announce()
    r = run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=30)
    if r.returncode < 0:
        # The requeue taking effect: Slurm ends this job at once and signals every process
        # of it, scontrol too, which it may reach before scontrol has exited.
        log.warning("scontrol requeue ended by signal %d: Slurm is requeueing", -r.returncode)
        return True
    if r.returncode != 0:
        return no(
            f"scontrol requeue: {(r.stdout + r.stderr).strip()[:300]}", scontrol_rc=r.returncode
        )
    return True


# --------------------------------------------------------------------------- the verb


def options_from_config(
    cfg: SlurmConfig, rest: list[str] | tuple[str, ...], cwd: Path, shoestring: tuple[str, ...]
) -> SbatchOptions:
    """Check the finetune config and its overrides (``rest``); everything the script needs."""
    from shoestring.config import ConfigError, load
    from shoestring.train.config import FinetuneConfig

    ft = load(FinetuneConfig, cfg.config or None, list(rest))
    sig = SIGNAL_NAMES.get(ft.preempt.signal)
    if sig is None:
        raise ConfigError(
            "preempt.signal is 'none': the job would ignore Slurm's warning; "
            "set it to SIGUSR1 or SIGUSR2"
        )
    run_dir = (cwd / ft.output_dir).resolve()
    for what, v in (("output_dir", str(run_dir)), ("the working directory", str(cwd))):
        if any(c.isspace() for c in v):  # #SBATCH lines are split on whitespace
            raise ConfigError(
                f"{what} {v!r} contains whitespace, which #SBATCH lines "
                "cannot carry; choose a path without it"
            )
    grace, why = grace_from_events(recent_records(RunDir(run_dir).events))
    if cfg.grace is not None:
        grace, why = cfg.grace, "set by grace"
    limit = time_limit_s(cfg.time) if cfg.time else None
    if limit is not None and grace >= limit:
        raise ConfigError(
            f"time {cfg.time}: the {grace} s warning would come before the job "
            "starts; give more time or a smaller grace"
        )
    args = (["--config", str((cwd / cfg.config).resolve())] if cfg.config else []) + list(rest)
    return SbatchOptions(
        run_dir=run_dir,
        workdir=cwd,
        shoestring=shoestring,
        finetune_args=tuple(args),
        job_name=cfg.job_name or f"shoestring-{run_dir.name}",
        nodes=cfg.nodes,
        gpus_per_node=cfg.gpus_per_node,
        cpus_per_task=cfg.cpus_per_task,
        time=cfg.time or None,
        partition=cfg.partition or None,
        account=cfg.account or None,
        warn_signal=sig,
        grace_s=grace,
        grace_why=why,
        max_restarts=cfg.max_restarts,
        extra=tuple(cfg.sbatch_arg),
    )


def run_slurm(cfg: SlurmConfig, call: Invocation) -> int:
    """``shoestring slurm``: print, write or submit the script."""
    # The interpreter that renders the script runs it: a venv on a shared filesystem
    # works on the compute nodes without activation or `shoestring` on PATH.
    opts = options_from_config(cfg, call.rest, Path.cwd(), (sys.executable, "-m", "shoestring"))
    script = render(opts)
    path = Path(cfg.output) if cfg.output else (opts.run_dir / "job.sbatch" if cfg.submit else None)
    if path is None:
        sys.stdout.write(script)
        return exitcodes.OK
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    print(f"wrote {path}", file=sys.stderr)
    secrets = HiddenSecrets.of(opts.finetune_args)
    if not cfg.submit:
        for var, knob in secrets.knobs.items():
            print(f"before sbatch: export {var} (the value of {knob})", file=sys.stderr)
        return exitcodes.OK
    opts.run_dir.mkdir(parents=True, exist_ok=True)  # sbatch opens the log files there
    return _submit(path, opts.run_dir, {**call.env, **secrets.env})


def _submit(path: Path, run_dir: Path, env: Mapping[str, str]) -> int:
    try:
        r = subprocess.run(
            ["sbatch", "--parsable", str(path)],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"shoestring slurm: error: sbatch: {e}", file=sys.stderr)
        return exitcodes.FAILED
    if r.returncode != 0:
        print(
            f"shoestring slurm: error: sbatch exited {r.returncode}: {r.stderr.strip()}",
            file=sys.stderr,
        )
        return exitcodes.FAILED
    job_id = r.stdout.strip().split(";")[0]
    print(job_id)
    print(f"submitted job {job_id}; log: {run_dir}/slurm-{job_id}.out", file=sys.stderr)
    return exitcodes.OK
