"""``InferConfig``: every knob of ``shoestring infer`` (same config system as finetune)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from shoestring.config import knob, non_negative, positive

#: ``model.device``: where layers are computed.
Device = Literal["auto", "cpu", "cuda"]
#: ``model.dtype``: what the job computes in ('auto': resolved once, pinned in run.json).
ComputeDtype = Literal["float32", "bfloat16", "float16"]
ModelDtype = Literal["auto", ComputeDtype]
#: ``generate.mode``: greedy continuation, or the log-likelihood of given completions.
Mode = Literal["generate", "score"]
#: ``compress.scheme``: the decoder layers' weights as read from disk.
Compress = Literal["none", "int8", "nf4"]
#: ``memory.share_prefix``: compute a prompt prefix that many sequences share once.
SharePrefix = Literal["auto", "off"]
#: ``job.progress``: how progress is shown.
ProgressMode = Literal["auto", "bar", "plain", "off"]
#: ``job.preempt_signal``: the extra signal meaning 'commit and exit'.
PreemptSignal = Literal["SIGUSR1", "SIGUSR2", "none"]

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "m": 1e6,
    "g": 1e9,
    "t": 1e12,
    "ki": 1 << 10,
    "mi": 1 << 20,
    "gi": 1 << 30,
    "ti": 1 << 40,
}


def parse_size(text: str) -> int:
    """'4GB' -> 4e9, '1.5GiB' -> 1.5*2**30, '512M' -> 512e6, '0' -> 0. Raises ValueError."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 4GB, 1.5GiB, 512MB)")
    unit = (m.group(2) or "").lower().removesuffix("b")
    return int(float(m.group(1)) * _UNITS[unit])


def _size_check(v: Any) -> str | None:
    try:
        parse_size(v)
    except ValueError as e:
        return str(e)
    return None


@dataclass
class InferModelConfig:
    path: str = knob(
        "",
        "The Hugging Face causal LM: a local directory (config.json, safetensors shards, "
        "tokenizer), a Hub id org/name[@revision] (downloaded into the HF cache, safetensors "
        "only) or a folder URL (s3://, gs://, file://; copied to SHOESTRING_CACHE/models). "
        "See docs/models.md.",
    )
    adapter: str = knob(
        "",
        "LoRA adapter to apply: a shoestring finetune OUTPUT/final/ dir (peft format), a "
        "Hub id or a folder URL of one. Empty: none.",
    )
    device: Device = knob("auto", "Where layers are computed ('auto': cuda if available).")
    dtype: ModelDtype = knob(
        "auto",
        "Compute dtype of weights, activations and KV cache. 'auto': "
        "the checkpoint's dtype (exact), except with --compress on a float32 "
        "checkpoint (already inexact): bfloat16 where a bf16 matmul measures "
        "faster on this device. The resolved choice is pinned in run.json.",
    )


@dataclass
class IOConfig:
    input: str = knob(
        "",
        'Input JSONL: one {"prompt": ...} or OpenAI-style {"messages": [...]} object '
        "per line (conversations are rendered with the model's chat template); in "
        'score mode also "completion" (a string) or "choices" (a list of strings).',
    )
    output: str = knob(
        "",
        "Output JSONL, one line per input line, in input order. Written "
        "once, when every chunk is committed.",
    )
    run_dir: str = knob(
        "",
        "Run directory (events.jsonl, chunk ledger, compressed weights). "
        "Empty: OUTPUT.run next to the output file.",
    )


@dataclass
class GenerateConfig:
    mode: Mode = knob(
        "generate",
        "'generate': greedy continuation; 'score': log-likelihood of "
        "the given completion(s), prefill only.",
    )
    max_new_tokens: int = knob(
        32,
        "Most tokens to generate per prompt; OpenAI batch lines without max_tokens get it "
        "(theirs may be larger: the memory plan takes the largest).",
        check=positive,
    )
    stop_at_eos: bool = knob(
        True,
        "Stop a sequence at the tokenizer's EOS token (and, for conversations, at the "
        "chat template's end-of-turn token).",
    )
    chat_template: str = knob(
        "",
        'Jinja file overriding the tokenizer\'s chat template for "messages" inputs '
        "(use the one the adapter was trained with). Empty: the tokenizer's own.",
    )
    json_schema: str = knob(
        "",
        '{"prompt"}/{"messages"} lines in generate mode: a JSON Schema file every answer '
        "is held to, token by token (structured output; needs llguidance: pip install "
        "'shoestring[structured]'). OpenAI batch lines carry their own response_format. "
        "Empty: free text.",
    )
    temperature: float = knob(
        0.0,
        '{"prompt"} lines: 0 decodes greedily, above samples (OpenAI batch lines carry '
        "their own; OpenAI's default is 1).",
        check=lambda v: None if 0.0 <= v <= 2.0 else "must be in [0, 2]",
    )
    top_p: float = knob(
        1.0,
        '{"prompt"} lines: sample from the smallest set of tokens holding this much probability.',
        check=lambda v: None if 0.0 < v <= 1.0 else "must be in (0, 1]",
    )
    top_k: int = knob(
        0, '{"prompt"} lines: sample from the k likeliest tokens (0: all).', check=non_negative
    )
    seed: int = knob(
        0,
        "Seed of every sampled token, mixed with the request's custom_id (or line) and "
        "the token's index, so an output depends on neither its batch nor a resume; a "
        "request's own seed replaces it.",
    )


