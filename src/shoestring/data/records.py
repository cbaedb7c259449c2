"""The types every data module agrees on: records (parsed, not tokenized) and examples."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

IGNORE_INDEX = -100

#: ``data.format``: ``auto`` detects per file from the first record's keys.
Format = Literal[
    "auto", "text", "prompt_completion", "messages", "alpaca", "sharegpt", "preference", "prompt"
]
#: ``data.loss_on`` for conversations: every token, every assistant turn, or the last one.
LossOn = Literal["all", "assistant", "last_assistant"]
#: ``data.truncate``: keep the start, keep the end, or drop samples over ``max_length``.
Truncate = Literal["right", "left", "drop"]
RecordKind = Literal["text", "pair", "chat"]


class DataError(ValueError):
    """Bad training data; the message names the file and line (or row) and the field."""


@dataclass(frozen=True)
class Record:
    """One training sample before tokenization. Exactly one shape is set:
    ``text``; ``prompt`` + ``completion``; or ``messages`` (OpenAI-style dicts with
    ``role`` and ``content``, optionally ``tool_calls``; ``tools`` optional)."""

    source: str  # "file.jsonl:12", "data.parquet:row 7", "org/name[train]:row 3"
    text: str | None = None
    prompt: str | None = None
    completion: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    tools: tuple[dict[str, Any], ...] | None = None
    #: A preference record: this record is the chosen answer, ``rejected`` the rejected
    #: one, both after the same prompt (``prompt``, or ``messages[:answer_start]``).
    rejected: Record | None = None
    answer_start: int = 0
    #: A prompt record (``train.objective grpo``): its other fields, handed to the reward
    #: functions as keyword columns. The prompt is ``prompt`` or ``messages``; no answer.
    columns: dict[str, Any] | None = None

    @property
    def is_prompt(self) -> bool:
        return self.columns is not None

    @property
    def kind(self) -> RecordKind:
        if self.messages is not None:
            return "chat"
        return "text" if self.text is not None else "pair"

    @property
    def is_preference(self) -> bool:
        return self.rejected is not None

    @property
    def is_pair(self) -> bool:
        return self.kind == "pair"


@dataclass(frozen=True)
class Example:
    """Token ids and labels of one sample (``IGNORE_INDEX`` where no loss is taken)."""

    input_ids: list[int]
    labels: list[int]
