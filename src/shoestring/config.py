"""One config system for every verb.

A config is a tree of dataclasses. Each field carries its help text in
``metadata["help"]``; that text feeds ``--help`` and the docs. Values come from
three layers, later ones winning: the dataclass defaults, a YAML file
(``--config``), and dotted command-line overrides (``--train.lr 1e-4``).

Every value is checked before any expensive work. A bad key or value raises
:class:`ConfigError` whose message names the key and where it came from: the
YAML file and line, or the command-line flag.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import yaml


class ConfigError(ValueError):
    """A configuration problem that names the key and its source."""


def knob(default: Any, help: str, *, choices: tuple[str, ...] | None = None,
         check: Callable[[Any], str | None] | None = None) -> Any:
    """A config field: default value, help text, optional choices and check.

    ``check`` returns an error string (without the key) or ``None``.
    """
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if check is not None:
        meta["check"] = check
    if isinstance(default, (list, dict)):
        def copy_of() -> Any:  # a fresh list/dict per instance
            return type(default)(default)
        return field(default_factory=copy_of, metadata=meta)
    return field(default=default, metadata=meta)


def positive(v: Any) -> str | None:
    return None if v > 0 else "must be > 0"


def non_negative(v: Any) -> str | None:
    return None if v >= 0 else "must be >= 0"


def unit_interval(v: Any) -> str | None:
    return None if 0.0 <= v < 1.0 else "must be in [0, 1)"


# --------------------------------------------------------------------------- finetune


@dataclass
class ModelConfig:
    path: str = knob("builtin:tiny", "Local directory of a Hugging Face causal LM (config.json, "
                     "weights, tokenizer). 'builtin:tiny' builds the embedded tiny model.")
    dtype: str = knob("auto", "Dtype of the frozen base weights. 'auto': float32 on CPU; on "
                      "CUDA bfloat16 where the GPU supports it, else float16 (T4, V100). "
                      "Resolved once at start and recorded in config.yaml.",
                      choices=("auto", "float32", "bfloat16", "float16"))
    gradient_checkpointing: bool = knob(False, "Recompute activations in backward to save memory.")
    attn_implementation: str = knob("sdpa", "Attention kernel: 'sdpa' (torch's fused "
                                    "scaled-dot-product attention), 'eager' (plain matmuls), "
                                    "'flash_attention_2' (needs the flash-attn package and a "
                                    "CUDA GPU).",
                                    choices=("sdpa", "eager", "flash_attention_2"))


@dataclass
class DataConfig:
    train: str = knob("builtin:reverse", "Training JSONL: one {\"text\": ...} or "
                      "{\"prompt\": ..., \"completion\": ...} object per line. "
                      "'builtin:reverse' uses the bundled word-reversal task.")
    eval: str = knob("auto", "Held-out JSONL in the same format. 'auto': the bundled task's "
                     "held-out split when data.train is built in, else none. Empty: no eval.")
    max_length: int = knob(64, "Maximum tokens per sample (packing block size when packing).",
                           check=positive)
    packing: bool = knob(False, "Pack samples into max_length blocks instead of padding each batch.")


@dataclass
class TrainConfig:
    max_steps: int = knob(1000, "Optimizer steps to train for.", check=positive)
    seed: int = knob(0, "Seed for LoRA init, dropout and data order.")
    batch_size: int = knob(16, "Global batch: samples per optimizer step, summed over ranks and "
                           "accumulated micro-batches. The same at any world size.",
                           check=positive)
    micro_batch_size: int = knob(0, "Samples per forward pass on one rank (0: batch_size / world "
                                 "size, no accumulation). Accumulation steps = batch_size / "
                                 "(micro_batch_size x world size). Dropout masks are drawn per "
                                 "micro-batch: keep it fixed to resume exactly at another world "
                                 "size.", check=non_negative)
    lr: float = knob(2e-3, "Peak learning rate of AdamW.", check=positive)
    weight_decay: float = knob(0.0, "AdamW weight decay.", check=non_negative)
    warmup_steps: int = knob(30, "Linear warm-up steps before the cosine decay.", check=non_negative)
    min_lr_ratio: float = knob(0.1, "Final learning rate as a fraction of train.lr.",
                               check=unit_interval)
    max_grad_norm: float = knob(1.0, "Clip the gradient norm to this (0: no clipping).",
                                check=non_negative)
    log_every_steps: int = knob(10, "Plain-log interval in steps when stderr is not a terminal.",
                                check=positive)
    num_threads: int = knob(0, "torch intra-op threads (0: leave torch's default).",
                            check=non_negative)
    device: str = knob("auto", "Where training runs: 'auto' (cuda:LOCAL_RANK when CUDA is "
                       "available, else cpu), 'cpu', 'cuda' (cuda:LOCAL_RANK) or 'cuda:N'. "
                       "Base model, adapters, batches and optimizer state all live there.",
                       check=lambda v: None if re.fullmatch(r"auto|cpu|cuda(:\d+)?", v)
                       else "must be auto, cpu, cuda or cuda:N")
    precision: str = knob("auto", "Compute precision of forward and backward: 'bf16' (autocast "
                          "to bfloat16), 'fp16' (autocast to float16 with a gradient scaler, "
                          "checkpointed; CUDA only), 'fp32'. 'auto': bf16 on GPUs that support "
                          "it, fp16 on older ones (T4, V100), fp32 on CPU. Adapters and "
                          "optimizer state stay float32.",
                          choices=("auto", "bf16", "fp16", "fp32"))
    deterministic: bool = knob(False, "Reproducible CUDA kernels: torch.use_deterministic_algorithms, "
                               "CUBLAS_WORKSPACE_CONFIG=:4096:8, cuDNN benchmark and TF32 off. "
                               "With it a resumed GPU run is byte-identical to an uninterrupted "
                               "one (CPU runs are already). Costs speed: see docs/planner.md.")
    optimizer: str = knob("adamw", "adamw: torch AdamW (fp32 moments). adamw8bit: bitsandbytes "
                          "8-bit AdamW (moments in uint8 blocks, 4x smaller). paged_adamw8bit: "
                          "the same in CUDA unified memory, paged to host RAM under pressure "
                          "(absorbs spikes; on CPU it equals adamw8bit).",
                          choices=("adamw", "adamw8bit", "paged_adamw8bit"))


@dataclass
class EvalConfig:
    every_steps: int = knob(0, "Evaluate every N steps (0: only before and after training).",
                            check=non_negative)
    batch_size: int = knob(32, "Samples per eval batch.", check=positive)
    max_samples: int = knob(0, "Evaluate on at most this many samples (0: all).",
                            check=non_negative)
    exact_match: bool = knob(True, "For prompt/completion data, also greedy-decode each prompt "
                             "and report exact-match accuracy.")
    max_new_tokens: int = knob(32, "Generation cap for exact-match eval.", check=positive)


@dataclass
class LoraSection:
    r: int = knob(16, "LoRA rank.", check=positive)
    alpha: float = knob(32.0, "LoRA scaling numerator (scale = alpha / r).", check=positive)
    dropout: float = knob(0.05, "Dropout on the LoRA input.", check=unit_interval)
    target_modules: list[str] = knob(["all-linear"], "Module names to adapt, or ['all-linear'].")
    quantize: str = knob("none", "Load the frozen base quantized by bitsandbytes (QLoRA): 'nf4' "
                         "is 4-bit NormalFloat with double quantization, 'int8' is LLM.int8. "
                         "Needs the qlora extra (pip install 'shoestring[qlora]'). On CPU, "
                         "4-bit layer widths must be multiples of 64.",
                         choices=("none", "nf4", "int8"))


@dataclass
class CheckpointConfig:
    every_steps: int = knob(100, "Save every N optimizer steps (0: off). With interval "
                            "'auto', the interval until the first save is timed.",
                            check=non_negative)
    interval: str = knob("fixed", "'fixed': every_steps / every_seconds. 'auto': choose the "
                         "interval from the measured blocking cost of a save and the mean "
                         "time between failures that lose work (Young/Daly), re-tuned "
                         "after every save.", choices=("fixed", "auto"))
    mtbf_hours: float = knob(20.0, "interval 'auto': prior mean time between failures that "
                             "lose work (kills without notice), updated by the failures this "
                             "run has seen.", check=positive)
    every_seconds: float = knob(0.0, "Also save when this many seconds passed since the last "
                                "save (0: off).", check=non_negative)
    keep: int = knob(2, "Committed checkpoints to keep; older ones are deleted only after a "
                     "newer one is committed.", check=positive)
    storage: str = knob("", "Where checkpoints are published: a local path or an fsspec URL "
                        "(s3://bucket/prefix, gs://...). Empty: OUTPUT/checkpoints only. "
                        "OUTPUT/checkpoints is always the local cache.")
    async_mode: str = knob("thread", "Serialize and upload in a background thread, a "
                           "background process, or 'off' (synchronous).",
                           choices=("thread", "process", "off"))
    verify: bool = knob(True, "Verify sha256 of every file against the manifest on load.")


@dataclass
class PreemptConfig:
    signal: str = knob("SIGUSR1", "Extra signal that means 'checkpoint and exit' besides "
                       "SIGTERM and SIGINT (NCCL may use SIGUSR1; SIGUSR2 is the alternative).",
                       choices=("SIGUSR1", "SIGUSR2", "none"))
    cloud: str = knob("auto", "Cloud preemption notices to watch: 'aws' (Spot interruption, "
                      "~2 min), 'gcp' (Spot/preemptible, ~30 s), 'azure' (Spot Preempt event, "
                      ">= 30 s), 'none', or 'auto': detect the provider from the firmware's "
                      "DMI strings (no network probe; none found: no watcher).",
                      choices=("auto", "none", "aws", "gcp", "azure"))
    metadata_url: str = knob("", "Base URL of the metadata service for preempt.cloud (empty: "
                             "http://169.254.169.254). Point it at a fake server to rehearse a "
                             "preemption: python -m shoestring.preempt.fakes aws. Needs an "
                             "explicit preempt.cloud.")
    poll_s: float = knob(1.0, "Seconds between metadata polls for aws and azure (AWS advises "
                         "<= 5; gcp long-polls and ignores this).", check=positive)


@dataclass
class CostConfig:
    market: str = knob("spot", "Price the cost ledger charges: spot or on-demand.",
                       choices=("spot", "on_demand"))
    usd_per_hour: float = knob(0.0, "Price per device-hour on that market (0: the GPU "
                               "catalog of shoestring plan, by the detected GPU).",
                               check=non_negative)


@dataclass
class ExportConfig:
    merged: bool = knob(False, "Also write OUTPUT/merged/: the base model with the adapter merged in.")


@dataclass
class DistributedConfig:
    strategy: str = knob("ddp", "With several processes (torchrun, shoestring run "
                         "--nproc-per-node, srun): 'ddp' replicates the model on each rank; "
                         "'fsdp' shards weights, gradients and optimizer state (FSDP2) for "
                         "models that do not fit one device. Ignored in a single process.",
                         choices=("ddp", "fsdp"))
    backend: str = knob("auto", "torch.distributed backend ('auto': nccl on GPUs, gloo on CPU).",
                        choices=("auto", "gloo", "nccl"))
    timeout_s: float = knob(1800.0, "Collective timeout in seconds (the last resort; "
                            "shoestring run detects hangs sooner).", check=positive)


@dataclass
class WatchConfig:
    enabled: bool = knob(True, "Publish this rank's live state (phase, step, collectives) to "
                         "OUTPUT/ranks/rank<R>/live.json for the shoestring run watchdog.")
    interval_s: float = knob(1.0, "How often the live state is written, in seconds.",
                             check=positive)


@dataclass
class PlanSection:
    gpu: str = knob("auto", "GPU to plan memory for before loading the model: a catalog name "
                    "(shoestring plan --list-gpus), 'auto' (the detected CUDA device; no check "
                    "on CPU) or 'none' (no check).")
    enforce: bool = knob(True, "Refuse to start when the plan says the config will not fit "
                         "the GPU (false: warn and start anyway).")


@dataclass
class FinetuneConfig:
    output_dir: str = knob("runs/finetune", "Run directory: events.jsonl, checkpoints/, final/.")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    lora: LoraSection = field(default_factory=LoraSection)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    preempt: PreemptConfig = field(default_factory=PreemptConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    watch: WatchConfig = field(default_factory=WatchConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    plan: PlanSection = field(default_factory=PlanSection)


#: Keys that may change between a checkpoint and its resume without breaking
#: the continuation. Anything else changed makes ``--resume`` refuse.
RESUME_SAFE_PREFIXES: tuple[str, ...] = (
    "output_dir", "train.max_steps", "train.log_every_steps", "train.num_threads",
    "train.device", "train.deterministic",
    "eval.", "checkpoint.", "preempt.", "export.", "data.eval", "distributed.", "watch.", "cost.",
    "plan.",
)


# --------------------------------------------------------------------------- machinery


@dataclass(frozen=True)
class Source:
    """Where a value came from (for error messages) and its raw text, if a scalar."""

    where: str  # "path/to/file.yaml:12" or "--train.lr" or "default"
    raw: str | None = None  # unparsed text: string keys keep "off", "no", "1e-3" as typed

    def __str__(self) -> str:
        return self.where


def iter_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field[Any], type]]:
    """Yield (dotted key, field, resolved type) for every leaf of a config class."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            yield from iter_fields(typing.cast(type, tp), key + ".")
        else:
            yield key, f, tp


