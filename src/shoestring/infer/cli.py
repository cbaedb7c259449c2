"""``shoestring infer``: its entry in the verb table (``shoestring.cli``) reads the
keys like every verb's (defaults, ``--config`` YAML, flags; the short flags are
aliases); here the environment edge: faults, ``SOURCE_DATE_EPOCH``, the Hub."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

from shoestring.config import ArgSpec, ConfigError, Invocation, build, parse_command_line, read_yaml
from shoestring.hub import HubAccess
from shoestring.infer.config import ALIASES, InferConfig

#: How ``shoestring infer``'s command line maps onto its keys besides ``--KEY VALUE``:
#: the short flags, as documented (``--memory-budget``) and with underscores
#: (``--memory_budget``), which the command has always taken too.
INFER_ARGS = ArgSpec(
    aliases={
        **ALIASES,
        **{"--" + flag[2:].replace("-", "_"): key for flag, key in ALIASES.items()},
    }
)

INFER_DESCRIPTION = (
    "Greedy generation or likelihood scoring of a JSONL file with a Hugging Face decoder "
    "model (a local folder, a Hub id or a bucket URL), streaming its layers from the "
    "safetensors shards within a memory budget. Preemptible: rerun to resume."
)

INFER_EPILOG = """\
short flags (each is the config key on its right):
{aliases}

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
             or {{"prompt_ids": [...], "completion_ids": [...]}} (token ids, as given)
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
""".format(aliases="\n".join(f"  {flag:<18} {key}" for flag, key in ALIASES.items()))


def load_config(config_file: str | None, args: list[str]) -> InferConfig:
    """Defaults, YAML, then flags, read as ``shoestring infer`` reads them (errors name
    the flag as typed): for callers outside the command (tests, scripts)."""
    layers = read_yaml(config_file) if config_file else []
    layers += parse_command_line(args, InferConfig, INFER_ARGS).layers
    return build(InferConfig, layers)


def run_infer_verb(cfg: InferConfig, call: Invocation) -> int:
    """The environment edge of ``infer``: faults, the outputs' ``created``, the Hub."""
    from shoestring.checkpoint.faults import FaultPlan
    from shoestring.infer.job import run_infer
    from shoestring.infer.prepare import default_run_dir

    env = call.env
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


def hub_access(env: Mapping[str, str]) -> HubAccess:
    """How a model id or bucket URL in --model/--adapter is fetched (docs/models.md)."""
    from shoestring.checkpoint.mirror import fetch_model_folder

    cache = Path(env.get("SHOESTRING_CACHE") or Path.home() / ".cache" / "shoestring")
    tty = sys.stderr.isatty()
    return HubAccess.from_env(env, cache, buckets=fetch_model_folder, progress=tty)
