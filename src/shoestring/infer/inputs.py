"""Reading and checking the input JSONL before any expensive work."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoestring.config import ConfigError
from shoestring.data.formats import parse_record as parse_data_record
from shoestring.data.records import DataError
from shoestring.infer.batchapi import LineError, Request, is_batch_file, read_batch


@dataclass(frozen=True)
class InputRecord:
    line: int  # 1-based line number in the input
    prompt: str  # "" for a conversation: ``messages`` is rendered with the chat template
    completion: str | None = None
    choices: tuple[str, ...] | None = None
    id: Any = None
    messages: tuple[dict[str, Any], ...] | None = None
    tools: tuple[dict[str, Any], ...] | None = None
    # Token ids given as they are, no specials added (lm-eval splits a pair's tokens
    # itself): "prompt_ids" in place of the prompt, "completion_ids" of the completion.
    prompt_ids: tuple[int, ...] | None = None
    completion_ids: tuple[int, ...] | None = None

    @property
    def single(self) -> bool:
        """Score mode: one completion (not a list of choices)."""
        return self.completion is not None or self.completion_ids is not None


def _prompt(obj: dict[str, Any], where: str) -> tuple[str, Any, Any]:
    """The prompt text, or the conversation (OpenAI ``messages`` [+ ``tools``]) to render."""
    if "prompt_ids" in obj:
        return "", None, None
    if "messages" in obj:
        try:
            chat = parse_data_record(
                {k: obj[k] for k in ("messages", "tools") if k in obj}, where, "messages"
            )
        except DataError as e:
            raise ConfigError(str(e)) from None
        return "", chat.messages, chat.tools
    prompt = obj.get("prompt")
    if not isinstance(prompt, str):
        raise ConfigError(f'{where}: needs a string "prompt" or a "messages" list')
    return prompt, None, None


def _ids(obj: dict[str, Any], key: str, where: str) -> tuple[int, ...] | None:
    """A ``*_ids`` field: a non-empty list of token ids (non-negative integers)."""
    if key not in obj:
        return None
    ids = obj[key]
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
    ):
        raise ConfigError(f'{where}: "{key}" must be a non-empty list of token ids (integers >= 0)')
    return tuple(ids)


def _scored_fields(obj: dict[str, Any], where: str) -> None:
    """A score line has exactly one of "completion", "completion_ids", "choices"."""
    given = [k for k in ("completion", "completion_ids", "choices") if obj.get(k) is not None]
    if len(given) != 1:
        raise ConfigError(
            f'{where}: score mode needs exactly one of "completion" (a string), '
            '"completion_ids" (token ids) or "choices" (a list of strings)'
        )
    completion, choices = obj.get("completion"), obj.get("choices")
    if completion is not None and (not isinstance(completion, str) or not completion):
        raise ConfigError(f'{where}: "completion" must be a non-empty string')
    if choices is not None and (
        not isinstance(choices, list)
        or not choices
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise ConfigError(f'{where}: "choices" must be a non-empty list of non-empty strings')


@dataclass(frozen=True)
class Input:
    """The input file, read: an OpenAI batch file's requests (``items``, bad lines as
    :class:`LineError`), or else shoestring's own ``records``."""

    sha256: str
    records: list[InputRecord] | None = None
    items: list[Request | LineError] | None = None


def read_input(path: Path, mode: str, default_max_tokens: int) -> Input:
    """``path`` read as an OpenAI batch file when its lines are requests (``custom_id``,
    ``url``, ``body``), else as ``{"prompt"}``/``{"messages"}`` lines."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"io.input: cannot read {path}: {e.strerror}") from e
    sha = hashlib.sha256(data).hexdigest()
    if not is_batch_file(_objects(data)):
        return Input(sha, records=read_inputs(path, mode, data))
    if mode != "generate":
        raise ConfigError(
            f"io.input: {path} is an OpenAI batch file; those are answered with "
            '--mode generate (score mode reads {"prompt", "completion"} lines)'
        )
    items = read_batch(data, str(path), default_max_tokens)
    if not items:
        raise ConfigError(f"io.input: {path} has no records")
    return Input(sha, items=items)


def _objects(data: bytes, most: int = 100) -> Iterator[Any]:
    """The JSON values of the first ``most`` lines that parse."""
    for raw in data.split(b"\n")[: most * 2]:
        if raw.strip():
            try:
                yield json.loads(raw)
            except ValueError:
                continue


def read_inputs(path: Path, mode: str, data: bytes) -> list[InputRecord]:
    """Every record of ``data`` (the bytes of ``path``); errors name ``path:line``."""
    records = []
    for n, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{where}: not valid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        prompt, messages, tools = _prompt(obj, where)
        completion, choices = obj.get("completion"), obj.get("choices")
        if mode == "score":
            _scored_fields(obj, where)
        elif "completion_ids" in obj:
            raise ConfigError(f'{where}: "completion_ids" is scored: --mode score')
        records.append(
            InputRecord(
                n,
                prompt,
                completion,
                tuple(choices) if choices is not None else None,
                obj.get("id"),
                messages,
                tools,
                _ids(obj, "prompt_ids", where),
                _ids(obj, "completion_ids", where),
            )
        )
    if not records:
        raise ConfigError(f"io.input: {path} has no records")
    return records
