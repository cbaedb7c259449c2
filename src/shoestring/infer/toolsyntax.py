"""``tool_choice`` ``"auto"``: reading a free answer as text or as tool calls.

With ``"auto"`` the model decides: it may answer in text, or call tools in its
family's own syntax (Qwen's ``<tool_call>{...}</tool_call>``, Gemma 4's
``<|tool_call>call:name{...}<tool_call|>``). The answer is generated freely, then
read back with transformers' response parser (``tokenizer.parse_response``, from
transformers 5.13), driven by the model's *response template*:

* the tokenizer's own ``response_template`` (``tokenizer_config.json``; models on
  the Hub have started to ship one), else
* the template ``transformers serve`` falls back on for the model's ``model_type``
  (the Qwen 2/2.5/3, Qwen 3.5 and Gemma 4 families), else
* for a Llama whose chat template is Llama 3's (headers ``<|start_header_id|>``), our
  template of Llama 3.1's JSON calls (:data:`LLAMA3_JSON`: transformers ships none);
  for a Mistral whose chat template writes ``[TOOL_CALLS]``, ours of its JSON-list
  calls (:data:`MISTRAL_JSON_LIST`) or, where the template writes ``[ARGS]``, of its
  v11 calls (:data:`MISTRAL_ARGS`).

A model with neither has no known syntax, and its ``"auto"`` lines are refused
(``"required"`` and a named function need none: their answers are held to JSON).

The parser reads the generated token ids with the prompt's as prefix, so special
tokens only delimit a call when the model generated them as tokens, and a template
that pre-writes part of the answer (an opened ``<think>``) is read right. An answer
whose call does not parse (broken JSON, a call with no name) stays text, as vLLM's
tool parsers leave it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

#: transformers' response parser (``tokenizer.parse_response``) arrived in 5.13.
NEEDS = "transformers>=5.13"
#: Llama 3.1/3.2/3.3's tool calls, as their chat template asks for them: the whole answer
#: is ``{"name": ..., "parameters": {...}}`` (after ``<|python_tag|>`` for a built-in tool),
#: ended by ``<|eom_id|>`` or ``<|eot_id|>``. Anything else is text.
LLAMA3_JSON: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r"\A\s*(?:<\|python_tag\|>)?\s*(?=\{\s*\"name\"\s*:)",
            "close_pattern": r"\s*(?:<\|eom_id\|>|<\|eot_id\|>)",
            "repeats": True,
            "content": "json",
            "transform": {
                "type": "function",
                "function": {"name": "{content.name}", "arguments": "{content.parameters}"},
            },
        },
        "content": {"close_pattern": r"\s*(?:<\|eot_id\|>|<\|eom_id\|>)", "content": "text"},
    },
}


#: Where a Mistral assistant turn starts: after the user's ``[/INST]``, or after the
#: results of the tools it called.
_MISTRAL_ANCHORS = ["[/INST]", "[/TOOL_RESULTS]"]


def _mistral(calls: dict[str, Any]) -> dict[str, Any]:
    """A Mistral response template: ``calls`` read as tool calls, text up to ``</s>`` or
    the first ``[TOOL_CALLS]``."""
    text = {"close_pattern": r"\s*(?:</s>|(?=\[TOOL_CALLS\]))", "content": "text"}
    return {
        "defaults": {"role": "assistant"},
        "start_anchor": _MISTRAL_ANCHORS,
        "fields": {"tool_calls": {"content": "json", **calls}, "content": text},
    }


#: Mistral's calls as its v3 chat templates ask for them (Mistral-7B-Instruct-v0.3,
#: Mistral-Nemo, Mistral-Small-3.1): ``[TOOL_CALLS]`` and one JSON list of
#: ``{"name": ..., "arguments": {...}}``, ended by ``</s>``.
MISTRAL_JSON_LIST = _mistral(
    {
        "open_pattern": r"\s*\[TOOL_CALLS\]\s*",
        "close_pattern": r"\s*</s>",
        "transform_each": True,  # each element's keys are the placeholders
        "transform": {
            "type": "function",
            "function": {"name": "{name}", "arguments": "{arguments}"},
        },
    }
)
#: Mistral's calls as its v11+ chat templates ask for them (Mistral-Small-3.2,
#: Magistral, Devstral): ``[TOOL_CALLS]name[ARGS]{...}`` for each call, ended by ``</s>``.
MISTRAL_ARGS = _mistral(
    {
        "open_pattern": r"\s*\[TOOL_CALLS\](?P<name>[^\[\]\s]+)\[ARGS\]",
        "close_pattern": r"\s*(?:</s>|(?=\[TOOL_CALLS\]))",
        "repeats": True,
        "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
    }
)
MISTRAL_TYPES = ("mistral", "mistral3", "ministral", "ministral3")


@dataclass(frozen=True)
class ToolSyntax:
    """A model family's tool-call syntax: a transformers ``response_template``."""

    template: dict[str, Any]
    source: str  # where it came from, for the run's record