def _coerce(key: str, value: Any, tp: Any, src: Source) -> Any:
    def bad(expected: str) -> ConfigError:
        return ConfigError(f"{src}: '{key}' expects {expected}, got {value!r}")

    origin = typing.get_origin(tp)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad("true or false")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise bad("an integer")
        return value
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads "2e-4" as a string; accept it as users mean it.
            try:
                return float(value)
            except ValueError:
                raise bad("a number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        return float(value)
    if tp is str:
        if src.raw is not None and not isinstance(value, (dict, list)):
            return src.raw
        if value is None:
            return ""
        if isinstance(value, (dict, list)):
            raise bad("a string")
        return str(value)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise bad("a list")
        item_src = Source(src.where)
        return [_coerce(key, v, item_tp, item_src) for v in value]
    raise ConfigError(f"{src}: '{key}' has unsupported type {tp}")  # pragma: no cover


def _yaml_leaves(node: yaml.Node, path: str, prefix: str = "") -> Iterator[tuple[str, Any, Source]]:
    if not isinstance(node, yaml.MappingNode):
        where = f"{path}:{node.start_mark.line + 1}"
        raise ConfigError(f"{where}: expected a mapping of config keys")
    for k_node, v_node in node.value:
        key = f"{prefix}{k_node.value}"
        raw = v_node.value if isinstance(v_node, yaml.ScalarNode) and v_node.tag != \
            "tag:yaml.org,2002:null" else None
        src = Source(f"{path}:{k_node.start_mark.line + 1}", raw)
        if isinstance(v_node, yaml.MappingNode):
            yield from _yaml_leaves(v_node, path, key + ".")
        else:
            try:
                value = yaml.SafeLoader("").construct_document(v_node)
            except yaml.YAMLError as e:
                raise ConfigError(f"{src}: cannot read value of '{key}': {e}") from e
            yield key, value, src


def read_yaml(path: str | Path) -> list[tuple[str, Any, Source]]:
    """Read a YAML config into (dotted key, value, source) triples with line numbers."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"--config: cannot read {p}: {e.strerror}") from e
    try:
        node = yaml.compose(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}" if mark else str(p)
        raise ConfigError(f"{where}: invalid YAML: {getattr(e, 'problem', e)}") from e
    if node is None:
        return []
    return list(_yaml_leaves(node, str(p)))


def parse_overrides(args: list[str]) -> list[tuple[str, Any, Source]]:
    """Parse ``--a.b VALUE`` / ``--a.b=VALUE`` pairs; values are read as YAML scalars."""
    out: list[tuple[str, Any, Source]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) <= 2:
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key VALUE")
        if "=" in arg:
            flag, raw = arg.split("=", 1)
            i += 1
        else:
            flag = arg
            if i + 1 >= len(args):
                raise ConfigError(f"{flag}: missing value")
            raw = args[i + 1]
            i += 2
        key = flag[2:].replace("-", "_")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        out.append((key, value, Source(flag, raw)))
    return out


def build(cls: type, layers: list[tuple[str, Any, Source]]) -> Any:
    """Build and validate a config object from (key, value, source) triples."""
    leaves = {key: (f, tp) for key, f, tp in iter_fields(cls)}
    values: dict[str, Any] = {}
    for key, value, src in layers:
        if key not in leaves:
            hint = difflib.get_close_matches(key, leaves, n=1)
            extra = f" (did you mean '{hint[0]}'?)" if hint else ""
            raise ConfigError(f"{src}: unknown key '{key}'{extra}")
        f, tp = leaves[key]
        v = _coerce(key, value, tp, src)
        choices = f.metadata.get("choices")
        if choices is not None and v not in choices:
            raise ConfigError(f"{src}: '{key}' must be one of {', '.join(choices)}; got {v!r}")
        check = f.metadata.get("check")
        if check is not None:
            problem = check(v)
            if problem:
                raise ConfigError(f"{src}: '{key}' {problem}; got {v!r}")
        values[key] = v
    return _instantiate(cls, values, "")


def _instantiate(cls: type, values: Mapping[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _instantiate(typing.cast(type, tp), values, key + ".")
        elif key in values:
            kwargs[f.name] = values[key]
    return cls(**kwargs)


def load(cls: type, config_file: str | None, overrides: list[str]) -> Any:
    """Defaults, then the YAML file, then command-line overrides."""
    layers: list[tuple[str, Any, Source]] = []
    if config_file:
        layers += read_yaml(config_file)
    layers += parse_overrides(overrides)
    return build(cls, layers)


def to_flat(cfg: Any) -> dict[str, Any]:
    """Flatten a config object to {dotted key: value}."""
    out: dict[str, Any] = {}
    for key, _f, _tp in iter_fields(type(cfg)):
        obj = cfg
        for part in key.split("."):
            obj = getattr(obj, part)
        out[key] = obj
    return out


def to_yaml(cfg: Any) -> str:
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)


def resume_relevant(flat: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in flat.items() if not k.startswith(RESUME_SAFE_PREFIXES)}


def config_hash(cfg: Any) -> str:
    """Hash of the keys that must not change across a resume."""
    blob = json.dumps(resume_relevant(to_flat(cfg)), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def help_table(cls: type) -> str:
    """Every key with its type, default and help, for ``--help``."""
    lines = []
    defaults = to_flat(cls())
    for key, f, tp in iter_fields(cls):
        tname = getattr(tp, "__name__", str(tp)).replace("typing.", "")
        if typing.get_origin(tp) is list:
            tname = "list"
        choices = f.metadata.get("choices")
        tdesc = "|".join(choices) if choices else tname
        lines.append(f"  --{key} {tdesc.upper() if not choices else tdesc}  (default: {defaults[key]!r})")
        lines.append(f"      {f.metadata.get('help', '')}")
    return "\n".join(lines)