@dataclass
class MemoryConfig:
    budget: str = knob(
        "4GB",
        "Total process memory (RSS) to stay within: runtime, read-ahead "
        "buffers, activations, KV cache and resident layers.",
        check=_size_check,
    )
    runtime_reserve: str = knob(
        "auto",
        "Part of the budget taken by the process itself (Python, torch, transformers, "
        "the tokenizer, the tokenized input, an adapter): auto measures its RSS when "
        "the job plans and adds what the first pass sets up; a size reserves at least that.",
        check=lambda v: None if v == "auto" else _size_check(v),
    )
    prefetch_depth: int = knob(
        1,
        "Units read ahead while the current one computes (1 keeps "
        "the disk busy whenever reading is the bottleneck).",
        check=positive,
    )
    batch_size: int = knob(
        64,
        "Sequences in flight at once (the job batch): each layer is "
        "read once per decode step for all of them. Lowered to what the "
        "budget fits.",
        check=positive,
    )
    micro_batch_tokens: int = knob(
        512,
        "Tokens per forward call inside a layer (prefill micro-batches); bounds activation memory.",
        check=positive,
    )
    resident: int = knob(
        -1,
        "Layers kept resident in memory (-1: as many as the budget "
        "allows after the batch and KV cache).",
    )
    kv_bits: int = knob(
        16,
        "KV cache precision: 16 keeps the model dtype; 8 stores int8 "
        "keys/values with a scale per token and head (~1/4 of fp32, 1/2 of "
        "bf16), so a bigger batch fits; outputs drift slightly.",
        check=lambda v: None if v in (8, 16) else "must be 8 or 16",
    )
    share_prefix: SharePrefix = knob(
        "auto",
        "Generate mode: a prompt prefix that sequences of a chunk share (a system prompt, "
        "few-shot examples; >= 32 tokens, >= 2 sequences) is computed once per prefill "
        "and its keys and values copied to each sequence. auto: where the cache allows "
        "(CPU, full-attention layers); off: every prompt in full.",
    )


@dataclass
class CompressConfig:
    scheme: Compress = knob(
        "none",
        "Weight compression of the decoder layers' linear weights: "
        "int8 (per-channel) or nf4 (4-bit, group 64). Compressed once into "
        "the run directory, then fewer bytes are read per pass.",
    )
    decode_once: bool = knob(
        False,
        "A checkpoint stored quantized (FP8, MXFP4 experts, bitsandbytes 4-bit), or one "
        "computed in another dtype than stored: write its decoder layers once into the "
        "run directory as the job computes with them (dequantized, cast, experts fused, "
        "an adapter merged) and stream that copy: no decoding per pass, for more bytes "
        "read (bf16: about twice FP8's). For CPUs, where decoding costs more than "
        "reading; outputs are the same bit for bit. Takes that much disk.",
    )


@dataclass
class JobConfig:
    chunk_size: int = knob(
        0, "Prompts per committed chunk (0: the job batch size).", check=non_negative
    )
    num_threads: int = knob(0, "torch intra-op threads (0: torch's default).", check=non_negative)
    progress: ProgressMode = knob(
        "auto", "Progress display: bar on a terminal, plain lines otherwise."
    )
    preempt_signal: PreemptSignal = knob(
        "SIGUSR1", "Extra signal meaning 'commit and exit' besides SIGTERM and SIGINT."
    )
    save_every_s: float = knob(
        600.0,
        "Also save a running chunk's generation state (tokens "
        "and KV cache, at a pass boundary) every S seconds, so a kill "
        "without notice loses at most about S seconds of a long chunk; "
        "0: only when asked to stop. A stop signal always saves it.",
        check=non_negative,
    )


@dataclass
class InferConfig:
    model: InferModelConfig = field(default_factory=InferModelConfig)
    io: IOConfig = field(default_factory=IOConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    compress: CompressConfig = field(default_factory=CompressConfig)
    job: JobConfig = field(default_factory=JobConfig)


#: The issue's short flags -> config keys (they are rewritten before parsing, so errors
#: still name the flag the user typed).
ALIASES: dict[str, str] = {
    "--model": "model.path",
    "--adapter": "model.adapter",
    "--device": "model.device",
    "--input": "io.input",
    "--output": "io.output",
    "--run-dir": "io.run_dir",
    "--mode": "generate.mode",
    "--max-new-tokens": "generate.max_new_tokens",
    "--memory-budget": "memory.budget",
    "--batch-size": "memory.batch_size",
    "--compress": "compress.scheme",
    "--decode-once": "compress.decode_once",
    "--threads": "job.num_threads",
    "--kv-bits": "memory.kv_bits",
    "--dtype": "model.dtype",
    "--chat-template": "generate.chat_template",
    "--json-schema": "generate.json_schema",
    "--temperature": "generate.temperature",
    "--top-p": "generate.top_p",
    "--top-k": "generate.top_k",
    "--seed": "generate.seed",
}

#: Keys whose change would change the output bytes: a resume refuses if they differ.
OUTPUT_KEYS: tuple[str, ...] = (
    "model.path",
    "model.adapter",
    "io.input",
    "generate.mode",
    "generate.max_new_tokens",
    "generate.stop_at_eos",
    "generate.temperature",
    "generate.top_p",
    "generate.top_k",
    "generate.seed",
    "compress.scheme",
    "memory.kv_bits",
    "model.dtype",
)

#: Output keys added later: left out of a run's identity at these values, so run
#: directories written before them stay valid.
LATER_KEY_DEFAULTS: dict[str, Any] = {
    "memory.kv_bits": 16,
    "model.dtype": "auto",
    "generate.temperature": 0.0,
    "generate.top_p": 1.0,
    "generate.top_k": 0,
    "generate.seed": 0,
}
