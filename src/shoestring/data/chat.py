"""Conversations → token ids and labels, through the model's own chat template.

A conversation is rendered once to text with ``tok.apply_chat_template`` and
tokenized once, with character offsets. The loss mask is derived from those
offsets, never by tokenizing pieces of the text again: assistant turn ``i`` spans
the characters between ``render(messages[:i], add_generation_prompt=True)`` and
``render(messages[:i + 1])`` — its content and end-of-turn marker (``<|im_end|>``,
``<|eot_id|>``), without the role header. That needs a *prefix-stable* template
(rendering fewer messages gives a prefix of rendering more); a template that
rewrites earlier turns is refused with a clear error rather than trained wrongly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from shoestring.data.records import IGNORE_INDEX, DataError, Example, LossOn, Record

Messages = Sequence[dict[str, Any]]
Span = tuple[int, int]
_PROBE = "shoestring-end-of-turn-probe"


class ChatSpec(Protocol):
    """What chat rendering needs from a tokenize spec (``TokenizeSpec`` has it)."""

    @property
    def loss_on(self) -> LossOn: ...

    @property
    def chat_template(self) -> str | None: ...


@dataclass(frozen=True)
class RenderedChat:
    """A conversation rendered to text and the character spans that take loss."""

    text: str
    spans: tuple[Span, ...]


# --------------------------------------------------------------------------- templates


def _generation_tag_extension() -> type[Any]:
    """Jinja extension accepting HF's ``{% generation %} ... {% endgeneration %}`` tags."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return GenerationTag


def load_template(path: str) -> str:
    """Read a Jinja chat template file (``data.chat_template``) and check that it parses."""
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - transformers brings jinja2
        raise DataError(f"{path}: reading a chat template needs jinja2 (pip install jinja2)") from e
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{path}: no such file (data.chat_template)")
    source = p.read_text(encoding="utf-8")
    env = ImmutableSandboxedEnvironment(
        extensions=["jinja2.ext.loopcontrols", _generation_tag_extension()]
    )
    try:
        env.parse(source)
    except jinja2.TemplateSyntaxError as e:
        raise DataError(
            f"{path}:{e.lineno}: data.chat_template is not a valid Jinja template: {e.message}"
        ) from e
    return source


# --------------------------------------------------------------------------- rendering


