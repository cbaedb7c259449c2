"""The ``shoestring`` command: a table of verbs, and the environment edge.

Each verb is a config class (its keys: help text, checks, ``Literal`` choices) and a
runner ``(config, Invocation) -> exit code`` whose module is imported only when the
verb runs, so ``--help`` stays fast. Every verb reads its keys the same way: the
dataclass defaults, then a YAML file (``--config``), then flags (``--KEY VALUE``);
errors name the file and line or the flag.

This is the only place that reads the process environment and argv; everything
below receives config objects and an :class:`~shoestring.config.Invocation`.
"""

from __future__ import annotations

import difflib
import errno
import importlib
import logging
import os
import sys
import textwrap
import threading
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoestring import __version__, exitcodes
from shoestring.config import (
    ArgSpec,
    ConfigError,
    Invocation,
    build,
    help_table,
    iter_fields,
    parse_command_line,
    read_yaml,
)
from shoestring.evaluate.config import EVALUATE_EPILOG, EvaluateConfig
from shoestring.fsio import unwritable
from shoestring.hf import quiet_hub_kernel_notice
from shoestring.hub import HubAccess
from shoestring.infer.cli import INFER_ARGS, INFER_DESCRIPTION, INFER_EPILOG
from shoestring.infer.config import InferConfig
from shoestring.plan.cli import PLAN_EPILOG, PlanConfig
from shoestring.report.cli import ReportConfig, TopConfig
from shoestring.rundir import RunDir
from shoestring.secrets import RedactingFilter, print_thread_exception, redact_text
from shoestring.supervise.config import (
    LAUNCH_EPILOG,
    SLURM_EPILOG,
    LaunchConfig,
    RunConfig,
    SlurmConfig,
)
from shoestring.train.config import FinetuneConfig, FinetuneOptions
from shoestring.train.exportcli import ExportVerbConfig

Runner = Callable[[Any, Invocation], int]


@dataclass(frozen=True)
class Verb:
    """One ``shoestring VERB``: its config class and runner ("module:function")."""

    config: type
    runner: str | Runner
    help: str
    description: str = ""
    epilog: str = ""
    options: type | None = None  # flag-only knobs, not part of the config (finetune --resume)
    args: ArgSpec = field(default_factory=ArgSpec)


FINETUNE_EPILOG = """\
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
  SHOESTRING_CACHE   where the built-in tiny model is materialized and bucket model
                     folders are copied (default ~/.cache/shoestring)
  HF_TOKEN HF_ENDPOINT HF_HUB_OFFLINE HF_HOME HF_HUB_CACHE   model.path as a Hub id
                     (org/name[@revision]): token, mirror, cache only, the HF cache
                     (docs/models.md)
  SHOESTRING_FAULTS  fault injection for tests, e.g. ckpt.before_rename@2:kill or
                     step.end@6:kill:rank1:once (only rank 1; once per output_dir)
  SHOESTRING_ALERT_WEBHOOK  run: the alert webhook when --alert-webhook is not given
                     (keeps its token out of job scripts; docs/security.md)
  RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT   set by torchrun: run as one rank
  SLURM_PROCID SLURM_NTASKS SLURM_LOCALID SLURM_JOB_NODELIST   the same under srun
  OMP_WAIT_POLICY GOMP_SPINCOUNT   how OpenMP threads wait; unless one is set, every
                     command sets GOMP_SPINCOUNT=3000 (a busy neighbour no longer stalls
                     torch's threads; OMP_WAIT_POLICY=PASSIVE: more so, slower when
                     quiet; docs/architecture.md)
"""

RUN_EPILOG = """\
example:
  shoestring run --nproc-per-node 2 --max-restarts 3 --run-dir runs/x \\
      -- shoestring finetune --output_dir runs/x

several nodes without Slurm (one `shoestring run` per node, K = 0, 1; the run
directory on a filesystem both see; under Slurm the SLURM_* variables fill these in):
  shoestring run --nproc-per-node 8 --nnodes 2 --node-rank K \\
      --rdzv-endpoint NODE0_ADDR:29400 --local-addr THIS_NODE_ADDR \\
      -- shoestring finetune --output_dir /shared/runs/x
"""


