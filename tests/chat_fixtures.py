"""Tiny offline tokenizers with real chat templates, and sample conversations.

Both tokenizers are the built-in byte tokenizer (byte b is token b) plus the chat
special tokens of a real model family, ids 259 and up (the built-in tiny model's
padded vocabulary of 320 has room for them):

* :func:`chatml_tokenizer`: Qwen2.5's ChatML template, verbatim in structure —
  ``<|im_start|>role\\ncontent<|im_end|>\\n``, a default system message, tools in
  the system message, tool calls as ``<tool_call>`` JSON, tool results as a user
  turn with ``<tool_response>``; generation prompt ``<|im_start|>assistant\\n``;
  EOS ``<|im_end|>``, no BOS.
* :func:`llama3_tokenizer`: Llama-3.1's template — ``<|begin_of_text|>``, a system
  header with the knowledge-cutoff lines, ``<|start_header_id|>role<|end_header_id|>
  \\n\\ncontent<|eot_id|>`` with trimmed content, tool calls as JSON, tool results as
  ``ipython`` turns; EOS ``<|eot_id|>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shoestring.train.builtin import build_tokenizer, model_tokenizer

#: Qwen2.5-Instruct's chat template (tokenizer_config.json), reformatted.
CHATML_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \
\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. \
You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) \
or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

#: Llama-3.1-Instruct's chat template, without the built-in (brave/wolfram) tools.
LLAMA3_TEMPLATE = """\
{{- bos_token }}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond \
with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument \
name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no \
first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument \
name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' \
+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

#: Qwen3's way of breaking prefix stability: the generation prompt opens an empty
#: ``<think>`` block that the rendered assistant turn does not have.
NOT_PREFIX_STABLE_TEMPLATE = CHATML_TEMPLATE.replace(
    "{{- '<|im_start|>assistant\\n' }}\n{%- endif %}",
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}\n{%- endif %}",
)

CHATML_SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
#: Qwen2.5 has these as added (not special) tokens.
CHATML_ADDED = ("<tool_call>", "</tool_call>")
LLAMA3_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
)


MISTRAL_SPECIALS = (
    "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
    "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[ARGS]",
)  # fmt: skip
#: Mistral's chat template, cut to its shape (v3: Mistral-7B-Instruct-v0.3, Nemo): the
#: tools before the last user turn, ``[INST]...[/INST]``, an assistant's calls as
#: ``[TOOL_CALLS]`` and a JSON list (v11, ``CALLS_V11``: ``[TOOL_CALLS]name[ARGS]{...}``
#: each), tool results in ``[TOOL_RESULTS]``.
MISTRAL_TEMPLATE = """\
{{- bos_token }}
{%- for m in messages %}
{%- if m.role == 'user' %}
{%- if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{{- '[INST]' + m.content + '[/INST]' }}
{%- elif m.role == 'assistant' and m.tool_calls %}CALLS{{ eos_token }}
{%- elif m.role == 'assistant' %}{{ m.content + eos_token }}
{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]
{%- endif %}
{%- endfor %}
"""
CALLS_V3 = (
    "[TOOL_CALLS][{%- for c in m.tool_calls %}{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}{{ ', ' if not loop.last }}{%- endfor %}]"
)
CALLS_V11 = (
    "{%- for c in m.tool_calls %}[TOOL_CALLS]{{ c.function.name }}[ARGS]"
    "{{ c.function.arguments | tojson }}{%- endfor %}"
)


def mistral_tokenizer(v11: bool = False) -> Any:
    """A tokenizer with Mistral's control tokens and chat template (v3, or v11's calls)."""
    tok = build_tokenizer()
    tok.add_tokens(list(MISTRAL_SPECIALS), special_tokens=True)
    tok.bos_token, tok.eos_token = "<s>", "</s>"
    tok.chat_template = MISTRAL_TEMPLATE.replace("CALLS", CALLS_V11 if v11 else CALLS_V3)
    return tok


def plain_tokenizer() -> Any:
    """The built-in tiny model's tokenizer: no chat template, adds BOS itself (Llama-like)."""
    return model_tokenizer()


def chatml_tokenizer() -> Any:
    tok = build_tokenizer()
    tok.add_tokens(list(CHATML_SPECIALS), special_tokens=True)
    tok.add_tokens(list(CHATML_ADDED), special_tokens=False)
    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|endoftext|>"
    tok.bos_token = None
    tok.chat_template = CHATML_TEMPLATE
    return tok


def llama3_tokenizer() -> Any:
    tok = build_tokenizer()
    tok.add_tokens(list(LLAMA3_SPECIALS), special_tokens=True)
    tok.bos_token = "<|begin_of_text|>"
    tok.eos_token = "<|eot_id|>"
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


def save_tokenizer(tok: Any, directory: str | Path) -> Path:
    """Write the tokenizer (with its chat template) into a model directory."""
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(target)
    return target


# --------------------------------------------------------------------------- conversations

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def tiny_chat_model(target: Path, seed: int = 9) -> Path:
    """A tiny random llama with the ChatML tokenizer (its ids fit the padded vocab)."""
    from shoestring.infer.fixtures import build_random_model

    d = build_random_model(target, "llama", seed=seed)
    for f in d.glob("tokenizer*"):
        f.unlink()
    for f in d.glob("special_tokens_map.json"):
        f.unlink()
    save_tokenizer(chatml_tokenizer(), d)
    return d


def multi_turn() -> list[dict[str, Any]]:
    """System + three user/assistant exchanges (one answer is non-ASCII)."""
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Japan?"},
        {"role": "assistant", "content": "Tōkyō — 東京."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome."},
    ]


def tool_turns() -> list[dict[str, Any]]:
    """A user question, an assistant tool call, the tool's answer and the final reply."""
    call = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    return [
        {"role": "system", "content": "You check the weather."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": call}],
        },
        {"role": "tool", "name": "get_weather", "content": '{"temp_c": -3}'},
        {"role": "assistant", "content": "It is -3 °C in Oslo."},
    ]
