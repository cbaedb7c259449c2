"""An Ollama ``Modelfile`` for an exported GGUF.

No ``TEMPLATE`` is written: Jinja chat templates do not translate to Go templates in
general, and ``ollama create`` reads ``tokenizer.chat_template`` from the GGUF's metadata
and picks its own equivalent for the templates it knows (Llama 3, ChatML/Qwen2, ...).
Stop tokens are the end-of-sequence token and the end-of-turn tokens the chat template
uses, as ``PARAMETER stop`` lines.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

#: End-of-turn tokens of common chat templates (Llama 3, ChatML, Phi, Gemma, Llama 2).
END_OF_TURN = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "</s>")


def stop_tokens(eos: str | None, chat_template: str | None, vocab: Sequence[str]) -> list[str]:
    """The EOS token, then each known end-of-turn token the template writes."""
    stops = [eos] if eos else []
    known = set(vocab)
    for tok in END_OF_TURN:
        if chat_template and tok in chat_template and tok in known and tok not in stops:
            stops.append(tok)
    return stops


def modelfile(gguf_name: str, stops: Sequence[str], has_template: bool) -> str:
    lines = [
        "# Written by shoestring. Build the model: ollama create NAME -f Modelfile",
        f"FROM ./{gguf_name}",
    ]
    if has_template:
        lines += [
            "# No TEMPLATE here: ollama create reads the chat template from the GGUF's",
            "# tokenizer.chat_template metadata and uses its own equivalent of it.",
        ]
    else:
        lines.append("# The tokenizer has no chat template: prompts are passed through as text.")
    lines += [f"PARAMETER stop {json.dumps(s)}" for s in stops]
    return "\n".join(lines) + "\n"