def writes_cache(cfg: FinetuneConfig) -> bool:
    """Whether the run keeps anything under SHOESTRING_CACHE: the built-in model, a
    bucket model's copy, the tokenized data, the quantized base."""
    quantized = cfg.lora.quantize != "none" and cfg.lora.cache_quantized
    model = cfg.model.path.startswith("builtin:") or "://" in cfg.model.path
    return cfg.data.cache or quantized or model


def check_cache_dir(cache: Path) -> None:
    """A cache folder that cannot be written: refused at the start when it holds nothing
    yet (the run would fail on its first write, after loading); a filled one is used as
    it is (a shared, read-only copy), with a warning that nothing new can be kept."""
    problem = unwritable(cache)
    if problem is None:
        return
    why = problem.strerror or str(problem)
    if cache.is_dir() and any(cache.iterdir()):
        logging.getLogger("shoestring").warning(
            "SHOESTRING_CACHE=%s cannot be written (%s): using what it holds; a model or "
            "tokenized data not already there will fail to be kept",
            cache,
            why,
        )
        return
    raise ConfigError(
        f"SHOESTRING_CACHE={cache}: cannot write there ({why}) and it holds nothing yet; "
        "point SHOESTRING_CACHE at a writable folder"
    )


def _finetune(cfg: FinetuneConfig, call: Invocation) -> int:
    """The environment edge of ``finetune``: faults, cache, rank; hooks for the trainer."""
    from shoestring.checkpoint import FaultPlan
    from shoestring.checkpoint.local import committed_steps
    from shoestring.distributed import DistEnv
    from shoestring.plan.check import preflight_event
    from shoestring.report.ledger import run_ledger
    from shoestring.train.loop import RunOptions, finetune

    resume = _finetune_options(call).resume
    if resume == "never" and committed_steps(RunDir(Path(cfg.output_dir)).checkpoints):
        raise ConfigError(
            f"--resume never: {cfg.output_dir} already has checkpoints; "
            "choose another output_dir or delete them yourself"
        )
    if resume not in ("auto", "never") and not Path(resume).is_dir():
        raise ConfigError(f"--resume: {resume} is not a checkpoint directory")
    env = call.env
    dist = DistEnv.from_environ(env)
    try:
        faults = FaultPlan.parse(
            env.get("SHOESTRING_FAULTS", ""),
            rank=dist.rank,
            once_dir=Path(cfg.output_dir) / ".faults-fired",
        )
    except ValueError as e:
        raise ConfigError(str(e)) from e
    cache = Path(env.get("SHOESTRING_CACHE") or Path.home() / ".cache" / "shoestring")
    if writes_cache(cfg):
        check_cache_dir(cache)
    return finetune(
        cfg,
        RunOptions(
            resume=resume,
            faults=faults,
            cache_dir=cache,
            dist=dist,
            preflight=preflight_event,
            ledger=run_ledger,
            process_start=process_start_time(),
            hub=hub_access(env, cache, progress=dist.rank == 0),
        ),
    )


def hub_access(env: Mapping[str, str], cache: Path, *, progress: bool = True) -> HubAccess:
    """How model ids and bucket URLs are fetched (``shoestring.hub``): HF_ENDPOINT,
    HF_TOKEN, HF_HUB_OFFLINE, HF_HOME/HF_HUB_CACHE read here; download bars on a
    terminal; bucket folders copied with the checkpoint store's code."""
    from shoestring.checkpoint.mirror import fetch_model_folder

    tty = progress and sys.stderr.isatty()
    return HubAccess.from_env(env, cache, buckets=fetch_model_folder, progress=tty)


def process_start_time() -> float | None:
    """When this process started (epoch seconds; interpreter start and imports included)."""
    import psutil

    try:
        return float(psutil.Process().create_time())
    except (psutil.Error, OSError):
        return None


def _finetune_options(call: Invocation) -> FinetuneOptions:
    assert isinstance(call.options, FinetuneOptions)
    return call.options


