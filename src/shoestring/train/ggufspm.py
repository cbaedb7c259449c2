"""A SentencePiece tokenizer as GGUF metadata (Llama 2, Mistral 7B), the way llama.cpp's
``convert_hf_to_gguf.py`` writes one (``_set_vocab_sentencepiece``, which its LLAMA
models try first): ``tokenizer.ggml.model = llama``, pre-tokenizer ``default``, every
piece of ``tokenizer.model`` with its score (llama.cpp's SentencePiece tokenizer merges
by them) and type (unknown, control, unused, byte or normal), the tokenizer's added
tokens (``tokenizer_config.json``, ``tokenizer.json``; ``<unk> <s> </s>`` among them) over
those ids (CONTROL when special or shaped like a control token, else USER_DEFINED with
``▁`` as spaces, score -1000), ids up to
the embedding's rows ``[PAD<i>]`` UNUSED at -10000, then gguf's ``SpecialVocab`` without
merges (bos/eos/unk/pad ids, ``add_bos/eos_token``, the chat template).

The pieces come from the base model's own ``tokenizer.model`` (a fine-tune does not
change them; transformers 5 does not save that file with the tokenizer), the added
tokens and template from the tokenizer as trained.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shoestring.config import ConfigError
from shoestring.train.ggufvocab import GgufVocab

SPM_FILE = "tokenizer.model"
SPM_HINT = "needs the sentencepiece package: pip install 'shoestring[gguf]'"


def sentencepiece_model(model_dir: Path) -> Path | None:
    """The base's SentencePiece model, which llama.cpp reads before any tokenizer.json."""
    path = model_dir / SPM_FILE
    return path if path.is_file() else None


def load_processor(path: Path, key: str) -> Any:
    """``path`` loaded by sentencepiece; missing package or bad file: a ConfigError."""
    try:
        from sentencepiece import SentencePieceProcessor
    except ImportError as e:
        raise ConfigError(f"{key}: {path} is a SentencePiece tokenizer; {SPM_HINT}") from e
    sp = SentencePieceProcessor()
    try:
        sp.LoadFromFile(str(path))
    except (OSError, RuntimeError) as e:
        raise ConfigError(f"{key}: {path}: not a SentencePiece model ({e})") from e
    return sp


def looks_special(token: str) -> bool:
    """convert_hf_to_gguf's ``does_token_look_special``: added tokens some models forget
    to mark special, which llama.cpp still makes CONTROL."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<｜") and token.endswith("｜>"))
        or (token.startswith(("<start_of_", "<end_of_")) and token.endswith(">"))
    )


def _piece_type(sp: Any, i: int) -> int:
    import gguf

    t = gguf.TokenType
    for test, kind in ((sp.IsUnknown, t.UNKNOWN), (sp.IsControl, t.CONTROL),
                       (sp.IsUnused, t.UNUSED), (sp.IsByte, t.BYTE)):  # fmt: skip
        if test(i):
            return int(kind)
    return int(t.NORMAL)


def _tokenizer_config(tok_dir: Path) -> dict[str, Any]:
    path = tok_dir / "tokenizer_config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _added_tokens(tok_dir: Path, config: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """id -> added token, from ``tokenizer_config.json``'s ``added_tokens_decoder`` (what
    convert reads; transformers 4 wrote it) and ``tokenizer.json``'s ``added_tokens``
    (where transformers 5 keeps them)."""
    added = {int(k): v for k, v in config.get("added_tokens_decoder", {}).items()}
    path = tok_dir / "tokenizer.json"
    if path.is_file():
        tj = json.loads(path.read_text(encoding="utf-8"))
        added |= {int(a["id"]): a for a in tj.get("added_tokens") or []}
    return added


def _added(tok_dir: Path, config: dict[str, Any], n_vocab: int) -> list[tuple[int, str, bool]]:
    """The tokenizer's added tokens: (id, text as llama.cpp stores it, control?)."""
    out = []
    for tid, added in _added_tokens(tok_dir, config).items():
        text = str(added["content"])
        if tid >= n_vocab:
            raise ConfigError(
                f"export.gguf: added token {text!r} has id {tid}, the model {n_vocab} rows"
            )
        control = bool(added.get("special")) or looks_special(text)
        out.append((tid, text if control else text.replace("\u2581", " "), control))
    return sorted(out)


def build_spm_vocab(spm: Path, tok_dir: Path, n_vocab: int) -> GgufVocab:
    """``spm``'s pieces with the added tokens of the tokenizer saved in ``tok_dir``,
    padded to the embedding's ``n_vocab`` rows."""
    import gguf

    sp = load_processor(spm, "export.gguf")
    if sp.vocab_size() > n_vocab:
        raise ConfigError(
            f"export.gguf: {spm} has {sp.vocab_size()} pieces, the model {n_vocab} rows"
        )
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    scores, types = [-10000.0] * n_vocab, [int(gguf.TokenType.UNUSED)] * n_vocab
    for i in range(sp.vocab_size()):
        tokens[i], scores[i], types[i] = sp.IdToPiece(i), sp.GetScore(i), _piece_type(sp, i)
    config = _tokenizer_config(tok_dir)
    for tid, text, control in _added(tok_dir, config, n_vocab):
        types[tid] = int(gguf.TokenType.CONTROL if control else gguf.TokenType.USER_DEFINED)
        tokens[tid], scores[tid] = text, -1000.0
    special = gguf.SpecialVocab(tok_dir, load_merges=False, n_vocab=n_vocab)
    prefix = config.get("add_prefix_space")
    return GgufVocab("default", tokens, types, special, "llama", scores,
                     None if prefix is None else bool(prefix))  # fmt: skip
