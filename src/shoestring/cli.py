"""The ``shoestring`` command: one console script, verb subcommands.

This is the only place that reads the process environment and argv; everything
below receives config objects.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable

from shoestring import __version__, exitcodes
from shoestring.config import ConfigError, FinetuneConfig, help_table, load

FINETUNE_EPILOG = """\
config keys (set in --config YAML as nested sections, or as --section.key VALUE):
{table}

resume:
  --resume auto   continue from the newest valid checkpoint in output_dir or
                  checkpoint.storage, or start fresh if there is none (default)
  --resume never  start fresh (fails if output_dir already has checkpoints)
  --resume PATH   continue from exactly this checkpoint directory

exit codes:
  0 done; 1 failed; 2 bad config or data (nothing started);
  75 preempted, emergency checkpoint committed: rerun the same command;
  76 second signal during the emergency save: previous checkpoint intact, rerun.

environment (read here only):
  SHOESTRING_CACHE   where the built-in tiny model is materialized
                     (default ~/.cache/shoestring)
  SHOESTRING_FAULTS  fault injection for tests, e.g. ckpt.before_rename@2:kill or
                     step.end@6:kill:rank1:once (only rank 1; once per output_dir)
  RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT   set by torchrun: run as one rank
  SLURM_PROCID SLURM_NTASKS SLURM_LOCALID SLURM_JOB_NODELIST   the same under srun
