"""``EvaluateConfig``: every knob of ``shoestring evaluate``; the model and memory keys
are ``shoestring infer``'s own, handed to each inference job."""

from __future__ import annotations

from dataclasses import dataclass, field

from shoestring.config import knob, non_negative
from shoestring.infer.config import CompressConfig, InferModelConfig, JobConfig, MemoryConfig

EVALUATE_EPILOG = """\
example:
  shoestring evaluate --model.path ./my-model --tasks arc_easy,hellaswag \\
      --memory.budget 4GB --work-dir runs/eval --output runs/eval/results.json

resume: each batch of lm-eval's requests is one inference job in WORK_DIR/jobs/,
named by a hash of its requests; rerunning the same command after a kill resumes
the interrupted job from its committed chunks and reuses the finished ones.

exit codes:
  0 done; 1 failed; 2 bad config (unknown task, missing key, no lm-eval);
  75/76 an inference job was preempted: rerun the same command.
"""


@dataclass
class EvaluateConfig:
    model: InferModelConfig = field(default_factory=InferModelConfig)
    tasks: list[str] = knob(
        [],
        "lm-eval task (or group, tag, glob) names, comma-separated: --tasks arc_easy,mytask.",
    )
    include_path: str = knob(
        "",
        "A folder of lm-eval task YAMLs (custom tasks), searched before the built-in ones.",
    )
    limit: int = knob(0, "Documents per task (0: all).", check=non_negative)
    num_fewshot: int = knob(
        -1,
        "Few-shot examples in each prompt (-1: the task's own setting).",
        check=lambda v: None if v >= -1 else "must be -1 (the task's) or >= 0",
    )
    seed: int = knob(1234, "Seed of lm-eval's few-shot sampling and document order.")
    work_dir: str = knob(
        "",
        "Run directory: events.jsonl and one inference job folder per batch of requests "
        "(named by their hash). Rerun the same command with it to resume after a kill.",
    )
    output: str = knob(
        "",
        "Where lm-eval's results (JSON) are written when every task is scored (atomically). "
        "Empty: WORK_DIR/results.json.",
    )
    log_samples: bool = knob(
        False, "Also write each document's requests and responses into the results."
    )
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    compress: CompressConfig = field(default_factory=CompressConfig)
    job: JobConfig = field(default_factory=JobConfig)
