"""Everything a job does before its first chunk, cheapest checks first.

Bad input fails before anything is loaded (or downloaded), and another job's run
directory is refused before anything is written into it: required keys, the input
file (to ``file:line``), the model reference, the adapter, the tokenizer and the
tokenized input, the compute dtype and the engine, the job's identity against
``run.json``, then the weights' setup and the memory plan (:mod:`.budget`).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from shoestring.checkpoint.faults import FaultPlan
from shoestring.config import ConfigError, to_flat
from shoestring.heap import steady_memory
from shoestring.hub import HubAccess, ModelRef, resolve
from shoestring.infer.adapter import LoraDelta
from shoestring.infer.budget import Planner, predicted_plan, real_plan
from shoestring.infer.codecs import Scheme
from shoestring.infer.config import LATER_KEY_DEFAULTS, OUTPUT_KEYS, InferConfig
from shoestring.infer.decoded import decoded_bytes, decodes, layer_units
from shoestring.infer.dtype import compute_dtype
from shoestring.infer.engine import StreamingCausalLM, read_config_json, stored_dtype
from shoestring.infer.inputs import Input, read_input
from shoestring.infer.layercopy import kept_copy
from shoestring.infer.ledger import Pinned, RunRecord
from shoestring.infer.plan import StreamPlan
from shoestring.infer.requests import Answering
from shoestring.infer.sampleparams import Sampling
from shoestring.infer.shards import ShardError, index_model
from shoestring.infer.stored import (
    StoredWeights,
    check_stored,
    stored_compute_dtype,
    stored_refs,
    stored_weights,
)
from shoestring.infer.stream import Prepare
from shoestring.infer.structured import read_schema_file
from shoestring.infer.weights import weight_hook, weight_needs
from shoestring.infer.work import Work, tokenize, tokenize_requests


def default_run_dir(output: Path) -> Path:
    return output.with_name(output.name + ".run")


@dataclass
class InferJob:
    """A prepared job: inputs tokenized, engine built, identity checked, memory planned."""

    cfg: InferConfig
    faults: FaultPlan
    stream: TextIO
    started: float  # time.perf_counter() when the job began
    model_dir: Path
    output: Path
    run_dir: Path
    work: Work
    tok: Any
    engine: StreamingCausalLM
    prior: RunRecord | None  # run.json of an earlier attempt
    identity: dict[str, Any]
    hook: Prepare | None  # what the reader thread does to each unit's tensors
    plan: StreamPlan
    chunk_records: int
    created: int | None = None  # outputs' "created" (None: the run's first start)
    answering: Answering | None = None  # OpenAI batch jobs: what every line shares

    @property
    def dtype_name(self) -> str:
        return str(self.engine.dtype).removeprefix("torch.")

    @property
    def streamed_bytes(self) -> int:
        """Bytes read from disk per pass: every unit that is not resident."""
        return sum(
            u.plan.read_bytes
            for i, u in enumerate(self.engine.units)
            if i not in self.plan.resident
        )


def prepare(
    cfg: InferConfig, faults: FaultPlan, stream: TextIO, hub: HubAccess | None = None
) -> InferJob:
    """Everything before the first chunk, cheapest checks first (module docstring)."""
    started = time.perf_counter()
    hub = hub or HubAccess(Path.home() / ".cache" / "shoestring")
    _required_keys(cfg)
    given = read_input(Path(cfg.io.input), cfg.generate.mode, cfg.generate.max_new_tokens)
    ref = resolve(cfg.model.path, hub, key="--model (model.path)")
    model_dir = _model_dir(ref, cfg.compress.scheme)
    output = Path(cfg.io.output)
    run_dir = Path(cfg.io.run_dir) if cfg.io.run_dir else default_run_dir(output)
    steady_memory()  # before anything is computed: oneDNN reads its cache size once
    adapter = _adapter(cfg, hub)
    if cfg.job.num_threads:
        torch.set_num_threads(cfg.job.num_threads)
    device = _device(cfg)
    tok = _load_tokenizer(model_dir)
    template = _chat_template(cfg)
    work = _work(cfg, given, tok, template, model_dir)
    prior = RunRecord.read(run_dir)
    engine = _build_engine(cfg, model_dir, device, prior)
    if adapter is not None:
        _fit_adapter(adapter, engine, model_dir)
    identity = _identity(cfg, given.sha256, model_dir, adapter)
    if ref.kind != "local":  # unset for local dirs keeps older run dirs valid
        identity["model_source"] = ref.record()
    if template is not None:  # outputs depend on it; unset keeps older run dirs valid
        identity["chat_template_sha256"] = hashlib.sha256(template.encode()).hexdigest()
    if prior is not None:
        prior.check(identity)
    pinned = prior.pinned if prior is not None else Pinned()
    hook, plan = _weights_and_plan(cfg, engine, work, adapter, run_dir, identity, pinned, stream)
    chunk_records = pinned.chunk_records or _chunk_records(cfg, plan, work)
    return InferJob(
        cfg, faults, stream, started, model_dir, output, run_dir, work, tok, engine,
        prior, identity, hook, plan, chunk_records,
    )  # fmt: skip


def _required_keys(cfg: InferConfig) -> None:
    for key, flag in (
        ("model.path", "--model"),
        ("io.input", "--input"),
        ("io.output", "--output"),
    ):
        if not to_flat(cfg)[key]:
            raise ConfigError(f"{flag} ({key}) is required")
    if cfg.compress.decode_once and cfg.compress.scheme != "none":
        raise ConfigError(
            "--decode-once (compress.decode_once): the layers are already streamed from "
            f"a copy (--compress {cfg.compress.scheme}); give one of the two"
        )


def _model_dir(ref: ModelRef, compress: str) -> Path:
    """The resolved model's folder. A base stored quantized (bitsandbytes 4-bit, FP8)
    streams as stored (:mod:`.stored`); other quantizations, and ``--compress`` on top
    of a stored one, are refused here, before anything loads."""
    doc = json.loads((ref.path / "config.json").read_text())
    if isinstance(doc, dict):
        check_stored(doc, ref.spec, compress)
    return ref.path


def _adapter(cfg: InferConfig, hub: HubAccess) -> LoraDelta | None:
    if not cfg.model.adapter:
        return None
    ref = resolve(cfg.model.adapter, hub, key="--adapter (model.adapter)", want="adapter")
    return LoraDelta(ref.path)


def _fit_adapter(adapter: LoraDelta, engine: StreamingCausalLM, model_dir: Path) -> None:
    """The adapter read as this model's (peft's scales; an MoE's expert pairs per stored
    tensor), and refused if it targets a weight the model does not have."""
    fused = {k: f for u in engine.units for k, f in u.fused.items()}
    rows = {k: r.shape[0] for k, r in engine.refs.items() if r.shape}
    if engine.view is not None:  # a vision-language base, streamed as its text model
        adapter.rename(engine.view.name)
    adapter.resolve(model_dir, fused, rows)
    adapter.check(set(engine.refs))
    for key in adapter.decoded:  # MXFP4 experts: merged into each as it is decoded
        fused[key].merge = adapter.expert_merge(key, fused[key].shape(engine.refs), engine.dtype)


def _device(cfg: InferConfig) -> torch.device:
    return torch.device(
        "cuda"
        if cfg.model.device == "cuda" or (cfg.model.device == "auto" and torch.cuda.is_available())
        else "cpu"
    )


def _chat_template(cfg: InferConfig) -> str | None:
    """The ``generate.chat_template`` file's Jinja source, checked (None: the tokenizer's)."""
    if not cfg.generate.chat_template:
        return None
    from shoestring.data.chat import load_template
    from shoestring.data.records import DataError

    try:
        return load_template(cfg.generate.chat_template)
    except DataError as e:
        raise ConfigError(f"generate.chat_template: {e}") from None


def _config_doc(model_dir: Path) -> dict[str, Any]:
    """The model's config.json, read once ({} when there is none to read)."""
    try:
        doc = read_config_json(model_dir)
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _counts(doc: dict[str, Any], *keys: str) -> list[int | None]:
    """Positive integers of the model's config (None where it names none): the context
    (``max_position_embeddings``), the logits' width (``vocab_size``)."""
    return [n if isinstance(n := doc.get(k), int) and n > 0 else None for k in keys]


