"""The configs of ``shoestring run`` and ``shoestring slurm``: every knob, its help, its check.

Flat on purpose: each key is its documented flag with underscores (``--hang-floor 5`` is
``hang_floor: 5`` in a ``--config`` YAML), so the flags of the docs and the keys of a
file are one list. A boolean alone means true; ``--no-watch`` is ``--watch false``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from shoestring.config import at_least, in_range, knob, non_negative, positive

SlurmRequeue = Literal["auto", "never"]


def _http_url(v: Any) -> str | None:
    return None if not v or v.startswith(("http://", "https://")) else "must be an http(s) URL"


def _one_word(v: Any) -> str | None:
    return "must not contain whitespace" if any(c.isspace() for c in v) else None


@dataclass
class RunConfig:
    """``shoestring run [options] -- COMMAND ...``."""

    nproc_per_node: int = knob(1, "Processes (ranks) on this node.", check=at_least(1))
    max_restarts: int = knob(3, "Restarts after failures before giving up.", check=non_negative)
    nnodes: int | None = knob(
        None,
        "Nodes of the job, one `shoestring run` on each (unset: $SLURM_NNODES, else 1).",
        check=at_least(1),
    )
    node_rank: int | None = knob(
        None,
        "This node's rank, 0..nnodes-1; node 0 hosts the rendezvous (unset: "
        "$SLURM_NODEID, else 0).",
        check=non_negative,
    )
    rdzv_endpoint: str = knob(
        "",
        "HOST[:PORT] of the c10d rendezvous: node 0's address, port 29400 if not given "
        "(empty: the first host of $SLURM_JOB_NODELIST).",
        check=_one_word,
    )
    rdzv_id: str = knob(
        "",
        "Rendezvous id, the same on every node of the job (empty: $SLURM_JOB_ID, else "
        "'shoestring').",
        check=_one_word,
    )
    local_addr: str = knob(
        "",
        "This node's address for the rendezvous and the ranks (torchrun --local-addr); "
        "gloo binds to the interface holding it unless GLOO_SOCKET_IFNAME is set "
        "(empty: found from the hostname).",
        check=_one_word,
    )
    run_dir: str = knob(
        "",
        "The job's output_dir: attempts and restarts are logged to its "
        "events.jsonl (empty: no log, no watchdog).",
    )
    watch: bool = knob(
        True,
        "Watch the ranks for hangs, stragglers and degradation (needs "
        "run_dir). --no-watch turns it off.",
    )
    hang_multiple: float = knob(
        3.0, "A phase hangs after this many times its p99 duration so far.", check=positive
    )
    hang_floor: float = knob(10.0, "... but never before this many seconds.", check=positive)
    first_phase_timeout: float = knob(
        300.0,
        "Budget in seconds of a phase seen fewer than 3 "
        "times: first step, first eval, first checkpoint.",
        check=positive,
    )
    straggler_threshold: float = knob(
        0.10,
        "Report a rank whose collective-free work per "
        "step, at the same batch size (lower quartile of its "
        "last 30 steps), is more than this fraction above its "
        "peers' for 10 steps.",
        check=positive,
    )
    window: float = knob(
        60.0,
        "Degradation window: per this many seconds and rank, "
        "communication time per step and throughput are compared with the "
        "run's baseline.",
        check=positive,
    )
    comm_rise: float = knob(
        0.10,
        "Alarm when communication time per step is more than this "
        "fraction above the baseline for 3 windows in a row.",
        check=positive,
    )
    throughput_drop: float = knob(
        0.05,
        "Alarm when throughput is more than this fraction "
        "below the baseline for 3 windows in a row.",
        check=positive,
    )
    metrics_interval: float = knob(
        10.0,
        "Sample CPU, memory, I/O and (with NVML) GPU metrics "
        "of every rank into events.jsonl every this many seconds "
        "(0: off).",
        check=non_negative,
    )
    prometheus_port: int | None = knob(
        None,
        "Serve Prometheus metrics of the job on this port (0: any free port; unset: no endpoint).",
        check=in_range(0, 65535),
    )
    prometheus_addr: str = knob("127.0.0.1", "Address the Prometheus endpoint binds to.")
    alert_webhook: str = knob(
        "",
        "POST every alarm as JSON (Slack-compatible 'text' field) to this URL (empty: "
        "$SHOESTRING_ALERT_WEBHOOK, else none; the environment keeps its token out of job "
        "scripts). Logs and records name only its host.",
        check=_http_url,
    )
    job_id: str = knob(
        "", "Job label of alerts and metrics (empty: $SLURM_JOB_ID, else the run directory's name)."
    )
    slurm_requeue: SlurmRequeue = knob(
        "auto",
        "Inside a Slurm batch job stopped by its "
        "--signal warning (USR1/USR2): 'auto' runs scontrol "
        "requeue $SLURM_JOB_ID if the job allows requeues and "
        "did not exit 2, so it comes back and resumes.",
    )
    nccl_dump_wait: float = knob(
        5.0,
        "On a hang, ask every NCCL rank of this host to dump its "
        "flight recorder and wait up to this many seconds for the "
        "dumps before the kill (0: do not ask).",
        check=non_negative,
    )
    keep_verdicts: int = knob(
        20,
        "Hang verdicts (RUN_DIR/verdicts/hang-*, with their stacks and NCCL dumps) to keep; "
        "older ones are deleted when a new one is written.",
        check=positive,
    )
    command: list[str] = knob(
        [],
        "The job to run and its arguments: on the command line, "
        "everything after `--` (or from the first bare word).",
    )


_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def time_limit_s(text: str) -> int | None:
    """Seconds in a Slurm time limit: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S; None: no limit."""
    if text.strip().upper() in ("0", "INFINITE", "UNLIMITED"):
        return None
    m = _TIME.match(text.strip())
    if not m:
        raise ValueError(f"not a Slurm time limit: {text!r} (e.g. 90, 04:00:00, 1-12:00)")
    days, a, b, c = m.groups()
    nums = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:
        h, mi, s = (nums + [0, 0])[:3]
        return int(days) * 86400 + h * 3600 + mi * 60 + s
    if len(nums) == 1:
        return nums[0] * 60
    if len(nums) == 2:
        return nums[0] * 60 + nums[1]
    return nums[0] * 3600 + nums[1] * 60 + nums[2]


def _time_limit(v: Any) -> str | None:
    try:
        if v:
            time_limit_s(v)
    except ValueError:
        return "is not a Slurm time limit (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S; e.g. 04:00:00)"
    return None


def _no_space(v: Any) -> str | None:
    return (
        "must not contain whitespace (#SBATCH lines cannot carry it)"
        if any(c.isspace() for c in v)
        else None
    )


@dataclass
class SlurmConfig:
    """``shoestring slurm``: the sbatch script of a fine-tune. Flags of keys it does not
    have are finetune overrides, checked here and passed on to ``shoestring finetune``."""

    config: str = knob(
        "", "The finetune config (YAML) of the job; its output_dir is the run directory."
    )
    nodes: int = knob(1, "Nodes.", check=at_least(1))
    gpus_per_node: int = knob(
        1, "GPUs and ranks per node (0: CPU only, one rank).", check=non_negative
    )
    cpus_per_task: int | None = knob(
        None, "CPUs per node for all its ranks (unset: the partition's).", check=at_least(1)
    )
    time: str = knob(
        "", "Time limit, e.g. 04:00:00 or 1-00:00:00 (empty: the partition's).", check=_time_limit
    )
    partition: str = knob("", "Partition (empty: the cluster's default).")
    account: str = knob("", "Account (empty: your default).")
    job_name: str = knob("", "Job name (empty: shoestring-<run dir name>).", check=_no_space)
    grace: int | None = knob(
        None,
        "Seconds of warning before the time limit (unset: measured "
        "from the run directory's events.jsonl, else 120).",
        check=in_range(1, 65535),
    )
    max_restarts: int = knob(3, "Restarts within one allocation after crashes.", check=non_negative)
    sbatch_arg: list[str] = knob(
        [],
        "Another #SBATCH option, verbatim; repeat the flag for more, e.g. --sbatch-arg=--mem=64G.",
        repeat=True,
    )
    output: str = knob(
        "", "Write the script here (empty: print it; with submit: RUN_DIR/job.sbatch)."
    )
    submit: bool = knob(False, "Submit with sbatch; print the job id.")


SLURM_EPILOG = """\
--config is the finetune YAML; the keys above can also come from a YAML of their own,
--slurm-config FILE.yaml (nodes: 2, time: "04:00:00", sbatch_arg: [--mem=64G]).
Unknown --section.key VALUE flags are finetune overrides: they are checked here and
passed on to `shoestring finetune` in the script.