@dataclass(frozen=True)
class Reply:
    """An ``"auto"`` answer read back: its text (None when it only calls tools), its
    reasoning when the template separates it, and its calls (name, arguments JSON)."""

    content: str | None
    reasoning: str | None
    calls: tuple[tuple[str, str], ...]


def find_syntax(tok: Any, model_type: str | None) -> ToolSyntax | None:
    """The tokenizer's response template, else transformers serve's for the model type,
    else ours for a Llama 3 chat template."""
    own = getattr(tok, "response_template", None)
    if isinstance(own, dict):
        return ToolSyntax(own, "the tokenizer's response_template")
    if not hasattr(tok, "parse_response") or model_type is None:
        return None
    served = _served(tok, model_type)
    if served is not None:
        return ToolSyntax(served, f"transformers serve's template for model type {model_type!r}")
    template = getattr(tok, "chat_template", None)
    if not isinstance(template, str):
        return None
    if model_type == "llama" and "<|start_header_id|>" in template:
        return ToolSyntax(LLAMA3_JSON, "shoestring's template of Llama 3.1's JSON tool calls")
    if model_type in MISTRAL_TYPES and "[TOOL_CALLS]" in template:
        if "[ARGS]" in template:
            return ToolSyntax(MISTRAL_ARGS, "shoestring's template of Mistral's v11 tool calls")
        return ToolSyntax(MISTRAL_JSON_LIST, "shoestring's template of Mistral's JSON tool calls")
    return None


def _served(tok: Any, model_type: str) -> dict[str, Any] | None:
    try:
        from transformers.cli.serving.utils import get_response_template
    except ImportError:  # moved in a later transformers
        return None
    config: Any = SimpleNamespace(model_type=model_type)  # all it reads of the config
    known = get_response_template(tok, config)
    return known if isinstance(known, dict) else None


def no_syntax(tok: Any, model_type: str | None) -> str:
    """Why ``"auto"`` cannot be read for this model, and what to do instead."""
    if not hasattr(tok, "parse_response"):
        import transformers

        have = f"transformers {transformers.__version__} has no response parser (needs {NEEDS})"
    else:
        kind = f"model type {model_type!r}" if model_type else "a model with no model_type"
        have = f"the tokenizer has no response_template and transformers knows none for {kind}"
    return (
        f"'auto' needs the model's tool-call syntax to tell a call from text: {have}; "
        'add a response_template to tokenizer_config.json, or use tool_choice "required" '
        "or name the function (answers held to the tools' JSON Schemas)"
    )


def read_reply(
    syntax: ToolSyntax,
    tok: Any,
    answer: list[int] | str,
    prompt: list[int] | str,
    tools: tuple[dict[str, Any], ...],
    parallel: bool,
) -> Reply | None:
    """The answer as text and tool calls; None when it makes no call that parses
    (then it is plain text). ``answer`` and ``prompt`` are both token ids or both text
    (text when stop strings cut the answer). One call at most unless ``parallel``."""
    try:
        msg = tok.parse_response(answer, syntax.template, prefix=prompt, tools=list(tools))
        calls = tuple(_call(c) for c in msg.get("tool_calls") or ())
    except (ValueError, KeyError, TypeError):  # a call whose JSON is broken or shapeless
        return None
    if not calls:
        return None
    content = msg.get("content")
    reasoning = msg.get("reasoning_content", msg.get("thinking"))
    return Reply(
        content if isinstance(content, str) and content.strip() else None,
        reasoning if isinstance(reasoning, str) and reasoning.strip() else None,
        calls if parallel else calls[:1],
    )


def _call(parsed: Any) -> tuple[str, str]:
    """(name, arguments as compact JSON) of one parsed call."""
    fn = parsed["function"]
    name, args = fn["name"], fn.get("arguments", {})
    if not isinstance(name, str) or not name:
        raise TypeError("a tool call with no name")
    if isinstance(args, str):
        args = json.loads(args)
    if not isinstance(args, dict):
        raise TypeError("tool call arguments must be a JSON object")
    return name, json.dumps(args, ensure_ascii=False, separators=(",", ":"))