def _tools_arg(tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    return list(tools) if tools else None


def _render_many(
    tok: Any,
    conversations: list[list[dict[str, Any]]],
    tools: list[dict[str, Any]] | None,
    template: str | None,
    generation_prompt: bool,
) -> list[str]:
    """Render several (non-empty) conversations with one ``apply_chat_template`` call."""
    if not conversations:
        return []
    rendered = tok.apply_chat_template(
        conversations,
        tools=tools,
        chat_template=template,
        add_generation_prompt=generation_prompt,
        tokenize=False,
    )
    return [str(text) for text in rendered]


def _generation_header(tok: Any, template: str | None, tools: Any) -> str:
    """What the generation prompt adds after a user turn (``<|im_start|>assistant\\n``)."""
    probe = [[{"role": "user", "content": _PROBE}]]
    bare = _render_many(tok, probe, tools, template, False)[0]
    prompted = _render_many(tok, probe, tools, template, True)[0]
    return prompted[len(bare) :] if prompted.startswith(bare) else ""


def _opening_turn_start(r: Record, tok: Any, template: str | None, tools: Any) -> str:
    """The text before an assistant message that opens the conversation, up to the end of
    its role header (``apply_chat_template`` renders no empty conversation to cut at)."""
    opening = _render_many(tok, [list(r.messages or ())[:1]], tools, template, False)[0]
    header = _generation_header(tok, template, tools)
    at = opening.find(header) if header else -1
    if at < 0:
        raise DataError(
            f"{r.source}: message 1: the conversation opens with an assistant message and "
            "its role header cannot be told from its content under this chat template"
        )
    return opening[: at + len(header)]


def _turn_starts(
    r: Record, tok: Any, template: str | None, turns: Sequence[int], tools: Any
) -> list[str]:
    """``render(messages[:i], add_generation_prompt=True)`` for each assistant turn ``i``."""
    messages = list(r.messages or ())
    later = [i for i in turns if i > 0]
    starts = iter(_render_many(tok, [messages[:i] for i in later], tools, template, True))
    return [next(starts) if i > 0 else _opening_turn_start(r, tok, template, tools) for i in turns]


def _not_prefix_stable(r: Record, message: int, what: str) -> DataError:
    return DataError(
        f"{r.source}: message {message}: chat template is not prefix-stable: {what}, so the "
        "assistant turns cannot be located in the rendered conversation (templates that "
        "rewrite earlier turns, e.g. drop their reasoning, do this); use a prefix-stable "
        "template (data.chat_template FILE) or data.loss_on=all"
    )


def _turn_ends(
    r: Record, tok: Any, template: str | None, turns: Sequence[int], tools: Any
) -> tuple[list[str], str]:
    """``render(messages[:i + 1])`` for each assistant turn ``i``, and the whole
    conversation (the last of them when an assistant message ends it)."""
    messages = list(r.messages or ())
    cuts = [i + 1 for i in turns]
    if cuts[-1] != len(messages):
        cuts.append(len(messages))
    rendered = _render_many(tok, [messages[:n] for n in cuts], tools, template, False)
    return rendered[: len(turns)], rendered[-1]


def _assistant_spans(
    r: Record, tok: Any, template: str | None, turns: Sequence[int]
) -> RenderedChat:
    tools = _tools_arg(r.tools)
    ends, full = _turn_ends(r, tok, template, turns, tools)
    starts = _turn_starts(r, tok, template, turns, tools)
    spans: list[Span] = []
    for i, start, end in zip(turns, starts, ends, strict=True):
        if not end.startswith(start):
            raise _not_prefix_stable(
                r,
                i + 1,
                f"messages 1-{i} with the generation prompt do not render as a prefix "
                f"of messages 1-{i + 1}",
            )
        if not full.startswith(end):
            raise _not_prefix_stable(
                r,
                i + 1,
                f"messages 1-{i + 1} do not render as a prefix of the whole conversation",
            )
        spans.append((len(start), len(end)))
    return RenderedChat(full, tuple(spans))


def _render_error(r: Record, e: Exception) -> DataError:
    return DataError(f"{r.source}: the chat template failed on this conversation: {e}")


def _assistant_turns(r: Record, loss_on: LossOn) -> list[int]:
    turns = [i for i, m in enumerate(r.messages or ()) if m.get("role") == "assistant"]
    if not turns:
        raise DataError(
            f"{r.source}: nothing to learn: the conversation has no assistant message "
            f"(data.loss_on={loss_on})"
        )
    return turns[-1:] if loss_on == "last_assistant" else turns


def render_chat(r: Record, tok: Any, spec: ChatSpec) -> RenderedChat:
    """Render a conversation record and find the character spans that take loss."""
    messages = list(r.messages or ())
    if not messages:
        raise DataError(f"{r.source}: 'messages' is empty")
    try:
        if spec.loss_on == "all":
            full = _render_many(tok, [messages], _tools_arg(r.tools), spec.chat_template, False)
            return RenderedChat(full[0], ((0, len(full[0])),))
        turns = _assistant_turns(r, spec.loss_on)
        return _assistant_spans(r, tok, spec.chat_template, turns)
    except DataError:
        raise
    except Exception as e:  # jinja2 errors, raise_exception() in templates, bad tools
        raise _render_error(r, e) from e


# --------------------------------------------------------------------------- labels


def label_tokens(ids: Sequence[int], offsets: Sequence[Span], spans: Sequence[Span]) -> list[int]:
    """Labels: a token keeps its id when its characters lie inside a span. The first token
    never enters the loss (labels are shifted by one) and is always ignored."""
    labels = [IGNORE_INDEX] * len(ids)
    span = 0
    for t, (start, end) in enumerate(offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if start >= spans[span][0] and end <= spans[span][1]:
            labels[t] = ids[t]
    if labels:
        labels[0] = IGNORE_INDEX
    return labels


def require_fast(tok: Any) -> None:
    if not getattr(tok, "is_fast", False):
        name = getattr(tok, "name_or_path", "") or type(tok).__name__
        raise DataError(
            f"tokenizer {name}: training on conversations needs a fast (Rust) tokenizer, "
            "whose character offsets locate the assistant turns; this one is a slow "
            "(Python) tokenizer — use a model that ships tokenizer.json"
        )


def encode_with_offsets(tok: Any, texts: list[str]) -> tuple[list[list[int]], list[list[Span]]]:
    """Tokenize rendered conversations (their special tokens are in the text) with offsets."""
    require_fast(tok)
    enc = tok(
        texts,
        add_special_tokens=False,
        return_offsets_mapping=True,
        return_attention_mask=False,
        verbose=False,
    )
    return list(enc["input_ids"]), list(enc["offset_mapping"])


def chat_example(r: Record, tok: Any, spec: ChatSpec) -> Example:
    """One conversation → ids and labels (untruncated; ``tokenize`` truncates)."""
    require_fast(tok)
    rendered = render_chat(r, tok, spec)
    ids, offsets = encode_with_offsets(tok, [rendered.text])
    return Example(ids[0], label_tokens(ids[0], offsets[0], rendered.spans))


# --------------------------------------------------------------------------- inference


def prompt_ids(
    messages: Sequence[dict[str, Any]],
    tok: Any,
    template: str | None = None,
    tools: Sequence[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of a conversation followed by the assistant's generation prompt, tokenized
    as training tokenizes it (render, then encode the text once)."""
    text = _render_many(tok, [list(messages)], _tools_arg(tools), template, True)[0]
    return list(tok(text, add_special_tokens=False, verbose=False)["input_ids"])


def end_of_turn_ids(tok: Any, template: str | None = None) -> list[int]:
    """Ids that end an assistant turn (``<|im_end|>``, ``<|eot_id|>``, ...) and EOS: the
    special tokens the template writes right after an assistant message's content."""
    eos = getattr(tok, "eos_token_id", None)
    found: list[int] = []
    if template is not None or getattr(tok, "chat_template", None):
        convo = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PROBE}]
        text = _render_many(tok, [convo], None, template, False)[0]
        at = text.rfind(_PROBE)
        tail = text[at + len(_PROBE) :] if at >= 0 else ""
        special = set(getattr(tok, "added_tokens_decoder", {}) or {}) | set(tok.all_special_ids)
        tail_ids = tok(tail, add_special_tokens=False, verbose=False)["input_ids"]
        found = [t for t in tail_ids if t in special]
    if eos is not None:
        found.append(int(eos))
    return list(dict.fromkeys(found))
