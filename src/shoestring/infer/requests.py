"""OpenAI batch requests as job work, and their results as batch output lines.

A line that cannot be answered — malformed (:mod:`shoestring.infer.batchapi`), a
conversation the chat template cannot render, a prompt with no tokens, a prompt
plus ``max_tokens`` longer than the model's context, or a ``response_format``
schema the grammar compiler rejects — becomes one error
line in its place; every other line is answered, so one bad request never fails
the job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from shoestring.data.chat import prompt_ids
from shoestring.data.records import DataError
from shoestring.data.specials import plain_prompt_ids
from shoestring.infer.batchapi import Answer, LineError, Request, TokenLogprob
from shoestring.infer.batchapi import answer_line as answer_json
from shoestring.infer.batchapi import error_line as error_json
from shoestring.infer.decode import Generated
from shoestring.infer.sampling import StopStrings
from shoestring.infer.structured import Grammars
from shoestring.infer.toolsyntax import Reply, ToolSyntax, read_reply

Item = Request | LineError


@dataclass(frozen=True)
class Answering:
    """What every output line of a job shares: ids derive from ``job_id``; ``created``
    is fixed per run (``SOURCE_DATE_EPOCH`` when set), so a resumed job writes the
    bytes an uninterrupted one writes."""

    job_id: str
    model: str
    created: int


def request_ids(
    item: Item,
    tok: Any,
    template: str | None,
    context: int | None,
    path: str,
    vocab_size: int | None = None,
) -> tuple[Item, list[int]]:
    """The request's prompt tokens, or the error line it becomes (with no tokens)."""
    if isinstance(item, LineError):
        return item, []
    try:
        if item.messages is not None:
            ids = prompt_ids(item.messages, tok, template, item.tools)
        elif item.prompt_ids is not None:
            ids = list(item.prompt_ids)
        else:
            ids = plain_prompt_ids(tok, item.prompt)
    except (DataError, ValueError, TypeError) as e:  # jinja raises TemplateError(ValueError)
        why = f"the chat template cannot render it: {e}"
        return _refused(item, path, "body.messages", why), []
    if not ids:
        return _refused(item, path, "body", "the prompt has no tokens"), []
    if vocab_size is not None and max(ids) >= vocab_size:
        why = f"token id {max(ids)} is beyond the model's vocabulary of {vocab_size}"
        return _refused(item, path, "body.prompt", why), []
    need = len(ids) + item.sampling.max_tokens
    if context is not None and need > context:
        return _refused(
            item,
            path,
            "body.max_tokens",
            f"{len(ids)} prompt tokens + max_tokens {item.sampling.max_tokens} exceed "
            f"the model's context of {context} tokens",
        ), []
    return item, ids


def format_grammar(item: Item, grammars: Grammars | None, path: str) -> tuple[Item, str | None]:
    """The request's response format compiled to a grammar (None: free text), or the
    error line it becomes when the schema cannot be used."""
    if isinstance(item, LineError) or item.sampling.response_format is None:
        return item, None
    assert grammars is not None, "the work compiles formats when a request has one"
    fmt = item.sampling.response_format
    try:
        return item, grammars.compile(fmt)
    except ValueError as e:
        param = "body.response_format" + (
            ".json_schema.schema" if fmt.kind == "json_schema" else ""
        )
        return _refused(item, path, param, f"the schema cannot be used: {e}"), None


def syntax_known(item: Item, syntax: ToolSyntax | None, missing: str, path: str) -> Item:
    """The request, or the error line it becomes when its ``tool_choice`` is ``"auto"``
    and the model's tool-call syntax is unknown (``missing`` says why)."""
    if isinstance(item, LineError) or syntax is not None:
        return item
    if item.tool_use is None or item.tool_use.mode != "auto":
        return item
    return _refused(item, path, "body.tool_choice", missing, "unsupported")


def _refused(
    req: Request, path: str, param: str, why: str, code: str = "invalid_request"
) -> LineError:
    where = f"{path}:{req.line}: {param}"
    return LineError(req.line, req.custom_id, code, param, f"{where}: {why}")


def answer_lines(
    items: list[Item], prompts: list[list[int]], results: list[list[Generated]], tok: Any,
    meta: Answering, syntax: ToolSyntax | None = None,
) -> list[str]:  # fmt: skip
    """One output line per item (``prompts``: per item, its prompt tokens; ``results``:
    per item, its one generation or none; ``syntax``: how ``"auto"`` answers call tools)."""
    lines = []
    for item, prompt, res in zip(items, prompts, results):
        if isinstance(item, LineError):
            doc = error_json(item, job_id=meta.job_id)
        else:
            ans = _answer(item, prompt, res[0], tok, syntax)
            doc = answer_json(item, ans, job_id=meta.job_id, model=meta.model, created=meta.created)
        lines.append(json.dumps(doc, ensure_ascii=False))
    return lines


def _answer(
    req: Request, prompt: list[int], g: Generated, tok: Any, syntax: ToolSyntax | None
) -> Answer:
    stops = req.sampling.stop
    text = (
        StopStrings(tok, stops).text(g.tokens)
        if stops
        else tok.decode(g.tokens, skip_special_tokens=True)
    )
    reply = _reply(req, prompt, g, text, tok, syntax) if g.finish != "length" else None
    return Answer(
        text=text if reply is None else reply.content or "",
        finish_reason="length" if g.finish == "length" else "tool_calls" if reply else "stop",
        prompt_tokens=len(prompt),
        completion_tokens=len(g.tokens),
        logprobs=_logprobs(g, tok) if req.sampling.logprobs else None,
        tool_calls=reply.calls if reply else (),
        reasoning=reply.reasoning if reply else None,
    )


def _reply(
    req: Request, prompt: list[int], g: Generated, text: str, tok: Any, syntax: ToolSyntax | None
) -> Reply | None:
    """The tool calls a finished answer makes (None: it answers in text)."""
    use = req.tool_use
    if use is None:
        return None
    if use.mode != "auto":
        calls = use.calls(text)
        return Reply(None, None, calls) if calls else None
    assert syntax is not None and req.tools is not None, "auto lines without a syntax are refused"
    if req.sampling.stop:  # the stop strings cut the text: read the text, after the prompt's
        return read_reply(syntax, tok, text, tok.decode(prompt), req.tools, use.parallel)
    return read_reply(syntax, tok, g.tokens, prompt, req.tools, use.parallel)


def _logprobs(g: Generated, tok: Any) -> tuple[TokenLogprob, ...]:
    """Each generated token as text, bytes and log probability, with its alternatives."""

    def entry(t: int, lp: float) -> tuple[str, float, list[int]]:
        text = tok.decode([t])
        return text, lp, list(text.encode())

    tops = g.top or [[] for _ in g.tokens]
    return tuple(
        TokenLogprob(*entry(t, lp), top=tuple(entry(a, b) for a, b in alts))
        for t, lp, alts in zip(g.tokens, g.logprobs, tops)
    )
