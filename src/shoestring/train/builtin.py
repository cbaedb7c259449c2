"""The embedded default for ``shoestring finetune`` run without a config.

``builtin:tiny`` is a small random-init Llama with a byte-level tokenizer, written
once into a cache directory from a fixed seed (byte-identical every time).
``builtin:reverse`` is a synthetic task, "reverse a short lowercase word", on which
LoRA learning is clearly visible within a couple of CPU minutes: held-out exact
match rises from 0 to well above chance.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

BUILTIN_MODEL = "builtin:tiny"
BUILTIN_TASK = "builtin:reverse"

#: Bump when the generated files would change for the same parameters.
_FORMAT_VERSION = 1
_MODEL_SEED = 1234
_TASK_SEED = 20240611
SPECIAL_TOKENS: tuple[str, str, str] = ("<pad>", "<s>", "</s>")  # ids 256, 257, 258
_MODEL_PARAMS: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 256,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
}
#: Std of the output head, re-drawn after the default init. With initializer_range
#: (0.02) the logits of a frozen head are too flat to express a confident
#: prediction, and LoRA training stalls.
_INIT_STD: dict[str, float] = {"lm_head": 0.15}
_COMPLETE_MARKER = ".complete"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json",
                   "tokenizer_config.json", _COMPLETE_MARKER)


def _padded_vocab(n: int, multiple: int = 64) -> int:
    return (n + multiple - 1) // multiple * multiple


def _params_hash() -> str:
    blob = json.dumps({"v": _FORMAT_VERSION, "seed": _MODEL_SEED, "model": _MODEL_PARAMS, "init": _INIT_STD,
                       "special": SPECIAL_TOKENS}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def _build_tokenizer() -> Any:
    """Byte-level BPE without merges: every byte is one token, specials at 256+."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()  # byte value -> printable unicode char
    vocab = {byte_chars[b]: b for b in range(256)}
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(list(SPECIAL_TOKENS))
    pad, bos, eos = SPECIAL_TOKENS
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=bos, eos_token=eos,
                                   pad_token=pad, model_max_length=_MODEL_PARAMS[
                                       "max_position_embeddings"])


def _write_model(target: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _build_tokenizer()
    sample = "reverse: hello, World! 0123 ~{}\n\t"
    if tok.decode(tok.encode(sample, add_special_tokens=False)) != sample:
        raise RuntimeError("builtin tokenizer does not round-trip ASCII text")
    pad_id, bos_id, eos_id = tok.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    config = LlamaConfig(vocab_size=_padded_vocab(len(tok)), pad_token_id=pad_id,
                         bos_token_id=bos_id, eos_token_id=eos_id, **_MODEL_PARAMS)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_MODEL_SEED)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            if not config.tie_word_embeddings:
                model.lm_head.weight.normal_(0.0, _INIT_STD["lm_head"])
    model.generation_config.pad_token_id = pad_id
    model.generation_config.bos_token_id = bos_id
    model.generation_config.eos_token_id = eos_id
    model.save_pretrained(target, safe_serialization=True)
    tok.save_pretrained(target)
    (target / _COMPLETE_MARKER).write_text(_params_hash() + "\n")


def materialize_tiny_model(cache_dir: Path) -> Path:
    """Write (once) a HF model dir: config.json, model.safetensors, tokenizer files.

    The directory name carries a hash of the generating parameters. It is built in
    a temporary sibling and renamed into place, so an interrupted build never
    leaves a directory that looks complete. Returns the model directory.
    """
    cache_dir = Path(cache_dir)
    final = cache_dir / f"tiny-{_params_hash()}"
    if all((final / name).is_file() for name in _REQUIRED_FILES):
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache_dir))
    try:
        _write_model(tmp)
        if final.exists():  # incomplete leftover from an older layout: replace it
            if all((final / name).is_file() for name in _REQUIRED_FILES):
                return final
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            # Lost a race with a concurrent builder: theirs is identical.
            if not all((final / name).is_file() for name in _REQUIRED_FILES):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# --------------------------------------------------------------------------- task

_N_TRAIN = 4000
_N_EVAL = 200
_MIN_LEN, _MAX_LEN = 3, 6
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _word(rng: random.Random) -> str:
    n = rng.randint(_MIN_LEN, _MAX_LEN)
    return "".join(rng.sample(_LETTERS, n))


def builtin_records(split: str) -> list[dict[str, str]]:
    """Deterministic {"prompt": ..., "completion": ...} records of the reversal task.

    ``split`` is "train" or "eval"; the two splits share no word. Completions
    carry no EOS (the trainer appends it).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"builtin task split must be 'train' or 'eval', got {split!r}")
    rng = random.Random(_TASK_SEED)
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < _N_EVAL + _N_TRAIN:
        w = _word(rng)
        if w not in seen:
            seen.add(w)
            words.append(w)
    chosen = words[:_N_EVAL] if split == "eval" else words[_N_EVAL:]
    return [{"prompt": f"reverse: {w} =", "completion": f" {w[::-1]}"} for w in chosen]
