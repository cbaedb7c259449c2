"""The config tree of ``shoestring finetune``: every knob, its help and its check.

Lives with the trainer that reads it (the machinery is :mod:`shoestring.config`).
Choices are ``Literal`` aliases: written once here, checked by ``config.build`` and by
mypy at every comparison, and shared with the planner (``shoestring.plan``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NewType, cast

from shoestring.config import (
    ConfigError,
    knob,
    non_negative,
    positive,
    storage_url,
    to_flat,
    unit_interval,
)
from shoestring.data.records import Format as DataFormat
from shoestring.data.records import LossOn, Truncate
from shoestring.hub import hub_repo
from shoestring.preempt.providers import Provider
from shoestring.track.config import TrackConfig

# --------------------------------------------------------------------------- choices

ComputeDtype = Literal["float32", "bfloat16", "float16"]
ModelDtype = Literal["auto", ComputeDtype]
Attention = Literal["sdpa", "eager", "flash_attention_2"]
PrecisionMode = Literal["auto", "bf16", "fp16", "fp32"]
PrecisionName = Literal["bf16", "fp16", "fp32"]
DeviceKind = Literal["cpu", "cuda"]
Optimizer = Literal["adamw", "adamw8bit", "paged_adamw8bit"]
Quantize = Literal["none", "nf4", "int8"]
IntervalMode = Literal["fixed", "auto"]
AsyncMode = Literal["thread", "process", "off"]
PreemptSignal = Literal["SIGUSR1", "SIGUSR2", "none"]
Cloud = Literal["auto", "none", Provider]
Market = Literal["spot", "on_demand"]
DistStrategy = Literal["ddp", "fsdp"]
Backend = Literal["auto", "gloo", "nccl"]
#: GGUF tensor types of ``export.gguf`` (``none``: no GGUF) and ``shoestring export --gguf``.
GgufType = Literal["f16", "bf16", "q8_0"]
GgufExport = Literal["none", "f16", "bf16", "q8_0"]
#: ``train.objective``: supervised fine-tuning, preference tuning on chosen/rejected pairs,
#: or GRPO (online: completions sampled from the policy, scored by reward functions).
Objective = Literal["sft", "dpo", "orpo", "simpo", "grpo"]
#: ``grpo.loss_type``: how GRPO's per-token losses are averaged (TRL's names).
GrpoLoss = Literal["dapo", "grpo", "dr_grpo"]
#: ``grpo.scale_rewards``: advantages divided by their group's std, by the whole batch's
#: std, or only centred.
RewardScale = Literal["group", "batch", "none"]
#: ``train.kernels``: fused training kernels patched into the model (train/kernels.py).
Kernels = Literal["none", "liger"]

# --------------------------------------------------------------------------- the tree


@dataclass
class ModelConfig:
    path: str = knob(
        "builtin:tiny",
        "The Hugging Face causal LM: a local directory (config.json, weights, tokenizer), "
        "a Hub id org/name[@revision] (branch, tag or commit; downloaded into the HF cache, "
        "safetensors only; HF_TOKEN, HF_HUB_OFFLINE) or a folder URL (s3://, gs://, "
        "file://; copied to SHOESTRING_CACHE/models). A resume refuses a Hub ref that now "
        "resolves to another commit (docs/models.md). 'builtin:tiny' builds the embedded "
        "tiny model.",
    )
    dtype: ModelDtype = knob(
        "auto",
        "Dtype of the frozen base weights. 'auto': float32 on CPU; on "
        "CUDA bfloat16 where the GPU supports it, else float16 (T4, V100). "
        "Resolved once at start and recorded in config.yaml.",
    )
    gradient_checkpointing: bool = knob(False, "Recompute activations in backward to save memory.")
    attn_implementation: Attention = knob(
        "sdpa",
        "Attention kernel: 'sdpa' (torch's fused "
        "scaled-dot-product attention), 'eager' (plain matmuls), "
        "'flash_attention_2' (needs the flash-attn package and a "
        "CUDA GPU).",
    )


@dataclass
class DataConfig:
    train: str = knob(
        "builtin:reverse",
        "Training data: a .jsonl/.json/.parquet/.csv file, a folder of such shards, a "
        "datasets save_to_disk folder, an fsspec URL (s3://, gs://, ...) of any of these, "
        "or a Hugging Face dataset name (needs the Hub, or its local cache). "
        "'builtin:reverse' uses the bundled word-reversal task.",
    )
    eval: str = knob(
        "auto",
        "Held-out data, in any form data.train takes, or a fraction of data.train "
        "(e.g. 0.05, split with train.seed). 'auto': the bundled task's held-out split "
        "when data.train is built in, else none. Empty: no eval.",
    )
    format: DataFormat = knob(
        "auto",
        "Record shape: text, prompt_completion, messages (OpenAI chat), alpaca, preference "
        "(prompt/chosen/rejected, text or messages; train.objective dpo|orpo|simpo), "
        "sharegpt; 'auto' detects it per file from the first record (logged).",
    )
    chat_template: str = knob(
        "",
        "Jinja file overriding the tokenizer's chat template (conversations, eval and "
        "infer all use it). Empty: the tokenizer's own.",
    )
    loss_on: LossOn = knob(
        "assistant",
        "Conversations: train on every token ('all'), every assistant turn "
        "('assistant', end-of-turn tokens included) or the last one ('last_assistant').",
    )
    max_length: int = knob(
        64, "Maximum tokens per sample (the packed row length when packing).", check=positive
    )
    truncate: Truncate = knob(
        "right",
        "Samples over max_length: keep the start ('right'), keep the end ('left') or "
        "drop them ('drop'); counted in the 'data' event.",
    )
    packing: bool = knob(
        False,
        "Pack whole samples into max_length rows (best fit); attention never crosses "
        "samples (per-sample position ids).",
    )
    cache: bool = knob(
        True,
        "Tokenize once into a memory-mapped cache (under ~/.cache/shoestring/data) "
        "that restarts and other ranks reuse.",
    )
    cache_storage: str = knob(
        "",
        "fsspec URL to publish the tokenized cache to, so a new machine downloads it "
        "instead of tokenizing. Empty: <checkpoint.storage>/data-cache when "
        "checkpoint.storage is a URL or folder, else local only.",
        check=storage_url,
    )
    workers: int = knob(
        0,
        "Tokenizer processes on a cache miss (0: one per CPU core); datasets under "
        "16,384 records are tokenized in the trainer's process.",
        check=non_negative,
    )


@dataclass
class TrainConfig:
    max_steps: int = knob(1000, "Optimizer steps to train for.", check=positive)
    seed: int = knob(0, "Seed for LoRA init, dropout and data order.")
    batch_size: int = knob(
        16,
        "Global batch: samples per optimizer step, summed over ranks and "
        "accumulated micro-batches. The same at any world size.",
        check=positive,
    )
    micro_batch_size: int = knob(
        0,
        "Samples per forward pass on one rank (0: batch_size / world "
        "size, no accumulation). Accumulation steps = batch_size / "
        "(micro_batch_size x world size). Dropout masks are drawn per "
        "micro-batch: keep it fixed to resume exactly at another world "
        "size.",
        check=non_negative,
    )
    lr: float = knob(2e-3, "Peak learning rate of AdamW.", check=positive)
    weight_decay: float = knob(0.0, "AdamW weight decay.", check=non_negative)
    warmup_steps: int = knob(
        30, "Linear warm-up steps before the cosine decay.", check=non_negative
    )
    min_lr_ratio: float = knob(
        0.1, "Final learning rate as a fraction of train.lr.", check=unit_interval
    )
    max_grad_norm: float = knob(
        1.0, "Clip the gradient norm to this (0: no clipping).", check=non_negative
    )
    log_every_steps: int = knob(
        10, "Plain-log interval in steps when stderr is not a terminal.", check=positive
    )
    num_threads: int = knob(
        0, "torch intra-op threads (0: leave torch's default).", check=non_negative
    )
    device: str = knob(
        "auto",
        "Where training runs: 'auto' (cuda:LOCAL_RANK when CUDA is "
        "available, else cpu), 'cpu', 'cuda' (cuda:LOCAL_RANK) or 'cuda:N'. "
        "Base model, adapters, batches and optimizer state all live there.",
        check=lambda v: (
            None
            if re.fullmatch(r"auto|cpu|cuda(:\d+)?", v)
            else "must be auto, cpu, cuda or cuda:N"
        ),
    )
    precision: PrecisionMode = knob(
        "auto",
        "Compute precision of forward and backward: 'bf16' (autocast to bfloat16), "
        "'fp16' (autocast to float16 with a gradient scaler, checkpointed; CUDA only), 'fp32'. "
        "'auto': bf16 on GPUs that support it, fp16 on older ones (T4, V100), fp32 on CPU. "
        "Adapters and optimizer state stay float32.",
    )
    deterministic: bool = knob(
        False,
        "Reproducible CUDA kernels: torch.use_deterministic_algorithms, "
        "CUBLAS_WORKSPACE_CONFIG=:4096:8, cuDNN benchmark and TF32 off. "
        "With it a resumed GPU run is byte-identical to an uninterrupted "
        "one (CPU runs are already). Costs speed: see docs/planner.md.",
    )
    optimizer: Optimizer = knob(
        "adamw",
        "adamw: torch AdamW (fp32 moments). adamw8bit: bitsandbytes 8-bit AdamW "
        "(moments in uint8 blocks, 4x smaller). paged_adamw8bit: the same in CUDA unified "
        "memory, paged to host RAM under pressure (absorbs spikes; on CPU it equals adamw8bit).",
    )
    loss_chunk_tokens: int = knob(
        0,
        "Chunked cross-entropy: compute the LM head and the loss over this many token "
        "positions of a micro-batch at a time, each chunk checkpointed, so the "
        "vocabulary-sized logits and their gradient are never whole (Llama-3-8B QLoRA at "
        "2048 tokens: 10.5 -> 7.7 GiB planned peak at 512). The loss is transformers' "
        "(same reduction; the chunks only reorder a float sum); backward recomputes the "
        "head's forward, one chunk at a time. 0: off (the model's own loss). Try 256-1024; "
        "shoestring plan counts it. Training steps only: eval still computes whole logits "
        "per eval batch (keep eval.batch_size small on a small GPU).",
        check=non_negative,
    )
    objective: Objective = knob(
        "sft",
        "What a step minimizes: 'sft' (cross-entropy on the answers), 'dpo' (Direct "
        "Preference Optimization on chosen/rejected pairs; the reference is the base model "
        "with the adapter disabled, or dpo.precompute_ref), 'orpo' (odds-ratio preference "
        "optimization, no reference; NLL over the chosen sequence as TRL computes it) or "
        "'simpo' (SimPO: length-normalized log-probs with a target margin dpo.simpo_gamma, "
        "no reference; TRL's CPOTrainer loss_type simpo). dpo/orpo/simpo need preference "
        "records (prompt/chosen/rejected); train.batch_size counts pairs. 'grpo': Group "
        "Relative Policy Optimization: each step samples grpo.generations completions per "
        "prompt from the policy, scores them with grpo.rewards and trains on the "
        "group-relative advantages (prompt records; train.batch_size counts prompts).",
    )
    offload_activations: bool = knob(
        False,
        "Keep what autograd saves for backward in host RAM (pinned) between each "
        "micro-batch's forward and backward, instead of GPU memory: torch's save_on_cpu "
        "hooks, weights excluded, each storage copied once. Trades PCIe traffic for GPU "
        "memory; shoestring plan moves the activation term to host RAM. On a CPU run "
        "activations already live in host RAM: nothing changes.",
    )
    kernels: Kernels = knob(
        "none",
        "Fused training kernels: 'liger' patches liger-kernel's RMSNorm, SwiGLU, RoPE and "
        "fused linear cross-entropy (the head and the loss in chunks: the vocabulary-sized "
        "logits are never whole; shoestring plan counts it) into Llama, Qwen2 and Mistral "
        "models. CUDA only; pip install 'shoestring[kernels]'. Not with "
        "train.loss_chunk_tokens (both replace the loss). 'none': transformers' modules.",
    )
    compile: bool = knob(
        False,
        "torch.compile the training forward and backward (inductor, dynamic shapes: one "
        "graph for every batch length, so a resumed run computes with the same kernels). "
        "The compilation runs once before the first step, recorded as a 'compile' event "
        "and kept out of step times and tokens/s (its watchdog phase is 'compile': under "
        "shoestring run, a compilation longer than --first-phase-timeout, minutes on a CPU, "
        "needs a larger one); eval and generation stay eager. Not with "
        "train.loss_chunk_tokens.",
    )


@dataclass
class DpoConfig:
    beta: float = knob(
        0.1,
        "DPO's beta (strength of the pull towards the reference; rewards are beta x the "
        "log-ratio to the reference); with train.objective orpo, ORPO's lambda (weight of "
        "the odds-ratio term); with simpo, SimPO's beta (scale of the answers' mean "
        "log-probs; the SimPO paper uses 2 to 2.5).",
        check=positive,
    )
    label_smoothing: float = knob(
        0.0,
        "DPO: assumed rate of flipped labels: TRL's 'robust' DPO loss (unbiased under "
        "that noise; equal to the sigmoid loss at 0). SimPO: TRL CPO's conservative form.",
        check=lambda v: None if 0 <= v < 0.5 else "must be in [0, 0.5)",
    )
    simpo_gamma: float = knob(
        0.5,
        "SimPO's target reward margin gamma: a pair's loss is "
        "-log sigmoid(beta x (mean log p chosen - mean log p rejected) - gamma).",
        check=non_negative,
    )
    cpo_alpha: float = knob(
        0.0,
        "SimPO: weight of the NLL of the chosen answers added to the loss (TRL CPO's "
        "cpo_alpha; 0: SimPO as published, 1: CPO-SimPO).",
        check=non_negative,
    )
    precompute_ref: bool = knob(
        False,
        "DPO: compute the reference log-probs once (adapter disabled, eval mode) and keep "
        "them with the tokenized data cache (keyed by data, base model, dtype, precision; "
        "sha256-verified) instead of a reference forward every step; the held-out pairs "
        "evaluation reads get theirs too (eval then runs no reference forward).",
    )


def _rewards_given(v: list[str]) -> str | None:
    return None if all(isinstance(x, str) and x.strip() for x in v) else "names must be non-empty"


@dataclass
class GrpoConfig:
    generations: int = knob(
        8,
        "Completions sampled per prompt each step (the group whose mean reward is the "
        "baseline; TRL's num_generations). A micro-batch of k prompts trains k x this many "
        "sequences.",
        check=lambda v: None if v >= 2 else "must be at least 2 (a group needs a baseline)",
    )
    max_completion_tokens: int = knob(
        256, "Most tokens sampled per completion (TRL's max_completion_length).", check=positive
    )
    temperature: float = knob(
        1.0,
        "Sampling temperature of the completions; the trained log-probs are those of the "
        "same tempered distribution (as TRL computes them).",
        check=positive,
    )
    top_p: float = knob(
        1.0,
        "Nucleus sampling of the completions (1: off).",
        check=lambda v: None if 0 < v <= 1 else "must be in (0, 1]",
    )
    top_k: int = knob(0, "Top-k sampling of the completions (0: off).", check=non_negative)
    sample_prompts: int = knob(
        8,
        "Prompts whose groups one generate call samples together (left-padded; 8 x "
        "grpo.generations rows by default). Every completion draws from its own random "
        "stream keyed by (train.seed, step, prompt, k), so batching changes no draw, and a "
        "resume at the same world size repeats every completion. 1: one prompt per call, "
        "slower (1.3x a step on a CPU benchmark) but free of a padded batch's float noise, "
        "so the completions are the same at any world size.",
        check=positive,
    )
    rewards: list[str] = knob(
        ["builtin:similarity"],
        "Reward functions, summed (weighted by grpo.reward_weights) into each completion's "
        "reward: 'builtin:exact_match' or 'builtin:similarity' (against the record's "
        "'answer'), 'MODULE:FUNCTION' (importable) or 'FILE.py:FUNCTION'. A function is "
        "called as TRL calls it: fn(prompts=[...], completions=[...], completion_ids=[...], "
        "**columns) -> one float (or None: not scored) per completion, columns being the "
        "prompt records' other fields; so TRL reward functions work unchanged. They must be "
        "deterministic for a resumed run to repeat the same steps.",
        check=_rewards_given,
    )
    reward_weights: list[float] = knob([], "One weight per grpo.rewards entry (empty: all 1.0).")
    beta: float = knob(
        0.0,
        "Weight of the KL penalty to the reference (the base, adapter disabled; TRL's k3 "
        "estimator per token). 0 (TRL's default): no reference forward.",
        check=non_negative,
    )
    loss_type: GrpoLoss = knob(
        "dapo",
        "'dapo' (TRL's default): token losses summed over the global batch and divided by "
        "its completion tokens; 'grpo': each completion's mean, averaged over completions; "
        "'dr_grpo': summed and divided by completions x grpo.max_completion_tokens.",
    )
    scale_rewards: RewardScale = knob(
        "group",
        "'group': advantage = (reward - group mean) / (group std + 1e-4) (GRPO); 'batch': "
        "divided by the std of the whole global batch's rewards instead (PPO Lite); "
        "'none': reward - group mean (Dr. GRPO).",
    )
    log_completions: int = knob(
        2,
        "Completions per step written to events.jsonl (a 'completions' event: prompt, "
        "text, each reward, advantage), from rank 0; 0: none. Reading them is how a "
        "reward being gamed is caught.",
        check=non_negative,
    )
    mask_truncated: bool = knob(
        False,
        "Leave completions cut by grpo.max_completion_tokens (no end token) out of the "
        "loss (TRL's mask_truncated_completions).",
    )


@dataclass
class EvalConfig:
    every_steps: int = knob(
        0, "Evaluate every N steps (0: only before and after training).", check=non_negative
    )
    batch_size: int = knob(32, "Samples per eval batch.", check=positive)
    max_samples: int = knob(
        0, "Evaluate on at most this many samples (0: all).", check=non_negative
    )
    exact_match: bool = knob(
        True,
        "For prompt/completion data, also greedy-decode each prompt "
        "and report exact-match accuracy.",
    )
    max_new_tokens: int = knob(32, "Generation cap for exact-match eval.", check=positive)


@dataclass
class LoraSection:
    r: int = knob(16, "LoRA rank.", check=positive)
    alpha: float = knob(32.0, "LoRA scaling numerator (scale = alpha / r).", check=positive)
    dropout: float = knob(0.05, "Dropout on the LoRA input.", check=unit_interval)
    target_modules: list[str] = knob(["all-linear"], "Module names to adapt, or ['all-linear'].")
    target_parameters: list[str] = knob(
        [],
        "Parameters to adapt directly (peft's target_parameters, matched by name or "
        "suffix): a mixture-of-experts layer's fused experts, e.g. [gate_up_proj, "
        "down_proj], where 'all-linear' does not reach them (gpt-oss; peft maps the "
        "experts of the Mixtral and Qwen-MoE families itself). Takes lora.dropout 0.",
    )
    quantize: Quantize = knob(
        "none",
        "Load the frozen base quantized by bitsandbytes (QLoRA): 'nf4' is 4-bit "
        "NormalFloat with double quantization, 'int8' is LLM.int8. Needs the qlora extra "
        "(pip install 'shoestring[qlora]'). On CPU, 4-bit layer widths must be multiples of 64.",
    )
    cache_quantized: bool = knob(
        True,
        "With lora.quantize: keep the quantized base (bitsandbytes' 4-bit/8-bit "
        "serialization, sha256-verified like a checkpoint) in SHOESTRING_CACHE/qbase and, "
        "with checkpoint.storage, in <storage>/qbase, so a restart or a fresh machine reads "
        "it instead of quantizing again. Keyed by the base's fingerprint, the quantization, "
        "dtype, device kind and library versions; a copy that does not verify is never used. "
        "Costs the quantized model's size on disk (about 0.56 bytes per parameter for nf4).",
    )


@dataclass
class CheckpointConfig:
    every_steps: int = knob(
        100,
        "Save every N optimizer steps (0: off). With interval "
        "'auto', the interval until the first save is timed.",
        check=non_negative,
    )
    interval: IntervalMode = knob(
        "fixed",
        "'fixed': every_steps / every_seconds. 'auto': choose the interval from the "
        "measured blocking cost of a save and the mean time between failures that lose work "
        "(Young/Daly), re-tuned after every save.",
    )
    mtbf_hours: float = knob(
        20.0,
        "interval 'auto': prior mean time between failures that "
        "lose work (kills without notice), updated by the failures this "
        "run has seen.",
        check=positive,
    )
    every_seconds: float = knob(
        0.0,
        "Also save when this many seconds passed since the last save (0: off).",
        check=non_negative,
    )
    keep: int = knob(
        2,
        "Committed checkpoints to keep; older ones are deleted only after a "
        "newer one is committed.",
        check=positive,
    )
    keep_quarantined: int = knob(
        2,
        "Checkpoints that failed verification are moved aside (checkpoints/.corrupt-*) for "
        "inspection; keep at most this many, the newest (each is a full checkpoint).",
        check=non_negative,
    )
    storage: str = knob(
        "",
        "Where checkpoints are published: a local path or an fsspec URL "
        "(s3://bucket/prefix, gs://...). Empty: OUTPUT/checkpoints only. "
        "OUTPUT/checkpoints is always the local cache. Credentials: preferably from the "
        "environment or fsspec's config (docs/security.md); one in the URL is used but "
        "redacted wherever the URL is written (a query string is refused: fsspec would "
        "keep it in every object's name).",
        check=storage_url,
    )
    async_mode: AsyncMode = knob(
        "thread",
        "Serialize and upload in a background thread, a "
        "background process, or 'off' (synchronous).",
    )
    verify: bool = knob(True, "Verify sha256 of every file against the manifest on load.")


@dataclass
class PreemptConfig:
    signal: PreemptSignal = knob(
        "SIGUSR1",
        "Extra signal that means 'checkpoint and exit' besides SIGTERM and SIGINT "
        "(NCCL may use SIGUSR1; SIGUSR2 is the alternative).",
    )
    cloud: Cloud = knob(
        "auto",
        "Cloud preemption notices to watch: 'aws' (Spot interruption, "
        "~2 min), 'gcp' (Spot/preemptible, ~30 s), 'azure' (Spot Preempt event, "
        ">= 30 s), 'none', or 'auto': detect the provider from the firmware's "
        "DMI strings (no network probe; none found: no watcher).",
    )
    metadata_url: str = knob(
        "",
        "Base URL of the metadata service for preempt.cloud (empty: "
        "http://169.254.169.254). Point it at a fake server to rehearse a "
        "preemption: python -m shoestring.preempt.fakes aws. Needs an "
        "explicit preempt.cloud.",
    )
    poll_s: float = knob(
        1.0,
        "Seconds between metadata polls for aws and azure (AWS advises "
        "<= 5; gcp long-polls and ignores this).",
        check=positive,
    )


@dataclass
class CostConfig:
    market: Market = knob("spot", "Price the cost ledger charges: spot or on-demand.")
    usd_per_hour: float = knob(
        0.0,
        "Price per device-hour on that market (0: the GPU "
        "catalog of shoestring plan, by the detected GPU).",
        check=non_negative,
    )


@dataclass
class ExportConfig:
    merged: bool = knob(
        False, "Also write OUTPUT/merged/: the base model with the adapter merged in."
    )
    gguf: GgufExport = knob(
        "none",
        "Also write OUTPUT/gguf/<name>-<type>.gguf (llama.cpp, Ollama; with the tokenizer, "
        "chat template and an Ollama Modelfile): the merged model in f16, bf16 or q8_0. "
        "Llama- and Qwen2-family bases with a byte-level BPE tokenizer; checked before "
        "training. Needs pip install 'shoestring[gguf]'.",
    )


@dataclass
class DistributedConfig:
    strategy: DistStrategy = knob(
        "ddp",
        "With several processes (torchrun, shoestring run --nproc-per-node, srun): "
        "'ddp' replicates the model on each rank; 'fsdp' shards weights, gradients and "
        "optimizer state (FSDP2) for models that do not fit one device. Ignored in a single "
        "process.",
    )
    backend: Backend = knob(
        "auto", "torch.distributed backend ('auto': nccl on GPUs, gloo on CPU)."
    )
    timeout_s: float = knob(
        1800.0,
        "Collective timeout in seconds (the last resort; shoestring run detects hangs sooner).",
        check=positive,
    )
    cpu_offload: bool = knob(
        False,
        "With strategy fsdp on GPUs: keep the sharded weights, gradients and optimizer "
        "state in (pinned) host memory and step the optimizer on the CPU (FSDP2 "
        "CPUOffloadPolicy); each layer's shards are copied to the GPU for its all-gather. "
        "Saves GPU memory, costs host-to-device traffic every step.",
    )


@dataclass
class WatchConfig:
    enabled: bool = knob(
        True,
        "Publish this rank's live state (phase, step, collectives) to "
        "OUTPUT/ranks/rank<R>/live.json for the shoestring run watchdog.",
    )
    interval_s: float = knob(
        1.0, "How often the live state is written, in seconds.", check=positive
    )


@dataclass
class PlanSection:
    gpu: str = knob(
        "auto",
        "GPU to plan memory for before loading the model: a catalog name "
        "(shoestring plan --list-gpus), 'auto' (the detected CUDA device; no check "
        "on CPU) or 'none' (no check).",
    )
    enforce: bool = knob(
        True,
        "Refuse to start when the plan says the config will not fit "
        "the GPU (false: warn and start anyway).",
    )


@dataclass
class FinetuneConfig:
    output_dir: str = knob("runs/finetune", "Run directory: events.jsonl, checkpoints/, final/.")
    events_rotate_mb: float = knob(
        64.0,
        "At start, an event log larger than this (MiB) is renamed to events.N.jsonl and a new "
        "one begins (nothing is deleted; report reads every segment).",
        check=positive,
    )
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    lora: LoraSection = field(default_factory=LoraSection)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    preempt: PreemptConfig = field(default_factory=PreemptConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    watch: WatchConfig = field(default_factory=WatchConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    plan: PlanSection = field(default_factory=PlanSection)
    track: TrackConfig = field(default_factory=TrackConfig)


@dataclass
class FinetuneOptions:
    """Flags of ``shoestring finetune`` that are not part of the run's config (not in
    ``--config`` YAML, not in config.yaml, not in the config hash)."""

    resume: str = knob(
        "auto",
        "Where to continue from: 'auto' (the newest valid checkpoint "
        "in output_dir or checkpoint.storage, else start fresh), 'never' "
        "(start fresh; fails if output_dir already has checkpoints) or the "
        "PATH of one checkpoint directory.",
    )


#: Keys that may change between a checkpoint and its resume without breaking
#: the continuation. Anything else changed makes ``--resume`` refuse.
RESUME_SAFE_PREFIXES: tuple[str, ...] = (
    "output_dir",
    "events_rotate_mb",
    "train.max_steps",
    "train.log_every_steps",
    "train.num_threads",
    "train.device",
    "train.deterministic",
    "train.offload_activations",
    "lora.cache_quantized",
    "eval.",
    "checkpoint.",
    "preempt.",
    "export.",
    "data.eval",
    "data.cache",
    "data.workers",
    "distributed.",
    "watch.",
    "cost.",
    "plan.",
    "track.",
    "grpo.log_completions",
)


@dataclass(frozen=True)
class Numerics:
    """What ``finetune`` computes with on one kind of device: ``model.dtype`` and
    ``train.precision`` with every ``auto`` made concrete (:func:`resolve_numerics`)."""

    device: DeviceKind
    dtype: ComputeDtype  # the frozen base weights, as loaded
    precision: PrecisionName  # bf16 / fp16: the step runs under autocast; fp32: none

    @property
    def autocast(self) -> bool:
        """Whether autocast changes anything: a 16-bit model under bf16/fp16 precision."""
        return self.precision != "fp32" and self.dtype != "float32"


def device_kind(spec: str, cuda_available: bool) -> DeviceKind:
    """``train.device`` (auto, cpu, cuda, cuda:N) as the kind of device it runs on."""
    if spec == "auto":
        return "cuda" if cuda_available else "cpu"
    return "cpu" if spec == "cpu" else "cuda"


def resolve_numerics(
    model: ModelConfig, train: TrainConfig, device: DeviceKind, gpu_bf16: bool
) -> Numerics:
    """The one rule for ``model.dtype auto`` and ``train.precision auto``, shared by
    ``finetune`` (on the device it probed) and ``shoestring plan`` (on the device and
    catalog GPU it plans for). On CUDA: bf16 where the GPU computes it
    (``gpu_bf16``), else fp16 (T4, V100); on CPU: float32 weights, no autocast."""
    on_gpu = device == "cuda"
    half: PrecisionName = "bf16" if gpu_bf16 else "fp16"
    precision: PrecisionName = (
        (half if on_gpu else "fp32") if train.precision == "auto" else train.precision
    )
    if precision == "fp16" and not on_gpu:
        raise ConfigError(
            "train.precision: fp16 needs a CUDA device (its gradient scaler is "
            "CUDA-only); on CPU use bf16 or fp32"
        )
    dtype: ComputeDtype = model.dtype if model.dtype != "auto" else "float32"
    if model.dtype == "auto" and on_gpu:
        dtype = "bfloat16" if half == "bf16" else "float16"
    return Numerics(device=device, dtype=dtype, precision=precision)


#: A config whose ``train.device``, ``train.precision`` and ``model.dtype`` are concrete
#: (no ``auto``): what :func:`shoestring.train.device.resolve` returns and what the
#: run's builders take, so an unresolved config cannot reach them.
ResolvedConfig = NewType("ResolvedConfig", FinetuneConfig)


def precision_of(cfg: ResolvedConfig) -> PrecisionName:
    """``train.precision`` of a resolved config: bf16, fp16 or fp32."""
    return cast(PrecisionName, cfg.train.precision)


def dtype_of(cfg: ResolvedConfig) -> ComputeDtype:
    """``model.dtype`` of a resolved config: float32, bfloat16 or float16."""
    return cast(ComputeDtype, cfg.model.dtype)


def eval_fraction(spec: str) -> float | None:
    """``data.eval`` as a fraction of the training data (``0.05``), or None (a source)."""
    try:
        value = float(spec)
    except ValueError:
        return None
    return value if 0 < value < 1 else None


def resume_relevant(flat: Mapping[str, Any]) -> dict[str, Any]:
    kept = {k: v for k, v in flat.items() if not k.startswith(RESUME_SAFE_PREFIXES)}
    objective = kept.get("train.objective", "sft")
    if objective == "sft":  # SFT hashes as before the objectives
        kept = {k: v for k, v in kept.items() if k != "train.objective" and k[:4] != "dpo."}
    if objective != "grpo":  # so do the other objectives, as before GRPO
        kept = {k: v for k, v in kept.items() if not k.startswith("grpo.")}
    # A Hub ref's @revision may change (pinning the commit a run was trained on): the
    # resume compares the commit itself (train/resume.py check_base).
    repo = hub_repo(str(kept.get("model.path", "")))
    if repo is not None:
        kept["model.path"] = repo
    fraction = eval_fraction(str(flat.get("data.eval", "")))
    if fraction is not None:  # a held-out fraction changes which samples are trained on
        kept["data.eval"] = fraction
    return kept


def config_hash(cfg: FinetuneConfig) -> str:
    """Hash of the keys that must not change across a resume."""
    blob = json.dumps(resume_relevant(to_flat(cfg)), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
