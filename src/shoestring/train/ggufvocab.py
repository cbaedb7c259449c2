"""The tokenizer as GGUF metadata, the way llama.cpp's ``convert_hf_to_gguf.py`` writes a
byte-level BPE (``_set_vocab_gpt2``): ``tokenizer.ggml.model = gpt2``, the pre-tokenizer's
llama.cpp name, every token with its type (added special tokens CONTROL, other added
tokens USER_DEFINED, ids the tokenizer leaves unused up to the embedding's rows
``[PAD<i>]`` UNUSED), then gguf's ``SpecialVocab``: merges, special token ids,
``add_bos/eos_token`` and ``tokenizer.chat_template``.

The token list comes from gguf's ``BpeVocab``. llama.cpp names its pre-tokenizer from a
hash of token ids; we name it from the split regex in ``tokenizer.json`` and refuse one
we do not know, as convert_hf_to_gguf refuses an unknown hash. SentencePiece
(``tokenizer.model``: Llama 2, Mistral) are written by :mod:`.ggufspm`. BPE without
merges (the built-in tiny model's byte tokenizer: llama.cpp refuses a BPE vocabulary
without ``tokenizer.ggml.merges``) is refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoestring.config import ConfigError

if TYPE_CHECKING:
    import gguf

#: Split regexes of ``tokenizer.json`` -> llama.cpp's ``tokenizer.ggml.pre`` for them
#: (``llama_vocab::impl::load``). Llama 3's and Qwen2's, as their tokenizers write them.
PRE_BY_SPLIT: dict[str, str] = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
}
#: ``ByteLevel(use_regex=true)`` alone splits with GPT-2's own regex.
GPT2_PRE = "gpt-2"


def read_tokenizer_json(tok_dir: Path, key: str) -> dict[str, Any]:
    path = tok_dir / "tokenizer.json"
    if not path.is_file():
        what = "a SentencePiece tokenizer.model" if (tok_dir / "tokenizer.model").is_file() else ""
        raise ConfigError(
            f"{key}: {tok_dir} has no tokenizer.json{' (only ' + what + ')' if what else ''}; "
            "the GGUF export writes byte-level BPE tokenizers (Llama 3, Qwen2) only"
        )
    tj: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return tj


def _steps(node: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    if not node:
        return []
    if node.get("type") == "Sequence":
        inner = node.get("pretokenizers") or node.get("decoders") or []
        return [s for n in inner for s in _steps(n)]
    return [node]


def pre_tokenizer_name(tj: Mapping[str, Any], key: str) -> str:
    """llama.cpp's name for the way this tokenizer splits text before its merges."""
    steps = _steps(tj.get("pre_tokenizer"))
    splits = [s.get("pattern", {}).get("Regex") for s in steps if s.get("type") == "Split"]
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    if not splits and byte_level and byte_level[0].get("use_regex", True):
        return GPT2_PRE
    if len(splits) == 1 and splits[0] in PRE_BY_SPLIT:
        return PRE_BY_SPLIT[splits[0]]
    raise ConfigError(
        f"{key}: the tokenizer's pre-tokenizer ({[s.get('type') for s in steps]}, split "
        f"{splits!r}) is not one llama.cpp names here (Llama 3, Qwen2, GPT-2)"
    )


def check_tokenizer(tj: Mapping[str, Any], key: str) -> str:
    """The pre-tokenizer name if this ``tokenizer.json`` is a byte-level BPE with merges."""
    model = tj.get("model") or {}
    decoders = [d.get("type") for d in _steps(tj.get("decoder"))]
    if model.get("type") != "BPE" or model.get("byte_fallback") or "ByteLevel" not in decoders:
        raise ConfigError(
            f"{key}: the tokenizer is a {model.get('type')} model (byte_fallback="
            f"{bool(model.get('byte_fallback'))}, decoder {decoders}), not a byte-level BPE; "
            "the GGUF export writes byte-level BPE tokenizers (Llama 3, Qwen2) only"
        )
    if not model.get("merges"):
        raise ConfigError(
            f"{key}: the tokenizer is a byte-level BPE without merges (like the built-in "
            "tiny model's byte tokenizer); llama.cpp needs tokenizer.ggml.merges, so it has "
            "no GGUF form"
        )
    return pre_tokenizer_name(tj, key)


@dataclass(frozen=True)
class GgufVocab:
    pre: str
    tokens: list[str]
    types: list[int]
    special: gguf.SpecialVocab
    model: str = "gpt2"  # llama.cpp's tokenizer kind: byte-level BPE; "llama": SentencePiece
    scores: list[float] | None = None  # SentencePiece's, which order its merges
    add_space_prefix: bool | None = None  # tokenizer_config.json's add_prefix_space, if given

    def add_to(self, writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model(self.model)
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        writer.add_token_types(self.types)
        if self.add_space_prefix is not None:
            writer.add_add_space_prefix(self.add_space_prefix)
        self.special.add_to_gguf(writer, quiet=True)

    @property
    def chat_template(self) -> str | None:
        t = self.special.chat_template
        return t if isinstance(t, str) else None

    def token(self, tid: int | None) -> str | None:
        return self.tokens[tid] if tid is not None and 0 <= tid < len(self.tokens) else None


def _token_types(tj: Mapping[str, Any], n: int) -> dict[int, int]:
    import gguf

    added = {int(a["id"]): bool(a.get("special")) for a in tj.get("added_tokens") or []}
    control, user = gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED
    return {i: int(control if special else user) for i, special in added.items() if i < n}


def build_vocab(tok_dir: Path, n_vocab: int) -> GgufVocab:
    """The tokenizer saved in ``tok_dir`` (tokenizer.json, tokenizer_config.json, the chat
    template; config.json for ids it lacks), padded to the embedding's ``n_vocab`` rows."""
    import gguf

    key = "export.gguf"
    tj = read_tokenizer_json(tok_dir, key)
    pre = check_tokenizer(tj, key)
    bpe = gguf.vocab.BpeVocab(tok_dir)
    # BpeVocab yields the vocabulary's strings and its added tokens' UTF-8 bytes.
    texts = [t.decode() if isinstance(t, bytes) else str(t) for t, _s, _t in bpe.all_tokens()]
    if len(texts) > n_vocab:
        raise ConfigError(f"{key}: the tokenizer has {len(texts)} tokens, the model {n_vocab} rows")
    types = _token_types(tj, len(texts))
    normal, unused = int(gguf.TokenType.NORMAL), int(gguf.TokenType.UNUSED)
    tokens = texts + [f"[PAD{i}]" for i in range(len(texts), n_vocab)]
    kinds = [types.get(i, normal) for i in range(len(texts))] + [unused] * (n_vocab - len(texts))
    special = gguf.SpecialVocab(tok_dir, load_merges=True, n_vocab=n_vocab)
    return GgufVocab(pre, tokens, kinds, special)
