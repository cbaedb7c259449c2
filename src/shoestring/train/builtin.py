"""The embedded default for ``shoestring finetune`` run without a config.

``builtin:tiny`` is a small random-init Llama (4 layers, hidden 256) with a
byte-level tokenizer, written once into a cache directory from a fixed seed;
the same parameters give a byte-identical ``model.safetensors`` every time.

``builtin:reverse`` is a synthetic task: reverse a random lowercase word of 4-10
distinct letters (``"reverse: abcde ="`` -> ``" edcba"``). Chance-level exact
match is ~0; with LoRA on the frozen random base, held-out exact match climbs past
90% within about two CPU minutes (2 cores), so learning is plain to see.
``builtin:prefer-reverse`` is the same task as preference pairs (chosen: the reversed
word; rejected: the same with one letter replaced by a digit) for ``train.objective
dpo|orpo``; chance-level reward accuracy is ~50 %.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

BUILTIN_MODEL = "builtin:tiny"
BUILTIN_TASK = "builtin:reverse"
#: The same words as preference pairs (``train.objective dpo|orpo|simpo``): the chosen answer
#: is the reversed word, the rejected one the same with one letter replaced by a digit.
BUILTIN_PREFERENCE_TASK = "builtin:prefer-reverse"
BUILTIN_TASKS = (BUILTIN_TASK, BUILTIN_PREFERENCE_TASK)

#: Bump when the generated files would change for the same parameters (2: the saved
#: tokenizer adds its BOS itself, as the model has always been trained with it).
_FORMAT_VERSION = 2
_MODEL_SEED = 1234
#: pad, bos, eos; they get ids 256, 257, 258 after the 256 byte tokens.
SPECIAL_TOKENS: tuple[str, str, str] = ("<pad>", "<s>", "</s>")
MODEL_PARAMS: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
}
#: Std of the output head, re-drawn after the default init. At initializer_range
#: (0.02) the logits of a frozen head are too flat to express a confident
#: prediction, and LoRA training stalls or crawls.
_LM_HEAD_STD = 0.15
_COMPLETE_MARKER = ".complete"
_REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    _COMPLETE_MARKER,
)


def padded_vocab(n: int, multiple: int = 64) -> int:
    return (n + multiple - 1) // multiple * multiple


def _params_hash() -> str:
    blob = json.dumps(
        {
            "v": _FORMAT_VERSION,
            "seed": _MODEL_SEED,
            "model": MODEL_PARAMS,
            "lm_head_std": _LM_HEAD_STD,
            "special": SPECIAL_TOKENS,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in _REQUIRED_FILES)


def build_tokenizer() -> Any:
    """Byte-level BPE without merges: byte b is token b, specials follow at 256+."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()  # byte value -> printable stand-in character
    vocab = {byte_chars[b]: b for b in range(256)}
    vocab.update({tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)})
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(list(SPECIAL_TOKENS))
    pad, bos, eos = SPECIAL_TOKENS
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        model_max_length=MODEL_PARAMS["max_position_embeddings"],
    )


def model_tokenizer() -> Any:
    """The tiny model's tokenizer: the byte tokenizer that, like Llama's, puts BOS in
    front of a text itself, so training and inference (:mod:`shoestring.data.specials`)
    both start every plain prompt with it, as the model has always been trained."""
    tok = build_tokenizer()
    tok.add_bos_token = True  # rewrites the post-processor: "<s> $A"
    return tok


def _fsync_tree(path: Path) -> None:
    for p in [*path.iterdir(), path]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_model(target: Path) -> None:
    import string

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = model_tokenizer()
    sample = string.printable + "reverse:  two  spaces =  "
    if tok.decode(tok.encode(sample, add_special_tokens=False)) != sample:
        raise RuntimeError("builtin tokenizer does not round-trip ASCII text")
    pad_id, bos_id, eos_id = tok.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    config = LlamaConfig(
        vocab_size=padded_vocab(len(tok)),
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        **MODEL_PARAMS,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_MODEL_SEED)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, _LM_HEAD_STD)
    gen = model.generation_config
    gen.pad_token_id, gen.bos_token_id, gen.eos_token_id = pad_id, bos_id, eos_id
    model.save_pretrained(target, safe_serialization=True)
    tok.save_pretrained(target)
    (target / _COMPLETE_MARKER).write_text(_params_hash() + "\n")
    _fsync_tree(target)


def materialize_tiny_model(cache_dir: Path) -> Path:
    """Write (once) a HF model dir: config.json, model.safetensors, tokenizer files.

    The directory is ``cache_dir/tiny-<hash of the generating parameters>``. It is
    built in a temporary sibling and renamed into place, so an interrupted build
    never leaves a directory that looks complete. Returns the model directory.
    """
    cache_dir = Path(cache_dir)
    final = cache_dir / f"tiny-{_params_hash()}"
    if _is_complete(final):
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache_dir))
    try:
        _write_model(tmp)
        if final.exists() and not _is_complete(final):
            shutil.rmtree(final, ignore_errors=True)  # not ours: renames are atomic
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final):  # else a concurrent builder won: same bytes
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for stale in cache_dir.glob(f".{final.name}.tmp-*"):  # left by killed builders
        try:
            if time.time() - stale.stat().st_mtime > 3600:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass
    return final


# --------------------------------------------------------------------------- task

_TASK_SEED = 20240611
_N_TRAIN = 4000
_N_EVAL = 200
_MIN_LEN, _MAX_LEN = 4, 10
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _broken(word: str, rng: random.Random) -> str:
    """The reversed word with one letter replaced by a digit: an answer that breaks the
    rule (only the word's own letters)."""
    rev = list(word[::-1])
    rev[rng.randrange(len(rev))] = str(rng.randrange(10))
    return " " + "".join(rev)


def builtin_records(split: str, task: str = BUILTIN_TASK) -> list[dict[str, str]]:
    """Deterministic {"prompt": ..., "completion": ...} records of the reversal task.

    ``split`` is "train" (4000 records) or "eval" (200); no word is in both.
    A record looks like ``{"prompt": "reverse: qxbn =", "completion": " nbxq"}``;
    the completion carries no EOS (the trainer appends it).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"builtin task split must be 'train' or 'eval', got {split!r}")
    rng = random.Random(_TASK_SEED)
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < _N_EVAL + _N_TRAIN:
        word = "".join(rng.sample(_LETTERS, rng.randint(_MIN_LEN, _MAX_LEN)))
        if word not in seen:
            seen.add(word)
            words.append(word)
    chosen = words[:_N_EVAL] if split == "eval" else words[_N_EVAL:]
    if task == BUILTIN_PREFERENCE_TASK:
        return [
            {"prompt": f"reverse: {w} =", "chosen": f" {w[::-1]}", "rejected": _broken(w, rng)}
            for w in chosen
        ]
    return [{"prompt": f"reverse: {w} =", "completion": f" {w[::-1]}"} for w in chosen]
