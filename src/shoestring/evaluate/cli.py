"""``shoestring evaluate``: lm-evaluation-harness tasks, scored by streamed inference.

The story: check the keys, lm-eval and the task names (before any weights load),
hold the work directory, open its event log, answer lm-eval's requests with
inference jobs (:mod:`.jobs`), write the results atomically. A preempted job ends
the command with its exit code; the same command resumes it.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

from shoestring import exitcodes
from shoestring.config import ConfigError, Invocation
from shoestring.evaluate.config import EvaluateConfig
from shoestring.evaluate.jobs import InferJobs, JobEnv, JobStopped, Refused
from shoestring.evaluate.tasks import task_manager
from shoestring.events import EventLog
from shoestring.fsio import atomic_write, unwritable
from shoestring.hub import HubAccess, resolve
from shoestring.infer.config import InferConfig
from shoestring.rundir import RunDir, hold

INSTALL_HINT = "shoestring evaluate needs lm-eval: pip install 'shoestring[eval]'"


def run_evaluate(cfg: EvaluateConfig, call: Invocation) -> int:
    """The environment edge of ``evaluate``: faults and the Hub, then :func:`evaluate`."""
    from shoestring.checkpoint.faults import FaultPlan
    from shoestring.infer.cli import hub_access

    _required_keys(cfg)
    work = Path(cfg.work_dir)
    try:
        faults = FaultPlan.parse(
            call.env.get("SHOESTRING_FAULTS", ""), once_dir=work / ".faults-fired"
        )
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return evaluate(cfg, JobEnv(faults, hub_access(call.env)))


def _required_keys(cfg: EvaluateConfig) -> None:
    for key, value in (("model.path", cfg.model.path), ("tasks", cfg.tasks),
                       ("work_dir", cfg.work_dir)):  # fmt: skip
        if not value:
            raise ConfigError(f"--{key.replace('_', '-')} ({key}) is required")


def infer_config(cfg: EvaluateConfig) -> InferConfig:
    """The keys every inference job of the evaluation shares."""
    return InferConfig(model=cfg.model, memory=cfg.memory, compress=cfg.compress, job=cfg.job)


def evaluate(cfg: EvaluateConfig, env: JobEnv | None = None) -> int:
    """Score ``cfg.tasks`` with inference jobs in ``cfg.work_dir``; an exit code."""
    _lm_eval()
    _required_keys(cfg)
    tasks = task_manager(cfg.tasks, cfg.include_path)
    work = Path(cfg.work_dir)
    output = _output_path(cfg, work)
    with (
        hold(work, "wait for it to end, or use another --work-dir"),
        _open_log(RunDir(work)) as log,
    ):
        log.emit("evaluate_start", tasks=cfg.tasks, model=cfg.model.path, pid=os.getpid())
        try:
            results = _simple_evaluate(
                cfg, InferJobs(infer_config(cfg), work / "jobs", log, env or JobEnv()), tasks
            )
        except JobStopped as e:
            log.emit("evaluate_preempt", job=str(e.folder), code=e.code)
            print(f"shoestring evaluate: {e}; rerun the same command", file=sys.stderr)
            return e.code
        except Refused as e:
            log.emit("evaluate_end", status="refused", error=str(e))
            print(str(e), file=sys.stderr)
            return exitcodes.USAGE
        atomic_write(output, _results_json(results, cfg.log_samples))
        log.emit("evaluate_end", status="completed", output=str(output),
                 results=results.get("results", {}))  # fmt: skip
    print(_table(results), file=sys.stderr)
    return exitcodes.OK


def _output_path(cfg: EvaluateConfig, work: Path) -> Path:
    """Where the results go, its folder checked writable before any work."""
    if not cfg.output:
        return work / "results.json"
    output = Path(cfg.output)
    problem = unwritable(output.parent)
    if problem is not None:
        raise ConfigError(f"--output: cannot write into {output.parent}: {problem.strerror}")
    return output


def _simple_evaluate(cfg: EvaluateConfig, jobs: InferJobs, tasks: Any) -> dict[str, Any]:
    from lm_eval import simple_evaluate

    from shoestring.evaluate.lm import StreamedLM

    tok, context = _tokenizer(cfg, jobs.env.hub)
    results = simple_evaluate(
        model=StreamedLM(jobs, tok, context),
        tasks=list(cfg.tasks),
        num_fewshot=None if cfg.num_fewshot < 0 else cfg.num_fewshot,
        limit=cfg.limit or None,
        task_manager=tasks,
        log_samples=cfg.log_samples,
        random_seed=cfg.seed,
        numpy_random_seed=cfg.seed,
        torch_random_seed=cfg.seed,
        fewshot_random_seed=cfg.seed,
    )
    assert isinstance(results, dict), "one process: lm-eval returns the results"
    return results


def _tokenizer(cfg: EvaluateConfig, hub: HubAccess | None) -> tuple[Any, int]:
    """The model's tokenizer (lm-eval tokenizes) and context, found as lm-eval's ``hf``
    backend finds it (the config's ``n_positions``/``max_position_embeddings``/``n_ctx``,
    its ``text_config``'s first, then the tokenizer's ``model_max_length``, else 2048)."""
    from lm_eval.models.utils import resolve_max_length
    from transformers import AutoConfig

    from shoestring.evaluate.lm import DEFAULT_MAX_LENGTH
    from shoestring.hf import load_tokenizer, quiet_hf

    ref = resolve(cfg.model.path, hub or HubAccess(Path.home() / ".cache" / "shoestring"),
                  key="--model.path (model.path)")  # fmt: skip
    quiet_hf()
    tok = load_tokenizer(ref.path)
    config = AutoConfig.from_pretrained(ref.path)
    return tok, resolve_max_length(config, tok, default=DEFAULT_MAX_LENGTH)


def _lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None


def _open_log(rd: RunDir) -> EventLog:
    run_id = rd.run_id()
    if run_id is None:
        run_id = uuid.uuid4().hex[:12]
        rd.record(run_id=run_id, verb="evaluate")
    return EventLog(rd.events, run_id=run_id)


def _results_json(results: dict[str, Any], samples: bool) -> bytes:
    from lm_eval.utils import handle_non_serializable

    doc = {k: v for k, v in results.items() if samples or k != "samples"}
    return (json.dumps(doc, indent=2, default=handle_non_serializable) + "\n").encode()


def _table(results: dict[str, Any]) -> str:
    from lm_eval.utils import make_table

    return str(make_table(results))
