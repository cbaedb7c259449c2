"""``OUTPUT/gguf/<name>-<type>.gguf`` (+ an Ollama ``Modelfile``): the merged model for
llama.cpp and Ollama, streamed from the merge plan (:mod:`shoestring.train.merge`).

gguf's ``GGUFWriter`` writes the header, the metadata (hyperparameters, tokenizer, chat
template) and every tensor's info first; then each tensor is formed (merged, dequantized
for a 4/8-bit base), permuted where llama.cpp wants it, converted a row block at a time
(``gguf.quants.quantize``) and appended, and dropped. The extra memory is one formed
tensor plus one block, never the model. The file is written in a hidden temp dir beside
its destination (``.tmp-gguf-*``), fsynced, renamed into place (the Modelfile after it),
and the directory fsynced: a kill leaves only the temp dir, which holds no ``*.gguf`` at
the destination and is removed by the next export there.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shoestring.config import ConfigError
from shoestring.fsio import atomic_write, fsync_dir
from shoestring.train.config import FinetuneConfig, GgufType, ModelConfig
from shoestring.train.ggufarch import (
    FILE_TYPES,
    TensorPlan,
    add_hparams,
    arch_name,
    check_arch,
    extra_tensors,
    name_map,
    plan_tensors,
    read_config,
    require_gguf,
    text_config,
)
from shoestring.train.ggufspm import SPM_FILE, build_spm_vocab, load_processor, sentencepiece_model
from shoestring.train.ggufvocab import GgufVocab, build_vocab, check_tokenizer, read_tokenizer_json
from shoestring.train.ollama import modelfile, stop_tokens
from shoestring.train.towers import text_names

if TYPE_CHECKING:
    import gguf

    from shoestring.train.merge import MergePlan

log = logging.getLogger("shoestring.export")

KEY = "export.gguf"
GGUF_DIR = "gguf"
MODELFILE = "Modelfile"
TMP_PREFIX = ".tmp-gguf-"
#: Bytes of float32 values converted at a time.
BLOCK_BYTES = 64 << 20


def check_exportable(cfg: FinetuneConfig, model_dir: Path | None) -> None:
    """Refuse, before training, a ``export.gguf`` the export would refuse at the end.
    ``model_dir``: the resolved base (a Hub id downloaded already); None for the
    built-in model."""
    if cfg.export.gguf == "none":
        return
    require_gguf(KEY)
    if model_dir is None:
        raise ConfigError(
            f"{KEY}: the built-in tiny model's byte tokenizer is a BPE without merges, which "
            "llama.cpp cannot load (it needs tokenizer.ggml.merges); export a Llama, Qwen2 or "
            "Qwen3 model given with --model.path"
        )
    check_model_dir(model_dir, KEY)


def check_model_dir(model_dir: Path, key: str) -> None:
    cfg = check_arch(read_config(model_dir), key)
    spm = sentencepiece_model(model_dir)
    if cfg == "gemma3_text" and spm is None:
        raise ConfigError(f"{key}: a Gemma 3 GGUF needs {model_dir / SPM_FILE}")
    if spm is not None:  # llama.cpp reads it first
        load_processor(spm, key)
    else:
        check_tokenizer(read_tokenizer_json(model_dir, key), key)


def prune_temps(gguf_dir: Path) -> list[str]:
    """Temp dirs of exports a kill interrupted (the caller holds the run directory)."""
    removed = []
    if gguf_dir.is_dir():
        for child in gguf_dir.iterdir():
            if child.name.startswith(TMP_PREFIX) and child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child.name)
    return sorted(removed)


def _add_metadata(
    writer: gguf.GGUFWriter, cfg: Mapping[str, Any], name: str, kind: GgufType
) -> None:
    import gguf

    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_file_type(int(gguf.LlamaFileType[FILE_TYPES[kind][1]]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_hparams(writer, cfg)


def _blocks(plan: MergePlan, t: TensorPlan) -> Iterator[Any]:
    """The tensor as the file stores it, a row block at a time."""
    import gguf

    formed = t.form() if t.form is not None else plan.forms[t.hf_name]()
    if t.part is not None:
        formed = t.part(formed)
    if t.transform is not None:
        formed = t.transform(formed)
    rows = formed.reshape(-1, formed.shape[-1]) if formed.dim() > 1 else formed.reshape(1, -1)
    step = max(1, BLOCK_BYTES // max(1, rows.shape[1] * 4))
    for block in rows.split(step):
        values = block.detach().to("cpu", torch.float32).numpy()
        yield gguf.quants.quantize(values, t.qtype)


def _write_data(writer: gguf.GGUFWriter, plan: MergePlan, t: TensorPlan) -> None:
    """Append one tensor's data, aligned as ``GGUFWriter.write_tensor_data`` aligns it."""
    assert writer.fout is not None
    fout = writer.fout[0]
    writer.write_padding(fout, fout.tell())
    written = 0
    for data in _blocks(plan, t):
        data.tofile(fout)
        written += data.nbytes
    if written != t.nbytes:
        raise RuntimeError(
            f"GGUF export: {t.name}: wrote {written} bytes, its info says {t.nbytes}"
        )
    writer.write_padding(fout, written)