VERBS: dict[str, Verb] = {
    "finetune": Verb(
        FinetuneConfig,
        _finetune,
        options=FinetuneOptions,
        help="LoRA fine-tuning that survives preemption and resumes exactly",
        description="LoRA fine-tuning of a Hugging Face causal LM (a local folder, a Hub id "
        "org/name[@revision] or a bucket URL: --model.path). With no arguments, "
        "trains the built-in tiny model on the bundled task and prints "
        "before/after.",
        epilog=FINETUNE_EPILOG,
    ),
    "run": Verb(
        RunConfig,
        "shoestring.supervise.supervisor:supervise",
        help="launch a job (torchrun for several processes) and restart it on failure",
        description="Run COMMAND, through torchrun when --nproc-per-node > 1 (or on several "
        "nodes: --nnodes, or a multi-node Slurm allocation), and restart the whole job "
        "after a crash, a killed rank, a lost node or a preemption exit, so it continues "
        "from its last checkpoint. A signal to this process is forwarded to the job and "
        "ends the run without a restart.",
        epilog=RUN_EPILOG,
        args=ArgSpec(command="command"),
    ),
    "plan": Verb(
        PlanConfig,
        "shoestring.plan.cli:run_plan",
        help="predict peak GPU memory, time and cost of a fine-tune before running it",
        description="Predict whether a fine-tune fits a GPU (memory breakdown by component), "
        "the largest micro-batch and sequence that fit, what to change if it does "
        "not, and time and cost on demand and on spot. Nothing is loaded or "
        "downloaded.",
        epilog=PLAN_EPILOG,
        args=ArgSpec(config_flag="--plan-config"),
    ),
    "infer": Verb(
        InferConfig,
        "shoestring.infer.cli:run_infer_verb",
        help="batch inference of models larger than memory, streamed layer by layer",
        description=INFER_DESCRIPTION,
        epilog=INFER_EPILOG,
        args=INFER_ARGS,
    ),
    "evaluate": Verb(
        EvaluateConfig,
        "shoestring.evaluate.cli:run_evaluate",
        help="lm-evaluation-harness benchmarks of a model larger than memory, preemptible",
        description="Score lm-evaluation-harness tasks (built-in names, or custom task YAMLs "
        "with --include-path) on a Hugging Face causal LM streamed layer by layer within "
        "--memory.budget, as shoestring infer runs it: each batch of lm-eval's requests "
        "is one resumable inference job in --work-dir. Needs pip install "
        "'shoestring[eval]'.",
        epilog=EVALUATE_EPILOG,
    ),
    "export": Verb(
        ExportVerbConfig,
        "shoestring.train.exportcli:run_export",
        help="write a GGUF (llama.cpp, Ollama) of a run's fine-tuned model, with a Modelfile",
        description="Merge the adapter of RUN_DIR (its final/, or the newest committed "
        "checkpoint of a preempted run) onto its base model and write one GGUF file with "
        "the tokenizer and chat template, plus an Ollama Modelfile beside it (RUN_DIR/gguf/, "
        "or --out). Llama- and Qwen2-family models with byte-level BPE tokenizers; needs "
        "pip install 'shoestring[gguf]'.",
        args=ArgSpec(positional="run_dir"),
    ),
    "report": Verb(
        ReportConfig,
        "shoestring.report.cli:run_report",
        help="write one self-contained HTML report of a run directory",
        description="Merge the event logs of every rank and attempt in RUN_DIR and write one "
        "HTML file (inline SVG plots, no network needed to view it): summary, "
        "timeline of attempts, restarts, preemptions, checkpoints and alarms, step "
        "time per rank, communication share, loss, alarms and hang verdicts, "
        "checkpoints, host/GPU metrics when sampled.",
        args=ArgSpec(positional="run_dir", aliases={"-o": "output"}),
    ),
    "top": Verb(
        TopConfig,
        "shoestring.report.cli:run_top",
        help="live terminal view of a run: ranks, phases, step times, alarms",
        description="Follow RUN_DIR (events.jsonl and the ranks' live.json) and redraw every "
        "INTERVAL seconds: per rank its status, phase, step, step time (last and "
        "median), time since its last step, the collective it waits in and its "
        "alarms; the job's attempt, restarts and last checkpoint. Reads files "
        "only; never touches the training processes. Ctrl-C to leave.",
        args=ArgSpec(positional="run_dir"),
    ),
    "slurm": Verb(
        SlurmConfig,
        "shoestring.supervise.slurm:run_slurm",
        help="write (and submit) an sbatch script that checkpoints and requeues itself "
        "before the time limit",
        description="Write an sbatch script for a fine-tune: nodes, GPUs per node, time "
        "limit, --requeue, a warning signal before the time limit, and shoestring "
        "run (through srun and torchrun across nodes). Printed on stdout, written "
        "with --output, submitted with --submit.",
        epilog=SLURM_EPILOG,
        args=ArgSpec(passthrough=FinetuneConfig, config_flag="--slurm-config"),
    ),
    "launch": Verb(
        LaunchConfig,
        "shoestring.supervise.sky:run_launch",
        help="write (and submit) a SkyPilot managed job: the cheapest spot GPU that fits, "
        "recovered after each preemption",
        description="Write a SkyPilot task YAML for a fine-tune: the cheapest GPUs of the "
        "catalog on which the plan says it fits (in order), spot, job recovery (exit 75/76 "
        "always recovered), setup installing shoestring, and run = shoestring finetune "
        "--checkpoint.storage BUCKET --resume auto. Secrets go as SkyPilot secrets, never "
        "into the YAML. Printed on stdout (--dry-run), written with --output, submitted "
        "with --yes (sky jobs launch).",
        epilog=LAUNCH_EPILOG,
        args=ArgSpec(passthrough=FinetuneConfig, config_flag="--launch-config"),
    ),
}


