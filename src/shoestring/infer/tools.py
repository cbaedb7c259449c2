"""Function calling in OpenAI batch files: ``tools`` with a ``tool_choice``, answered
as ``tool_calls``.

The tools are rendered into the prompt by the chat template, as for training. When
the ``tool_choice`` makes the model call one (``"required"``, or a function named),
the answer is held to JSON (:mod:`shoestring.infer.structured`), as vLLM does for
these two choices:

* a named function: the function's ``parameters`` schema; the answer is that call's
  ``arguments``;
* ``"required"``: an array of ``{"name", "arguments"}`` objects, each name one of the
  tools' and its arguments that tool's ``parameters`` (one item at most when
  ``parallel_tool_calls`` is false).

``"none"`` renders the tools and answers in text. ``"auto"`` (the default when tools
are given) lets the model choose: its answer is generated freely and read back in
the model family's own tool-call syntax (:mod:`shoestring.infer.toolsyntax`).
Imports no torch: the batch-file parser uses it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from shoestring.infer.sampleparams import ResponseFormat

#: A tool_choice that calls tools: one named function, any of the tools (held to
#: JSON), or the model's choice (read back in its own syntax).
ToolMode = Literal["named", "required", "auto"]
#: A function's ``parameters`` when it gives none: an object with no fields.
NO_PARAMETERS = '{"type": "object", "properties": {}}'


@dataclass(frozen=True)
class Function:
    name: str
    parameters: str  # its JSON Schema, as JSON text (the file's key order)


@dataclass(frozen=True)
class ToolUse:
    """How a request must call its tools: which functions, one call or several."""

    mode: ToolMode
    functions: tuple[Function, ...]  # named: the one named
    parallel: bool = True

    def response_format(self) -> ResponseFormat | None:
        """What the answer is held to (the module docstring); None: nothing ("auto")."""
        if self.mode == "auto":
            return None
        if self.mode == "named":
            f = self.functions[0]
            return ResponseFormat("json_schema", f.parameters, f"tool:{f.name}")
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": f.name}, "arguments": json.loads(f.parameters)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in self.functions
        ]
        items: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {"type": "array", "items": items, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return ResponseFormat("json_schema", json.dumps(schema), "tool_calls")

    def calls(self, text: str) -> tuple[tuple[str, str], ...] | None:
        """(name, arguments as JSON text) of each call a held answer makes; None when
        the answer is not complete JSON (cut by its length limit)."""
        assert self.mode != "auto", "an auto answer is read in the model's syntax"
        try:
            doc = json.loads(text)
        except ValueError:
            return None
        if self.mode == "named":
            return ((self.functions[0].name, text),)
        compact = (",", ":")
        return tuple(
            (c["name"], json.dumps(c["arguments"], ensure_ascii=False, separators=compact))
            for c in doc
        )
