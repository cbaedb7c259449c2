"""``shoestring infer``: argument parsing at the edge; the job gets a config object."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shoestring.config import ConfigError, build, help_table, parse_overrides, read_yaml
from shoestring.hub import HubAccess
from shoestring.infer.config import ALIASES, InferConfig

EPILOG = """\
short flags (each is the config key on its right):
{aliases}

config keys (set in --config YAML as nested sections, or as --section.key VALUE):
{table}

input JSONL, one object per line (-> output fields):
  OpenAI batch file (as for OpenAI's Batch API or vLLM run-batch), generate mode:
             {{"custom_id", "method": "POST", "url": "/v1/chat/completions" or
              "/v1/completions", "body": {{"messages" or "prompt", "max_tokens",
              "temperature", "top_p", "top_k", "seed", "stop", "logprobs", ...}}}}
               -> {{"id", "custom_id", "response": {{"status_code", "request_id",
                  "body": chat.completion or text_completion}}, "error"}}, in input
                  order; a line that cannot be answered gets an "error" instead
  generate:  {{"prompt": "...", "id": ...}} or {{"messages": [...]}}
               -> {{"index", "id", "completion", "tokens", "finish"}}
  score:     {{"prompt": "...", "completion": "..."}}
               -> {{"index", "logprob", "tokens", "greedy"}}
             {{"prompt": "...", "choices": [...]}}
               -> {{"index", "choice", "label", "logprobs", "tokens"}}

resume: the job commits its output in chunks to OUTPUT.run/chunks/; rerunning the
same command after any kill computes only the missing chunks, and OUTPUT ends
byte-identical to an uninterrupted run.

exit codes:
  0 done; 1 failed; 2 bad config or input (nothing started);
  75 preempted (SIGTERM/SIGINT/SIGUSR1): committed chunks and the state of the chunk in
     flight are kept, rerun the same command;
  76 second signal: exited at once, committed chunks intact, rerun.

environment (read here only):
  SOURCE_DATE_EPOCH  the "created" time of OpenAI batch output lines (default: the
                     run's first start), for outputs comparable across runs
  SHOESTRING_CACHE   where bucket model folders are copied (default ~/.cache/shoestring)
  HF_TOKEN HF_ENDPOINT HF_HUB_OFFLINE HF_HOME HF_HUB_CACHE   --model/--adapter as a Hub
                     id (org/name[@revision]): token, mirror, cache only, the HF cache
                     (docs/models.md)
  SHOESTRING_FAULTS  fault injection for tests, e.g. step.end@3:kill (the 3rd pass),
                     ckpt.before_rename@2:kill (inside the 2nd commit) or
                     pass.unit@7:term (SIGTERM between two layers of the 2nd pass)
"""


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    aliases = "\n".join(f"  {flag:<18} {key}" for flag, key in ALIASES.items())
    p: argparse.ArgumentParser = sub.add_parser(
        "infer",
        help="batch inference of models larger than memory, streamed layer by layer",
        description="Greedy generation or likelihood scoring of a JSONL file with a "
        "Hugging Face decoder model (a local folder, a Hub id or a bucket URL), streaming "
        "its layers from the safetensors shards within a memory budget. Preemptible: rerun "
        "to resume.",
        epilog=EPILOG.format(aliases=aliases, table=help_table(InferConfig)),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", metavar="FILE.yaml", help="YAML config; flags override it")
    return p


def load_config(config_file: str | None, rest: list[str]) -> InferConfig:
    """Defaults, YAML, then flags; the issue's short flags map onto config keys and
    errors still name the flag as typed."""
    short = {flag[2:].replace("-", "_"): key for flag, key in ALIASES.items()}
    layers = read_yaml(config_file) if config_file else []
    for key, value, src in parse_overrides(rest):
        layers.append((short.get(key, key), value, src))
    return build(InferConfig, layers)


def run(args: argparse.Namespace, rest: list[str], env: dict[str, str]) -> int:
    from shoestring.checkpoint.faults import FaultPlan
    from shoestring.infer.job import run_infer
    from shoestring.infer.prepare import default_run_dir

    cfg = load_config(args.config, rest)
    run_dir = (
        Path(cfg.io.run_dir)
        if cfg.io.run_dir
        else (default_run_dir(Path(cfg.io.output)) if cfg.io.output else None)
    )
    try:
        faults = FaultPlan.parse(
            env.get("SHOESTRING_FAULTS", ""),
            once_dir=run_dir / ".faults-fired" if run_dir else None,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from e
    epoch = env.get("SOURCE_DATE_EPOCH", "")
    if epoch and not epoch.isdigit():
        raise ConfigError(f"SOURCE_DATE_EPOCH: expected unix seconds, got {epoch!r}")
    created = int(epoch) if epoch else None
    return run_infer(cfg, faults=faults, stream=sys.stderr, created=created, hub=hub_access(env))


def hub_access(env: dict[str, str]) -> HubAccess:
    """How a model id or bucket URL in --model/--adapter is fetched (docs/models.md)."""
    from shoestring.checkpoint.mirror import fetch_model_folder

    cache = Path(env.get("SHOESTRING_CACHE") or Path.home() / ".cache" / "shoestring")
    tty = sys.stderr.isatty()
    return HubAccess.from_env(env, cache, buckets=fetch_model_folder, progress=tty)