# --------------------------------------------------------------------------- help


def _usage(name: str, verb: Verb) -> str:
    a = verb.args
    parts = [f"usage: shoestring {name}"]
    if a.positional:
        parts.append(a.positional.upper())
    if a.config_flag:
        parts.append(f"[{a.config_flag} FILE.yaml]")
    if verb.options is not None:
        parts += [f"[--{k} VALUE]" for k, _f, _tp in iter_fields(verb.options)]
    parts.append("[--KEY VALUE ...]")
    if a.passthrough is not None:
        parts.append("[--section.key VALUE ...]")
    if a.command:
        parts.append("[--] COMMAND ...")
    return " ".join(parts)


def verb_help(name: str, verb: Verb) -> str:
    """``shoestring VERB --help``: usage, description, every key with its help, epilog."""
    a, flat = verb.args, all("." not in k for k, _f, _tp in iter_fields(verb.config))
    out = [
        _usage(name, verb),
        "",
        textwrap.fill(verb.description, 88, break_on_hyphens=False),
        "",
        "options:",
        "  -h, --help  show this help and exit",
    ]
    if a.config_flag:
        out.append(
            f"  {a.config_flag} FILE.yaml  the keys below in YAML "
            f"({'key: value' if flat else 'nested sections'}); flags override it"
        )
    if verb.options is not None:
        out.append(help_table(verb.options, width=88))
    how = "--key VALUE or --key=VALUE" + (", dashes or underscores" if flat else "")
    out += [
        "",
        textwrap.fill(
            f"keys (in {a.config_flag or 'flags'}; as flags {how}; a boolean "
            "alone means true, --no-KEY false):",
            88,
        ),
        help_table(verb.config, dashes=flat, width=88),
    ]
    if verb.epilog:
        out += ["", verb.epilog.rstrip()]
    return "\n".join(out)


def main_help() -> str:
    rows = "\n".join(f"  {name:<9} {v.help}" for name, v in VERBS.items())
    return (
        f"usage: shoestring [-h] [--version] COMMAND ...\n\n"
        f"Fine-tune and run LLMs on cheap, unreliable GPUs.\n\ncommands:\n{rows}\n\n"
        "`shoestring COMMAND --help` lists the command's keys."
    )


# --------------------------------------------------------------------------- dispatch


def _resolve(target: str | Callable[..., Any]) -> Callable[..., Any]:
    if not isinstance(target, str):
        return target
    module, _, name = target.partition(":")
    fn: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return fn


def run_verb(name: str, verb: Verb, args: list[str], env: dict[str, str]) -> int:
    """Read the verb's keys (defaults, YAML, flags), then run it."""
    parsed = parse_command_line(args, verb.config, verb.args, also=verb.options)
    if parsed.help:
        print(verb_help(name, verb))
        raise SystemExit(exitcodes.OK)
    layers = (
        read_yaml(parsed.config_file, verb.args.config_flag or "--config")
        if parsed.config_file
        else []
    )
    option_keys = {k for k, _f, _tp in iter_fields(verb.options)} if verb.options else set()
    layers += [layer for layer in parsed.layers if layer[0] not in option_keys]
    cfg: Any = build(verb.config, layers)
    options = (
        build(verb.options, [layer for layer in parsed.layers if layer[0] in option_keys])
        if verb.options
        else None
    )
    call = Invocation(env=env, rest=tuple(parsed.rest), options=options)
    code: int = _resolve(verb.runner)(cfg, call)
    return code