def _work(cfg: InferConfig, given: Input, tok: Any, template: str | None, model_dir: Path) -> Work:
    """The input tokenized: an OpenAI batch file's requests, or the job's own lines
    (continued as ``generate.*`` says)."""
    g = cfg.generate
    doc = _config_doc(model_dir)
    context, vocab = _counts(doc, "max_position_embeddings", "vocab_size")
    if given.items is not None:
        kind = doc.get("model_type")
        model_type = kind if isinstance(kind, str) else None
        path = cfg.io.input
        return tokenize_requests(
            given.items, tok, template, context, g.seed, path, vocab, model_type
        )
    assert given.records is not None
    fmt = read_schema_file(g.json_schema) if g.json_schema else None
    sampling = Sampling(g.max_new_tokens, g.temperature, g.top_p, g.top_k, response_format=fmt)
    return tokenize(given.records, tok, g.mode, template, sampling, context, g.seed, vocab)


def _load_tokenizer(model_dir: Path) -> Any:
    from shoestring.hf import load_tokenizer, quiet_hf

    quiet_hf()
    try:
        return load_tokenizer(model_dir)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"--model (model.path): cannot load a tokenizer from {model_dir}: {e}"
        ) from e


def _build_engine(
    cfg: InferConfig, model_dir: Path, device: torch.device, prior: RunRecord | None
) -> StreamingCausalLM:
    try:
        doc = read_config_json(model_dir)
        refs = stored_refs(doc, index_model(model_dir))
        dtype = compute_dtype(
            cfg.model.dtype,
            stored_compute_dtype(doc) or stored_dtype(refs),
            cfg.compress.scheme,
            device,
            pinned=prior.pinned.dtype if prior is not None else None,
        )
        return StreamingCausalLM(
            model_dir, device=device, refs=refs, kv_bits=cfg.memory.kv_bits, dtype=dtype
        )
    except ShardError as e:
        raise ConfigError(f"--model (model.path): {e}") from e