"""


def _finetune_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "finetune", help="LoRA fine-tuning that survives preemption and resumes exactly",
        description="LoRA fine-tuning of a local Hugging Face causal LM. With no arguments, "
                    "trains the built-in tiny model on the bundled task and prints before/after.",
        epilog=FINETUNE_EPILOG.format(table=help_table(FinetuneConfig)),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE.yaml", help="YAML config; flags override it")
    p.add_argument("--resume", default="auto", metavar="auto|never|PATH",
                   help="where to continue from (default: auto)")
    return p


def _run_finetune(args: argparse.Namespace, rest: list[str], env: dict[str, str]) -> int:
    from shoestring.checkpoint import FaultPlan
    from shoestring.checkpoint.local import committed_steps
    from shoestring.distributed import DistEnv
    from shoestring.plan.check import preflight_event
    from shoestring.report.ledger import run_ledger
    from shoestring.train.loop import RunOptions, finetune

    cfg = load(FinetuneConfig, args.config, rest)
    if args.resume == "never" and committed_steps(Path(cfg.output_dir) / "checkpoints"):
        raise ConfigError(f"--resume never: {cfg.output_dir} already has checkpoints; "
                          "choose another output_dir or delete them yourself")
    if args.resume not in ("auto", "never") and not Path(args.resume).is_dir():
        raise ConfigError(f"--resume: {args.resume} is not a checkpoint directory")
    dist = DistEnv.from_environ(env)
    try:
        faults = FaultPlan.parse(env.get("SHOESTRING_FAULTS", ""), rank=dist.rank,
                                 once_dir=Path(cfg.output_dir) / ".faults-fired")
    except ValueError as e:
        raise ConfigError(str(e)) from e
    cache = Path(env.get("SHOESTRING_CACHE") or Path.home() / ".cache" / "shoestring")
    return finetune(cfg, RunOptions(resume=args.resume, faults=faults, cache_dir=cache,
                                    dist=dist, preflight=preflight_event, ledger=run_ledger))


def _run_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "run", help="launch a job (torchrun for several processes) and restart it on failure",
        description="Run COMMAND, through torchrun when --nproc-per-node > 1 (or under a "
                    "multi-node Slurm allocation), and restart the whole job after a crash, "
                    "a killed rank or a preemption exit, so it continues from its last "
                    "checkpoint. A signal to this process is forwarded to the job and ends "
                    "the run without a restart.",
        epilog="example: shoestring run --nproc-per-node 2 --max-restarts 3 --run-dir runs/x "
               "-- shoestring finetune --output_dir runs/x")
    p.add_argument("--nproc-per-node", type=int, default=1, metavar="N",
                   help="processes (ranks) on this node (default 1)")
    p.add_argument("--max-restarts", type=int, default=3, metavar="R",
                   help="restarts after failures before giving up (default 3)")
    p.add_argument("--run-dir", metavar="DIR",
                   help="the job's output_dir: attempts and restarts are logged to its "
                        "events.jsonl")
    p.add_argument("--no-watch", action="store_true",
                   help="do not watch the ranks for hangs (default: watch when --run-dir is set)")
    p.add_argument("--hang-multiple", type=float, default=3.0, metavar="K",
                   help="a phase hangs after K x its p99 duration so far (default 3)")
    p.add_argument("--hang-floor", type=float, default=10.0, metavar="S",
                   help="... but never before S seconds (default 10)")
    p.add_argument("--first-phase-timeout", type=float, default=300.0, metavar="S",
                   help="budget of a phase seen fewer than 3 times: first step, first eval, "
                        "first checkpoint (default 300)")
    p.add_argument("--straggler-threshold", type=float, default=0.10, metavar="F",
                   help="report a rank whose collective-free work per step, at the same "
                        "batch size (lower quartile of its last 30 steps), is more than F "
                        "above its peers' for 10 steps (default 0.10)")
    p.add_argument("--window", type=float, default=60.0, metavar="S",
                   help="degradation window: per S seconds and rank, communication time per "
                        "step and throughput are compared with the run's baseline (default 60)")
    p.add_argument("--comm-rise", type=float, default=0.10, metavar="F",
                   help="alarm when communication time per step is more than F above the "
                        "baseline for 3 windows in a row (default 0.10)")
    p.add_argument("--throughput-drop", type=float, default=0.05, metavar="F",
                   help="alarm when throughput is more than F below the baseline for 3 "
                        "windows in a row (default 0.05)")
    p.add_argument("--metrics-interval", type=float, default=10.0, metavar="S",
                   help="sample CPU, memory, I/O and (with NVML) GPU metrics of every rank "
                        "into events.jsonl every S seconds (0: off; default 10)")
    p.add_argument("--prometheus-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics of the job on this port (0: any free port; "
                        "default: no endpoint)")
    p.add_argument("--prometheus-addr", default="127.0.0.1", metavar="ADDR",
                   help="address the Prometheus endpoint binds to (default 127.0.0.1)")
    p.add_argument("--alert-webhook", metavar="URL",
                   help="POST every alarm as JSON (Slack-compatible 'text' field) to URL")
    p.add_argument("--job-id", metavar="ID",
                   help="job label of alerts and metrics (default: $SLURM_JOB_ID, else the "
                        "run directory's name)")
    p.add_argument("--slurm-requeue", choices=("auto", "never"), default="auto",
                   help="inside a Slurm batch job stopped by its --signal warning (USR1/USR2): "
                        "'auto' runs scontrol requeue $SLURM_JOB_ID if the job allows requeues "
                        "and did not exit 2, so it comes back and resumes (default auto)")
    p.add_argument("--nccl-dump-wait", type=float, default=5.0, metavar="S",
                   help="on a hang, ask every NCCL rank of this host to dump its flight "
                        "recorder and wait up to S seconds for the dumps before the kill "
                        "(0: do not ask; default 5)")
    p.add_argument("job", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="the job to run and its arguments")
    return p


def _run_run(args: argparse.Namespace, rest: list[str], env: dict[str, str]) -> int:
    from shoestring.supervise.launch import LaunchSpec, launch_argv
    from shoestring.supervise.supervisor import Supervisor, SupervisorConfig
    from shoestring.watch.degrade import DegradePolicy
    from shoestring.watch.hang import HangPolicy
    from shoestring.watch.straggler import StragglerPolicy

    command = list(args.job or []) + list(rest)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError("run: no COMMAND given (usage: shoestring run [options] -- COMMAND ...)")
    if args.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node: must be >= 1, got {args.nproc_per_node}")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts: must be >= 0, got {args.max_restarts}")
    argv = launch_argv(LaunchSpec(tuple(command), args.nproc_per_node), env)
    for flag, v in (("--hang-multiple", args.hang_multiple), ("--hang-floor", args.hang_floor),
                    ("--first-phase-timeout", args.first_phase_timeout),
                    ("--straggler-threshold", args.straggler_threshold),
                    ("--window", args.window), ("--comm-rise", args.comm_rise),
                    ("--throughput-drop", args.throughput_drop)):
        if v <= 0:
            raise ConfigError(f"{flag}: must be > 0, got {v}")
    if args.nccl_dump_wait < 0:
        raise ConfigError(f"--nccl-dump-wait: must be >= 0, got {args.nccl_dump_wait}")
    if args.metrics_interval < 0:
        raise ConfigError(f"--metrics-interval: must be >= 0, got {args.metrics_interval}")
    if args.prometheus_port is not None and not 0 <= args.prometheus_port < 65536:
        raise ConfigError(f"--prometheus-port: must be in 0..65535, got {args.prometheus_port}")
    if args.alert_webhook and not args.alert_webhook.startswith(("http://", "https://")):
        raise ConfigError(f"--alert-webhook: expected an http(s) URL, got {args.alert_webhook!r}")
    policy = HangPolicy(multiple=args.hang_multiple, floor_s=args.hang_floor,
                        first_timeout_s=args.first_phase_timeout)
    run_dir = Path(args.run_dir) if args.run_dir else None
    job = args.job_id or env.get("SLURM_JOB_ID") or (run_dir.resolve().name if run_dir else "job")
    cfg = SupervisorConfig(max_restarts=args.max_restarts, run_dir=run_dir,
                           watch=not args.no_watch, hang=policy,
                           stragglers=StragglerPolicy(threshold=args.straggler_threshold),
                           degrade=DegradePolicy(window_s=args.window, comm_rise=args.comm_rise,
                                                 throughput_drop=args.throughput_drop),
                           metrics_interval_s=args.metrics_interval, job=job,
                           prometheus_port=args.prometheus_port,
                           prometheus_addr=args.prometheus_addr, webhook=args.alert_webhook,
                           slurm_requeue=args.slurm_requeue,
                           nccl_dump_wait_s=args.nccl_dump_wait)
    return Supervisor(argv, cfg, env).run()


Parser = Callable[[argparse._SubParsersAction], argparse.ArgumentParser]
Runner = Callable[[argparse.Namespace, list[str], dict[str, str]], int]


def _lazy(module: str, parser: str, runner: str) -> tuple[Parser, Runner]:
    """A verb whose module is imported only when it is used (keeps `--help` fast)."""
    import importlib

    def get(name: str) -> Callable[..., Any]:
        return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]

    return (lambda sub: get(parser)(sub)), (lambda *a: get(runner)(*a))


COMMANDS: dict[str, tuple[Parser, Runner]] = {
    "finetune": (_finetune_parser, _run_finetune),
    "run": (_run_parser, _run_run),
    "plan": _lazy("shoestring.plan.cli", "plan_parser", "run_plan"),
    "infer": _lazy("shoestring.infer.cli", "add_parser", "run"),
    "report": _lazy("shoestring.report.cli", "report_parser", "run_report"),
    "top": _lazy("shoestring.report.cli", "top_parser", "run_top"),
    "slurm": _lazy("shoestring.supervise.slurm", "slurm_parser", "run_slurm"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoestring",
                                     description="Fine-tune and run LLMs on cheap, unreliable GPUs.")
    parser.add_argument("--version", action="version", version=f"shoestring {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for make, _ in COMMANDS.values():
        make(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[shoestring] %(levelname)s %(message)s",
                        stream=sys.stderr)
    for noisy in ("transformers", "peft", "botocore", "s3fs", "aiobotocore", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return exitcodes.USAGE
    _, run = COMMANDS[args.command]
    try:
        return run(args, rest, dict(os.environ))
    except ConfigError as e:
        print(f"shoestring {args.command}: error: {e}", file=sys.stderr)
        return exitcodes.USAGE
    except Exception as e:  # noqa: BLE001 - a clear one-line error, traceback on request
        from shoestring.checkpoint import CheckpointSaveError
        from shoestring.train.data import DataError

        if isinstance(e, DataError):
            print(f"shoestring {args.command}: error: {e}", file=sys.stderr)
            return exitcodes.USAGE
        if isinstance(e, CheckpointSaveError):
            print(f"shoestring {args.command}: error: {e}", file=sys.stderr)
            return exitcodes.FAILED
        raise


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