def dispatch(argv: list[str], env: dict[str, str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(main_help())
        return exitcodes.USAGE if not argv else exitcodes.OK
    if argv[0] == "--version":
        print(f"shoestring {__version__}")
        return exitcodes.OK
    name, args = argv[0], argv[1:]
    verb = VERBS.get(name)
    if verb is None:
        hint = difflib.get_close_matches(name, VERBS, n=1)
        print(
            f"shoestring: error: unknown command {name!r}"
            + (f" (did you mean {hint[0]!r}?)" if hint else "")
            + f"; commands: {', '.join(VERBS)}",
            file=sys.stderr,
        )
        return exitcodes.USAGE
    return run_verb(name, verb, args, env)


#: Iterations a waiting OpenMP thread spins before it sleeps (libgomp's default: 300,000,
#: a few ms; 100,000 is about 1 ms). See :func:`openmp_defaults`.
OMP_SPIN_COUNT = 3000


def openmp_defaults(env: Mapping[str, str]) -> dict[str, str]:
    """What to add to the environment before torch is imported: a short OpenMP spin
    (``GOMP_SPINCOUNT``), unless the environment already says how OpenMP threads wait
    (``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``). GNU libgomp, the OpenMP runtime in
    torch's wheels, reads them once, as torch loads it, so this runs before any
    ``import torch``; child processes (``shoestring run``'s ranks) inherit it.

    With libgomp's default a thread that finished its share of an operation spins a few
    ms for the others; when another process keeps a core busy, the spinning thread takes
    the CPU from the one it waits for. The measurements behind the choice: docs/
    architecture.md, "CPU threads beside a busy neighbour"."""
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return {}
    return {"GOMP_SPINCOUNT": str(OMP_SPIN_COUNT)}


#: ``errno`` values that mean the disk (or the user's quota) is full.
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def disk_full(e: OSError) -> str:
    """One line for a full disk met outside a save (which says its own): the path, and
    that what was committed is untouched (every commit writes beside, then renames)."""
    where = f"cannot write {e.filename}" if e.filename else "a write failed"
    return (
        f"no space left on device: {where} ({e.strerror}); committed checkpoints and "
        "outputs are untouched: free some space and rerun the same command"
    )


def main(argv: list[str] | None = None) -> int:
    os.environ.update(openmp_defaults(os.environ))  # before anything imports torch
    logging.basicConfig(
        level=logging.INFO, format="[shoestring] %(levelname)s %(message)s", stream=sys.stderr
    )
    for noisy in ("transformers", "peft", "botocore", "s3fs", "aiobotocore", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    quiet_hub_kernel_notice()
    for handler in logging.getLogger().handlers:  # no credentials in any log line
        handler.addFilter(RedactingFilter())
    threading.excepthook = print_thread_exception  # nor in a thread's traceback
    args = sys.argv[1:] if argv is None else list(argv)
    command = args[0] if args else ""
    try:
        code = dispatch(args, dict(os.environ))
        sys.stdout.flush()  # here, where a reader that left is caught below
        return code
    except ConfigError as e:
        print(redact_text(f"shoestring {command}: error: {e}"), file=sys.stderr)
        return exitcodes.USAGE
    except BrokenPipeError:  # `shoestring plan | head`: the reader left, nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error
        return exitcodes.FAILED
    except Exception as e:  # noqa: BLE001 - a clear one-line error, traceback on request
        from shoestring.checkpoint import CheckpointSaveError
        from shoestring.data.records import DataError

        if isinstance(e, DataError):
            print(redact_text(f"shoestring {command}: error: {e}"), file=sys.stderr)
            return exitcodes.USAGE
        if isinstance(e, CheckpointSaveError):
            print(redact_text(f"shoestring {command}: error: {e}"), file=sys.stderr)
            return exitcodes.FAILED
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            print(redact_text(f"shoestring {command}: error: {disk_full(e)}"), file=sys.stderr)
            return exitcodes.FAILED
        # The traceback, with any credential in its messages redacted.
        print(redact_text(traceback.format_exc()), end="", file=sys.stderr, flush=True)
        return exitcodes.FAILED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
