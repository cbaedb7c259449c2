"""Conversations → token ids and labels, through the model's own chat template.

A conversation is rendered once to text with ``tok.apply_chat_template`` and
tokenized once, with character offsets. The loss mask is derived from those
offsets, never by tokenizing pieces of the text again: assistant turn ``i`` spans
the characters between ``render(messages[:i], add_generation_prompt=True)`` and
``render(messages[:i + 1])`` — its content and end-of-turn marker (``<|im_end|>``,
``<|eot_id|>``), without the role header, and without whitespace the template writes
after the marker to separate turns (ChatML's newline). That needs a *prefix-stable* template
(rendering fewer messages gives a prefix of rendering more); a template that
rewrites earlier turns is refused with a clear error rather than trained wrongly.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from shoestring.data.records import IGNORE_INDEX, DataError, Example, LossOn, Record

#: How assistant spans are found; part of the tokenized cache's key (2: a turn's span
#: ends at its end-of-turn token, without the whitespace after it).
CHAT_SPANS = 2

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
    try:
        source = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = p.read_bytes()[: e.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: data.chat_template is not UTF-8 text ({e.reason})") from e
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


def _not_prefix_stable(r: Record, message: int, what: str) -> DataError:
    return DataError(
        f"{r.source}: message {message}: chat template is not prefix-stable: {what}, so the "
        "assistant turns cannot be located in the rendered conversation (templates that "
        "rewrite earlier turns, e.g. drop their reasoning, do this); use a prefix-stable "
        "template (data.chat_template FILE) or data.loss_on=all"
    )


def special_texts(tok: Any) -> tuple[str, ...]:
    """The text of every special and added token (``<|im_end|>``, ``<|eot_id|>``, ...)."""
    added = getattr(tok, "added_tokens_decoder", None) or {}
    texts = {str(t) for t in getattr(tok, "all_special_tokens", ())}
    texts |= {str(getattr(t, "content", t)) for t in added.values()}
    return tuple(sorted(t for t in texts if t.strip()))


def _end_at_marker(full: str, span: Span, markers: tuple[str, ...]) -> Span:
    """A turn's span ends at its end-of-turn token: whitespace the template writes after
    it (ChatML's newline after ``<|im_end|>``) separates turns and takes no loss, as in a
    ``{% generation %}`` mask. A turn that does not end in a special token is kept whole."""
    start, end = span
    kept = full[start:end].rstrip()
    if len(kept) < end - start and kept.endswith(markers):
        return start, start + len(kept)
    return span


def _spans(
    r: Record,
    turns: Sequence[int],
    starts: Sequence[str],
    ends: Sequence[str],
    full: str,
    markers: tuple[str, ...],
) -> RenderedChat:
    """Assistant turn ``i`` spans ``len(starts[i])`` to ``len(ends[i])`` (to its end-of-turn
    token), when the renders are prefixes of each other (else the template is not
    prefix-stable)."""
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
        spans.append(_end_at_marker(full, (len(start), len(end)), markers))
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
    """Render a conversation record and find the character spans that take loss, by its
    prefix renders alone (the reference :func:`render_chats` equals, record by record)."""
    try:
        return _render_group(tok, spec, [_Renders.of(r, spec.loss_on)], None)[0]
    except DataError:
        raise
    except Exception as e:  # jinja2 errors, raise_exception() in templates, bad tools
        raise _render_error(r, e) from e


@dataclass(frozen=True)
class _Renders:
    """The prefixes one conversation needs rendered: ``cuts`` without the generation
    prompt (each assistant turn's end, then the whole), ``opens`` with it (each turn's
    start); the renders of many conversations are made in one call per kind."""

    record: Record
    turns: tuple[int, ...]  # assistant turns that take loss; () for data.loss_on=all
    cuts: tuple[int, ...]
    opens: tuple[int, ...]

    @classmethod
    def of(cls, r: Record, loss_on: LossOn) -> _Renders:
        n = len(r.messages or ())
        if not n:
            raise DataError(f"{r.source}: 'messages' is empty")
        if loss_on == "all":
            return cls(r, (), (n,), ())
        turns = tuple(_assistant_turns(r, loss_on))
        cuts = tuple(i + 1 for i in turns) + (() if turns[-1] + 1 == n else (n,))
        return cls(r, turns, cuts, tuple(i for i in turns if i > 0))

    def chat(
        self,
        tok: Any,
        template: str | None,
        cut: list[str],
        opened: list[str],
        specials: tuple[str, ...],
    ) -> RenderedChat:
        full = cut[-1]
        if not self.turns:
            return RenderedChat(full, ((0, len(full)),))
        later = iter(opened)
        tools = _tools_arg(self.record.tools)
        starts = [
            next(later) if i > 0 else _opening_turn_start(self.record, tok, template, tools)
            for i in self.turns
        ]
        ends = cut[: len(self.turns)]
        return _spans(self.record, self.turns, starts, ends, full, specials)


@dataclass(frozen=True)
class _TurnMarkers:
    """What the template writes around an assistant message's content: the role header
    (the generation prompt) and the end of turn, found by rendering a probe. Where a
    rendered conversation holds ``header + content + end`` for each assistant message, in
    order, those are the spans the prefix renders would find — with one render instead
    of two per turn. Conversations where they are not found take the prefix renders."""

    header: str
    end: str
    markers: tuple[str, ...]  # the special tokens' texts: a span ends at one of them

    @classmethod
    def probe(cls, tok: Any, template: str | None) -> _TurnMarkers | None:
        user = [{"role": "user", "content": _PROBE + "-user"}]
        bare, prompted = (_render_many(tok, [user], None, template, g)[0] for g in (False, True))
        whole = _render_many(
            tok, [[*user, {"role": "assistant", "content": _PROBE}]], None, template, False
        )[0]
        header = prompted[len(bare) :] if prompted.startswith(bare) else ""
        if not header or not whole.startswith(prompted + _PROBE):
            return None
        end = whole[len(prompted) + len(_PROBE) :]
        return cls(header, end, special_texts(tok)) if end else None

    def spans(self, plan: _Renders, full: str) -> RenderedChat | None:
        if not plan.turns:
            return RenderedChat(full, ((0, len(full)),))
        located: dict[int, Span] = {}
        at = 0
        for i, m in enumerate(plan.record.messages or ()):
            if m.get("role") != "assistant":
                continue
            content = m.get("content")
            if set(m) != {"role", "content"} or not isinstance(content, str) or not content:
                return None  # tool calls, reasoning, empty turns: the template decides
            needle = self.header + content + self.end
            found = full.find(needle, at)
            if found < 0:
                return None
            at = found + len(needle)
            located[i] = _end_at_marker(full, (found + len(self.header), at), self.markers)
        return RenderedChat(full, tuple(located[i] for i in plan.turns))


def _render_group(
    tok: Any, spec: ChatSpec, group: list[_Renders], markers: _TurnMarkers | None
) -> list[RenderedChat]:
    """Conversations sharing one ``tools`` list: the whole conversations in one
    ``apply_chat_template`` call; where the markers do not locate the turns, their prefixes
    in two more calls."""
    tools = _tools_arg(group[0].record.tools)
    template = spec.chat_template
    messages = [list(g.record.messages or ()) for g in group]
    fulls = _render_many(tok, messages, tools, template, False)
    found = [markers.spans(g, f) if markers else None for g, f in zip(group, fulls, strict=True)]
    slow = [k for k, chat in enumerate(found) if chat is None]
    cut = _render_many(
        tok, [messages[k][:n] for k in slow for n in group[k].cuts[:-1]], tools, template, False
    )
    opened = _render_many(
        tok, [messages[k][:i] for k in slow for i in group[k].opens], tools, template, True
    )
    at_cut = at_open = 0
    specials = markers.markers if markers else special_texts(tok)
    for k in slow:
        g = group[k]
        c, o = len(g.cuts) - 1, len(g.opens)
        ends = [*cut[at_cut : at_cut + c], fulls[k]]
        found[k] = g.chat(tok, template, ends, opened[at_open : at_open + o], specials)
        at_cut, at_open = at_cut + c, at_open + o
    return [chat for chat in found if chat is not None]


def render_chats(records: Sequence[Record], tok: Any, spec: ChatSpec) -> list[RenderedChat]:
    """:func:`render_chat` for many records, equal to it record by record, with far fewer
    template calls (their per-call cost dominates short conversations): all the records'
    renders of a kind in one call, and one render per conversation where the template's
    turn markers locate its assistant turns. If a call fails, each record is rendered
    alone to name the culprit."""
    plans = [_Renders.of(r, spec.loss_on) for r in records]
    groups: dict[str, list[int]] = {}
    for k, p in enumerate(plans):
        groups.setdefault(json.dumps(p.record.tools, sort_keys=True, default=str), []).append(k)
    out: list[RenderedChat | None] = [None] * len(records)
    try:
        markers = _TurnMarkers.probe(tok, spec.chat_template)
        for members in groups.values():
            rendered = _render_group(tok, spec, [plans[k] for k in members], markers)
            for k, chat in zip(members, rendered, strict=True):
                out[k] = chat
    except DataError:
        raise
    except Exception:  # jinja2 errors, raise_exception() in templates, bad tools
        return [render_chat(r, tok, spec) for r in records]
    return [c for c in out if c is not None]


# --------------------------------------------------------------------------- labels


def label_tokens(ids: Sequence[int], offsets: np.ndarray, spans: Sequence[Span]) -> list[int]:
    """Labels: a token keeps its id when its characters (``offsets``, one ``(start, end)``
    row per token) lie inside a span. The first token never enters the loss (labels are
    shifted by one) and is always ignored."""
    n = len(ids)
    if n == 0 or not spans:
        return [IGNORE_INDEX] * n
    bounds = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    starts, ends = offsets[:, 0], offsets[:, 1]
    # the first span ending after the token starts; the token is in it if it fits inside
    k = np.minimum(np.searchsorted(bounds[:, 1], starts, side="right"), len(bounds) - 1)
    inside = (starts >= bounds[k, 0]) & (ends <= bounds[k, 1])
    inside[0] = False
    labels: list[int] = np.where(inside, np.asarray(ids, dtype=np.int64), IGNORE_INDEX).tolist()
    return labels


def require_fast(tok: Any) -> None:
    if not getattr(tok, "is_fast", False):
        name = getattr(tok, "name_or_path", "") or type(tok).__name__
        raise DataError(
            f"tokenizer {name}: training on conversations needs a fast (Rust) tokenizer, "
            "whose character offsets locate the assistant turns; this one is a slow "
            "(Python) tokenizer — use a model that ships tokenizer.json"
        )


@dataclass(frozen=True)
class Encoded:
    """Rendered conversations tokenized: ids per text and every token's character span."""

    ids: list[list[int]]
    offsets: np.ndarray  # (tokens of all texts, 2)
    rows: np.ndarray  # text i's tokens are offsets[rows[i] : rows[i + 1]]

    def __iter__(self) -> Iterator[tuple[list[int], np.ndarray]]:
        for i, ids in enumerate(self.ids):
            yield ids, self.offsets[self.rows[i] : self.rows[i + 1]]


def encode_with_offsets(tok: Any, texts: list[str]) -> Encoded:
    """Tokenize rendered conversations (their special tokens are in the text) with offsets,
    through the Rust tokenizer directly (what ``tok(texts, add_special_tokens=False)``
    runs, without building Python structures the labels do not need)."""
    require_fast(tok)
    encodings = tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    ids = [e.ids for e in encodings]
    lengths = [len(x) for x in ids]
    rows = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(lengths, out=rows[1:])
    pairs = itertools.chain.from_iterable(
        itertools.chain.from_iterable(e.offsets for e in encodings)
    )
    flat = np.fromiter(pairs, dtype=np.int64, count=2 * int(rows[-1]))
    return Encoded(ids, flat.reshape(-1, 2), rows)


def chat_example(r: Record, tok: Any, spec: ChatSpec) -> Example:
    """One conversation → ids and labels (untruncated; ``tokenize`` truncates)."""
    require_fast(tok)
    rendered = render_chat(r, tok, spec)
    ids, offsets = next(iter(encode_with_offsets(tok, [rendered.text])))
    return Example(ids, label_tokens(ids, offsets, rendered.spans))


# --------------------------------------------------------------------------- inference


def prompt_ids(
    messages: Sequence[dict[str, Any]],
    tok: Any,
    template: str | None = None,
    tools: Sequence[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of a conversation followed by the assistant's generation prompt, tokenized
    as training tokenizes it (render, then encode the text once)."""
    text = prompt_text(messages, tok, template, tools)
    return list(tok(text, add_special_tokens=False, verbose=False)["input_ids"])


def prompt_text(
    messages: Sequence[dict[str, Any]],
    tok: Any,
    template: str | None = None,
    tools: Sequence[dict[str, Any]] | None = None,
) -> str:
    """A conversation rendered by the chat template, with the assistant's generation
    prompt: the text :func:`prompt_ids` encodes."""
    return str(_render_many(tok, [list(messages)], _tools_arg(tools), template, True)[0])


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
