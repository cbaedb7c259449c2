"""GRPO's reward functions (``grpo.rewards``): found before any weights load, called as
TRL calls them, so a TRL reward function works unchanged.

A function receives keyword lists, one item per completion: ``prompts`` (the raw
prompt: text, or the message list), ``completions`` (text, or ``[{"role":
"assistant", "content": ...}]`` after a conversation), ``completion_ids`` (token ids,
its end token included, as TRL passes them) and every other field of the prompt
records as a column. It returns one float per completion, or None for one it does not
score (NaN here: left out of the group baseline; a completion no function scores gets
advantage 0, as in TRL).

Built in, against the record's ``answer`` field: ``builtin:exact_match`` (1 when the
completion, stripped, equals the answer, stripped) and ``builtin:similarity``
(:class:`difflib.SequenceMatcher` ratio of the two: partial credit, so a small model
has a gradient before it is ever exactly right).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import numpy.typing as npt

from shoestring.config import ConfigError
from shoestring.data.records import DataError

KEY = "grpo.rewards"
RewardFn = Callable[..., Sequence[float | None]]


class RewardError(RuntimeError):
    """A reward function failed or returned something other than one score per completion."""


def _text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    return str(completion[-1].get("content") or "")


def exact_match(completions: Sequence[Any], answer: Sequence[Any], **_: Any) -> list[float]:
    return [float(_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]


def similarity(completions: Sequence[Any], answer: Sequence[Any], **_: Any) -> list[float]:
    return [
        difflib.SequenceMatcher(None, _text(c).strip(), str(a).strip()).ratio()
        for c, a in zip(completions, answer)
    ]


#: Built-in rewards and the record field each reads.
BUILTIN: Mapping[str, tuple[RewardFn, str]] = MappingProxyType(
    {"exact_match": (exact_match, "answer"), "similarity": (similarity, "answer")}
)


@dataclass(frozen=True)
class Reward:
    name: str
    fn: RewardFn
    weight: float = 1.0
    #: The record field a built-in reads (checked against the data before training).
    needs: str | None = None


def _from_file(path: str, name: str, where: str) -> RewardFn:
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{where}: no such file {file}")
    spec = importlib.util.spec_from_file_location(f"shoestring_reward_{file.stem}", file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ConfigError(f"{where}: {file} failed to import: {type(e).__name__}: {e}") from e
    return _attribute(module, name, where)


def _from_module(path: str, name: str, where: str) -> RewardFn:
    try:
        module = importlib.import_module(path)
    except Exception as e:
        raise ConfigError(f"{where}: cannot import {path}: {type(e).__name__}: {e}") from e
    return _attribute(module, name, where)


def _attribute(module: Any, name: str, where: str) -> RewardFn:
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"{where}: {module.__name__} has no function {name!r}")
    return fn  # type: ignore[no-any-return]


def _load_one(spec: str, where: str) -> Reward:
    if spec.startswith("builtin:"):
        name = spec.split(":", 1)[1]
        if name not in BUILTIN:
            raise ConfigError(
                f"{where}: unknown built-in reward {spec!r} (built in: "
                + ", ".join(f"builtin:{n}" for n in BUILTIN)
                + ")"
            )
        fn, field = BUILTIN[name]
        return Reward(name, fn, needs=field)
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise ConfigError(
            f"{where}: {spec!r} is not 'builtin:NAME', 'MODULE:FUNCTION' or 'FILE.py:FUNCTION'"
        )
    fn = _from_file(path, name, where) if path.endswith(".py") else _from_module(path, name, where)
    return Reward(name, fn)


def load_rewards(specs: Sequence[str], weights: Sequence[float]) -> tuple[Reward, ...]:
    """The configured reward functions, imported now (a typo fails before weights load)."""
    if not specs:
        raise ConfigError(f"{KEY}: train.objective grpo needs at least one reward function")
    if weights and len(weights) != len(specs):
        raise ConfigError(
            f"grpo.reward_weights: {len(weights)} weight(s) for {len(specs)} reward function(s)"
        )
    out = []
    for i, spec in enumerate(specs):
        r = _load_one(spec.strip(), f"{KEY}[{i}] ({spec})")
        out.append(Reward(r.name, r.fn, float(weights[i]) if weights else 1.0, r.needs))
    return tuple(out)


def check_fields(specs: Sequence[str], records: Sequence[Any]) -> None:
    """Every prompt record has the field each built-in reward reads (before training)."""
    for i, spec in enumerate(specs):
        name = spec.strip().removeprefix("builtin:")
        if not spec.strip().startswith("builtin:") or name not in BUILTIN:
            continue
        field = BUILTIN[name][1]
        for r in records:
            if field not in (r.columns or {}):
                raise DataError(
                    f"{r.source}: no '{field}' field, which {KEY}[{i}] ({spec}) compares "
                    "each completion with"
                )


def _checked(reward: Reward, values: Any, n: int) -> list[float]:
    try:
        out = [math.nan if v is None else float(v) for v in values]
    except (TypeError, ValueError) as e:
        raise RewardError(
            f"reward function {reward.name!r} returned {type(values).__name__} with a value "
            f"that is not a number or None: {e}"
        ) from e
    if len(out) != n:
        raise RewardError(
            f"reward function {reward.name!r} returned {len(out)} rewards for {n} completions "
            "(one per completion expected)"
        )
    return out


def score(
    rewards: Sequence[Reward],
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]],
    columns: Mapping[str, list[Any]],
) -> npt.NDArray[np.float64]:
    """Each function's reward of each completion: ``(completions, functions)``, NaN where
    a function returned None."""
    table = np.empty((len(completions), len(rewards)), dtype=np.float64)
    for j, r in enumerate(rewards):
        try:
            values = r.fn(
                prompts=prompts, completions=completions, completion_ids=completion_ids, **columns
            )
        except Exception as e:
            raise RewardError(f"reward function {r.name!r} raised {type(e).__name__}: {e}") from e
        table[:, j] = _checked(r, values, len(completions))
    return table
