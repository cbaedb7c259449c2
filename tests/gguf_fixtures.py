"""Tiny random Llama, Qwen2 and Qwen3 model dirs with byte-level BPE tokenizers trained on the
spot (Llama 3 and Qwen2 split regexes, special tokens, chat templates), and a Mistral with a
SentencePiece ``tokenizer.model`` (as Llama 2 and Mistral 7B have), for the GGUF export
tests and benchmark. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. reverse: abcde = edcba",
    "Fine-tuning on a shoestring: 4-bit base, 16-bit export, 1234 5678.",
    "Hello world! How are you today? I'm fine, thanks; and you?",
] * 20


def bpe_tokenizer(split: str, specials: list[str], bos: str | None, eos: str, template: str) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tk.train_from_iterator(CORPUS, trainer)
    tk.add_special_tokens(specials)
    if bos is not None:
        bos_id = tk.token_to_id(bos)
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token=bos, eos_token=eos, chat_template=template
    )


MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}"
    " [/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def spm_tokenizer(path: Path, gemma: bool = False) -> Any:
    """A SentencePiece BPE with byte fallback trained on ``CORPUS`` into
    ``path/tokenizer.model`` (ids 0-2: ``<unk> <s> </s>``, as Llama 2 and Mistral; with
    ``gemma``, Gemma's ``<pad> <eos> <bos> <unk>`` and turn markers, no dummy prefix),
    and the transformers tokenizer it converts to, with an added special token."""
    import io
    import json

    import sentencepiece as spm
    from transformers import AutoTokenizer

    ids = (dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
                bos_piece="<bos>", add_dummy_prefix=False,
                user_defined_symbols=["<start_of_turn>", "<end_of_turn>"])
           if gemma else dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1))  # fmt: skip
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=buf, vocab_size=384, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, minloglevel=2, **ids,
    )  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.model").write_bytes(buf.getvalue())
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
              "legacy": False, "chat_template": MISTRAL_TEMPLATE}  # fmt: skip
    if gemma:
        config |= {"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "pad_token": "<pad>",
                   "eos_token": "<end_of_turn>", "chat_template": GEMMA_TEMPLATE}  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    return tok


def tiny_model_dir(
    path: Path, arch: str, tied: bool = False, seed: int = 0, rope: dict[str, Any] | None = None
) -> Path:
    """A random ``llama`` (GQA, Llama 3 tokenizer and template), ``mistral`` (GQA, a
    SentencePiece tokenizer, [INST] template), ``qwen2`` (q/k/v biases, ChatML), ``qwen3``
    (q/k RMS norms, ChatML) or ``qwen3_moe`` (4 experts, 2 a token) model dir; widths multiples of 64 (the 4-bit CPU kernels' rule).
    ``rope``: its ``rope_parameters`` (transformers 5's ``rope_scaling``), e.g. llama3; for
    ``phi3`` (Phi-3-mini's build, a SentencePiece tokenizer), config keys instead (its
    ``partial_rotary_factor`` and LongRoPE ``rope_scaling``)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    if arch == "llama":
        tok = bpe_tokenizer(
            LLAMA3_SPLIT,
            [
                "<|begin_of_text|>",
                "<|end_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
            ],
            "<|begin_of_text|>",
            "<|eot_id|>",
            LLAMA3_TEMPLATE,
        )
        cls, ccls = LlamaForCausalLM, LlamaConfig
        extra: dict[str, Any] = {"num_key_value_heads": 2}
    elif arch == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        tok = spm_tokenizer(path)
        cls, ccls = MistralForCausalLM, MistralConfig
        # no window (7B v0.2 on); rows past the pieces and the added token: [PAD] in GGUF
        extra = {"num_key_value_heads": 2, "sliding_window": None, "vocab_size": 448}
    elif arch == "phi3":
        from transformers import Phi3Config, Phi3ForCausalLM

        tok = spm_tokenizer(path)  # Phi-3-mini's kind: SentencePiece, as Llama 2's
        cls, ccls = Phi3ForCausalLM, Phi3Config
        extra = {"num_key_value_heads": 2, "vocab_size": 448, "pad_token_id": tok.unk_token_id,
                 **(rope or {})}  # fmt: skip
        rope = None
    elif arch in ("gemma3_text", "gemma3"):
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        tok = spm_tokenizer(path, gemma=True)
        cls, ccls = Gemma3ForCausalLM, Gemma3TextConfig
        # llama.cpp's GEMMA3: five sliding layers in six (its fixed pattern), the local
        # rotary base 10000, q scaled by 1/sqrt(head_dim); transformers' GGUF reader
        # takes Gemma 3's query_pre_attn_scalar default, 256: so is head_dim here
        extra = {"num_key_value_heads": 1, "num_hidden_layers": 6, "head_dim": 256,
                 "query_pre_attn_scalar": 256, "sliding_window": 16, "vocab_size": 448,
                 "pad_token_id": tok.pad_token_id}  # fmt: skip
        tied = True
    else:
        tok = bpe_tokenizer(
            QWEN2_SPLIT,
            ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            None,
            "<|im_end|>",
            CHATML_TEMPLATE,
        )
        cls, ccls = {
            "qwen2": (Qwen2ForCausalLM, Qwen2Config),
            "qwen3": (Qwen3ForCausalLM, Qwen3Config),
            "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig),
        }[arch]
        extra = {"num_key_value_heads": 2}
        if arch == "qwen3":
            # transformers' GGUF loader reads no head_dim for qwen3 (llama.cpp reads
            # attention.key_length): it takes Qwen3Config's 128, which every Qwen3 has.
            extra["head_dim"] = 128
        if arch == "qwen3_moe":
            # nor moe_intermediate_size (expert_feed_forward_length): Qwen3-30B-A3B's 768
            # is its default; and it sets norm_topk_prob as llama.cpp computes it
            extra |= {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 768,
                      "norm_topk_prob": True}  # fmt: skip
    n = len(tok)
    cfg = ccls(
        vocab_size=extra.pop("vocab_size", (n + 63) // 64 * 64),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=extra.pop("num_hidden_layers", 2),
        num_attention_heads=4,
        max_position_embeddings=extra.pop("max_position_embeddings", 256),
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        rope_parameters=rope,
        **{"head_dim": 32, **extra},
    )
    if arch == "gemma3":  # 4B and up: the decoder beside a SigLIP tower (never exported)
        from transformers import Gemma3Config, Gemma3ForConditionalGeneration

        tower = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                 "num_attention_heads": 1, "image_size": 64, "patch_size": 16,
                 "vision_use_head": False}  # fmt: skip
        cfg = Gemma3Config(text_config=cfg.to_dict(), vision_config=tower, mm_tokens_per_image=4)
        cls = Gemma3ForConditionalGeneration
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():  # a peaked head: greedy decoding is not decided by ties
        model.get_output_embeddings().weight.normal_(0.0, 0.15)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            if name.endswith(("q_norm.weight", "k_norm.weight")):  # not all ones: checked
                p.normal_(1.0, 0.2)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


#: Every linear of the families here (Phi-3's fused ones too; peft skips absent names).
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "qkv_proj", "gate_up_proj"]  # fmt: skip


#: An MoE's fused experts, which peft adapts as parameters.
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def adapted_model(model_dir: Path, parameters: list[str] | None = None) -> Any:
    """The base with LoRA on every linear (and on ``parameters``), B drawn non-zero (a
    trained-looking adapter)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from shoestring.train.towers import exclude_pattern, outside_decoder

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=TARGETS, target_parameters=parameters, lora_dropout=0.0,
        exclude_modules=exclude_pattern(outside_decoder(base)),  # as finetune: no tower
    )  # fmt: skip
    model = get_peft_model(base, config)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    return model.eval()