def _identity(
    cfg: InferConfig, input_sha: str, model_dir: Path, adapter: LoraDelta | None
) -> dict[str, Any]:
    """What must not change between attempts of one run directory (run.json)."""
    from shoestring.hf import fingerprint

    flat = to_flat(cfg)
    return {
        "input_sha256": input_sha,
        "model": fingerprint(model_dir),
        "adapter": adapter.fingerprint if adapter else "",
        **_schema_identity(cfg.generate.json_schema),
        **{
            k: flat[k]
            for k in OUTPUT_KEYS
            if k not in ("model.path", "io.input")
            and not (k in LATER_KEY_DEFAULTS and flat[k] == LATER_KEY_DEFAULTS[k])
        },
    }


def _schema_identity(path: str) -> dict[str, str]:
    """The ``--json-schema`` file's digest (nothing when unset: older run dirs stay valid)."""
    if not path:
        return {}
    return {"json_schema_sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest()}


def _weights_and_plan(
    cfg: InferConfig,
    engine: StreamingCausalLM,
    work: Work,
    adapter: LoraDelta | None,
    run_dir: Path,
    identity: dict[str, Any],
    pinned: Pinned,
    stream: TextIO,
) -> tuple[Prepare | None, StreamPlan]:
    """The reader's weight hook and the memory plan: planned on the predicted sizes
    first (a budget too small is refused before a copy of the layers is written), then
    on the real ones (:mod:`shoestring.infer.budget`). A checkpoint stored quantized
    streams its stored parts (:mod:`shoestring.infer.stored`), or its layers decoded
    once (:mod:`shoestring.infer.decoded`)."""
    name: str = cfg.compress.scheme
    scheme: Scheme | None = None if cfg.compress.scheme == "none" else cfg.compress.scheme
    stored = stored_weights(engine)
    once = cfg.compress.decode_once
    if once:
        _check_decodes(engine, stored, cfg.model.path)
        name = f"decoded-{str(engine.dtype).removeprefix('torch.')}"
    elif engine.device.type == "cpu" and (stored is not None or _mxfp4(engine)):
        copy = sum(decoded_bytes(engine, stored, i) for i in layer_units(engine))
        print(
            "infer: this checkpoint is decoded on every pass; on a CPU, --decode-once "
            f"writes its layers decoded once ({copy / 1e9:.1f} GB in the run directory) and "
            "streams them from there, with the same outputs (docs/inference.md)",
            file=stream,
            flush=True,
        )
    planner = Planner.of(cfg.memory, engine, work, cfg.generate.mode == "generate", pinned)
    predicted = weight_needs(engine, scheme, adapter, stored, decode_once=once)
    predicted_plan(planner, predicted)
    copy_dir, source = (
        run_dir / f"weights-{name}",
        f"{identity['model']}:{identity['adapter']}:{name}",
    )
    if predicted.build and not kept_copy(copy_dir, source):
        print(f"infer: writing the layers once into {copy_dir} ...", file=stream, flush=True)
    hook, needs = weight_hook(engine, scheme, adapter, copy_dir, source, stored, decode_once=once)
    return hook, real_plan(planner, needs)


def _mxfp4(engine: StreamingCausalLM) -> bool:
    return any(f.mxfp4 for u in engine.units for f in u.fused.values())


def _check_decodes(engine: StreamingCausalLM, stored: StoredWeights | None, spec: str) -> None:
    """``compress.decode_once`` is refused where it would only cost: on a GPU (decoding
    there is cheaper than the extra bytes), and for a checkpoint whose layers stream as
    they compute."""
    key = "--decode-once (compress.decode_once)"
    if engine.device.type != "cpu":
        raise ConfigError(
            f"{key}: the layers compute on {engine.device.type}, where decoding them is "
            "cheaper than reading a decoded copy: drop it"
        )
    if not any(decodes(engine, stored, i) for i in layer_units(engine)):
        dtype = str(engine.dtype).removeprefix("torch.")
        raise ConfigError(
            f"{key}: {spec}'s layers are stored as the job computes with them ({dtype}, "
            "nothing quantized or fused): there is nothing to decode; drop it"
        )


def _chunk_records(cfg: InferConfig, plan: StreamPlan, work: Work) -> int:
    """Records per chunk: a job batch's worth of sequences (or job.chunk_size, if less)."""
    per_record = max(1, max(len(s) for s in work.seqs))
    return max(1, min(cfg.job.chunk_size or plan.batch_size, plan.batch_size) // per_record)