def write_gguf(
    path: Path,
    plan: MergePlan,
    cfg: Mapping[str, Any],
    vocab: GgufVocab,
    kind: GgufType,
    rename: Callable[[str], str | None] = lambda name: name,
) -> int:
    """Header, metadata and tensor infos, then each tensor's data as it is formed;
    ``rename``: a tensor's name in the text model (None: left out)."""
    import gguf
    import numpy as np

    names = name_map(cfg)
    tensors = extra_tensors(cfg)
    tensors += [
        t
        for s in plan.specs
        if (text := rename(s.name)) is not None  # a vision tower's: not in the GGUF
        for t in plan_tensors(names, cfg, s.name, s.shape, kind, text)
    ]
    writer = gguf.GGUFWriter(path, arch_name(cfg))
    _add_metadata(writer, cfg, path.stem, kind)
    vocab.add_to(writer)
    for t in tensors:
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tensors:
            _write_data(writer, plan, t)
        writer.flush()
        assert writer.fout is not None
        os.fsync(writer.fout[0].fileno())
    finally:
        writer.close()
    return len(tensors)


def _model_config(base: Any) -> dict[str, Any]:
    cfg = text_config(base.config.to_dict())
    check_arch(cfg, KEY)
    return cfg


def _vocab(
    base: Any, tok: Any, scratch: Path, cfg: Mapping[str, Any], spm: Path | None
) -> GgufVocab:
    """The tokenizer as trained (saved, as final/ has it), read with gguf's own readers;
    with the base's SentencePiece model ``spm``, its pieces and scores."""
    n_vocab = int(cfg["vocab_size"])
    tok.save_pretrained(str(scratch))
    if not (scratch / "config.json").exists():  # SpecialVocab's fallback for token ids
        base.config.to_json_file(str(scratch / "config.json"))
    if cfg["model_type"] == "gemma3_text":  # Gemma3Model.set_vocab
        if spm is None:
            raise ConfigError(f"{KEY}: a Gemma 3 GGUF needs the base's {SPM_FILE}")
        return replace(build_spm_vocab(spm, scratch, n_vocab), add_space_prefix=False)
    return build_vocab(scratch, n_vocab) if spm is None else build_spm_vocab(spm, scratch, n_vocab)


def export_gguf(
    model: Any, tok: Any, gguf_dir: Path, kind: GgufType, name: str, spm: Path | None = None
) -> Path:
    """``gguf_dir/<name>-<kind>.gguf`` and ``gguf_dir/Modelfile`` from a peft model;
    ``spm``: the base's SentencePiece model (:func:`sentencepiece_model`), if it has one."""
    from shoestring.train.merge import plan_merge

    require_gguf(KEY)
    t0 = time.perf_counter()
    base = model.get_base_model()
    cfg = _model_config(base)
    plan = plan_merge(model, stored_names=False)  # llama.cpp stacks the experts
    gguf_dir.mkdir(parents=True, exist_ok=True)
    prune_temps(gguf_dir)
    tmp = gguf_dir / f"{TMP_PREFIX}{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        vocab = _vocab(base, tok, tmp / "tokenizer", cfg, spm)
        file = f"{name}-{kind}.gguf"
        n = write_gguf(tmp / file, plan, cfg, vocab, kind, text_names(base))
        os.replace(tmp / file, gguf_dir / file)
        fsync_dir(gguf_dir)
        _write_modelfile(gguf_dir, file, vocab)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = gguf_dir / file
    log.info(
        "GGUF %s: %d tensors, %.1f MB in %.1f s -> %s",
        kind,
        n,
        out.stat().st_size / 1e6,
        time.perf_counter() - t0,
        out,
    )
    return out


def _write_modelfile(gguf_dir: Path, file: str, vocab: GgufVocab) -> None:
    eos = vocab.token(vocab.special.special_token_ids.get("eos"))
    stops = stop_tokens(eos, vocab.chat_template, vocab.tokens)
    text = modelfile(file, stops, vocab.chat_template is not None)
    atomic_write(gguf_dir / MODELFILE, text.encode())


def export_gguf_from(
    model_dir: Path,
    adapter_dir: Path,
    model_cfg: ModelConfig,
    quantize: str,
    tok: Any,
    gguf_dir: Path,
    kind: GgufType,
) -> Path:
    """Merge a saved adapter onto a freshly loaded base (quantized as it was trained:
    the merge is onto its dequantized weights, as at the end of the run) and export it."""
    from peft import PeftModel

    from shoestring.train.model import load_base_model

    base = load_base_model(model_dir, model_cfg, quantize=quantize)
    model = PeftModel.from_pretrained(base, str(adapter_dir))
    return export_gguf(model, tok, gguf_dir, kind, model_dir.name, sentencepiece_model(model_dir))


def gguf_at_end(
    model: Any | None,
    final: Path,
    model_dir: Path,
    cfg: FinetuneConfig,
    tok: Any,
    out: Path,
) -> Path:
    """The end of a run: from the model in memory, or, when this process holds only shards
    (``model`` None: FSDP2), from ``final/`` onto a fresh base."""
    kind: GgufType = cfg.export.gguf  # type: ignore[assignment]  # checked != "none"
    gguf_dir = out / GGUF_DIR
    if model is None:
        return export_gguf_from(model_dir, final, cfg.model, cfg.lora.quantize, tok, gguf_dir, kind)
    return export_gguf(model, tok, gguf_dir, kind, model_dir.name, sentencepiece_model(model_dir))
