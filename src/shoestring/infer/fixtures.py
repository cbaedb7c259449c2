"""Random-init decoder models saved like real checkpoints, for tests and benchmarks.

Built from a config with ``save_pretrained`` (sharded safetensors) plus the
built-in byte-level tokenizer, so no downloads are needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ARCHS = ("llama", "mistral", "qwen2")


def build_random_model(
    target: Path,
    arch: str = "llama",
    *,
    hidden: int = 128,
    layers: int = 4,
    ffn: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    dtype: torch.dtype = torch.float32,
    shard: str = "200KB",
    init_std: float = 0.2,
    seed: int = 0,
    tie: bool = False,
    context: int = 1024,
    **extra: Any,
) -> Path:
    """Write a random ``arch`` model with the byte tokenizer into ``target``.

    ``init_std`` well above the usual 0.02 makes the logits peaked, so greedy
    tokens are decided by clear margins and exactness tests are not at the mercy
    of near-ties.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from shoestring.train.builtin import SPECIAL_TOKENS, build_tokenizer

    tok = build_tokenizer()
    pad_id, bos_id, eos_id = tok.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    vocab = -(-len(tok) // 64) * 64
    config = AutoConfig.for_model(
        arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=context,
        initializer_range=init_std,
        tie_word_embeddings=tie,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        **extra,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    gen = model.generation_config
    gen.pad_token_id, gen.bos_token_id, gen.eos_token_id = pad_id, bos_id, eos_id
    model.save_pretrained(target, max_shard_size=shard)
    tok.save_pretrained(target)
    return target