The warning comes --grace seconds before the time limit (default: from the run
directory's events.jsonl if a previous run measured its saves, else 120 s).
The job then checkpoints, exits 75 and requeues itself (same job id); the next
start resumes from that checkpoint. Simulate it on a running job with
  scancel --signal=USR1 --batch JOBID
and let a requeued job start at once with
  scontrol update JobId=JOBID StartTime=now

examples:
  shoestring slurm --config run.yaml --nodes 2 --gpus-per-node 8 --time 04:00:00 --submit
  shoestring slurm --config run.yaml --partition gpu --output job.sbatch
"""


RecoveryStrategy = Literal["EAGER_NEXT_REGION", "FAILOVER"]


def _env_name(v: Any) -> str | None:
    ok = re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v)
    return None if ok else "must be an environment variable name (letters, digits, _)"


@dataclass
class LaunchConfig:
    """``shoestring launch``: a SkyPilot managed-job task of a fine-tune. Flags of keys it
    does not have are finetune overrides, checked here and written into the task."""

    config: str = knob(
        "", "The finetune config (YAML); its checkpoint.storage must be a bucket URL."
    )
    gpu: list[str] = knob(
        [],
        "A GPU of the catalog to ask for, in order of preference; repeat the flag for more "
        "(empty: the cheapest GPUs on which `shoestring plan` says the config fits).",
        repeat=True,
    )
    candidates: int = knob(
        3, "How many of the cheapest fitting GPUs to offer SkyPilot.", check=at_least(1)
    )
    spot: bool = knob(True, "Ask for spot machines (SkyPilot use_spot); --no-spot: on-demand.")
    recovery: RecoveryStrategy = knob(
        "EAGER_NEXT_REGION",
        "SkyPilot's job_recovery strategy after a preemption: EAGER_NEXT_REGION tries "
        "another region first, FAILOVER the same region first.",
    )
    max_restarts_on_errors: int = knob(
        0,
        "SkyPilot restarts after an exit code other than 0, 75 and 76 (a crash, or 2: a bad "
        "config, which fails again). 75/76 (preempted, checkpoint in the bucket) always "
        "recover.",
        check=non_negative,
    )
    name: str = knob("", "Managed job name (empty: shoestring-<output_dir name>).", check=_one_word)
    install: str = knob(
        "",
        "What the task's setup pip-installs: anything `pip install` takes, e.g. "
        "'shoestring[s3]==0.1.0' or a git URL. Empty: this source checkout, synced to the VM "
        "as the task's workdir (.gitignore applies), or shoestring[s3,gcs] at this version "
        "when installed from a wheel.",
    )
    secret: list[str] = knob(
        [],
        "An environment variable passed to the job as a SkyPilot secret: its value is read "
        "from this environment by `sky jobs launch --secret NAME`, never written into the "
        "YAML. Repeat for more; HF_TOKEN, WANDB_API_KEY and SHOESTRING_ALERT_WEBHOOK are "
        "added when set here.",
        repeat=True,
        check=lambda v: next(filter(None, map(_env_name, v)), None),
    )
    env: list[str] = knob(
        [],
        "An environment variable whose value (from this environment) is written into the "
        "task's envs, e.g. AWS_ENDPOINT_URL for an S3-compatible store; names that look "
        "like credentials are refused (use secret).",
        repeat=True,
        check=lambda v: next(filter(None, map(_env_name, v)), None),
    )
    output: str = knob("", "Write the task YAML here (empty: print it; with yes: RUN.sky.yaml).")
    dry_run: bool = knob(False, "Print the task YAML and submit nothing (the default).")
    yes: bool = knob(False, "Submit it as a managed job: sky jobs launch TASK --yes.")
    sky: str = knob(
        "",
        "The `sky` executable of a SkyPilot install (empty: `import sky` in this Python, "
        "else `sky` on PATH). SkyPilot pins click<8.2, which shoestring's huggingface-hub "
        "cannot use: install it apart (pipx install skypilot).",
    )


LAUNCH_EPILOG = """\
--config is the finetune YAML; unknown --section.key VALUE flags are finetune overrides
(checked here, written into the task's run command). checkpoint.storage must be a bucket
URL (s3://, gs://, ...): a new machine after a preemption has an empty disk and resumes
from there (--resume auto). model.path must be a Hub id, a bucket URL or builtin:tiny.

What SkyPilot does: finds a spot machine among the GPUs offered (cheapest first), runs
setup and run, and after a preemption (or the job's exit 75/76) finds another one and
runs them again. What shoestring does: the emergency checkpoint on SIGTERM or a cloud
notice, exit 75, the resume from the bucket, and one cost ledger across attempts
(<storage>/events/). docs/spot.md.

exit codes: 0 written or submitted; 2 bad config, or --yes without SkyPilot.
examples:
  shoestring launch --config run.yaml --checkpoint.storage s3://bucket/runs/x --dry-run
  shoestring launch --config run.yaml --gpu L4 --gpu A10G --secret HF_TOKEN --yes
"""
