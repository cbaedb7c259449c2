"""``track.*``: which experiment trackers a run reports to, and how.

The run directory stays the source of truth (``events.jsonl``); trackers are views
fed from the same records. Nothing here imports a tracker library.
"""

from __future__ import annotations

import typing
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from shoestring.config import knob, positive

#: The trackers ``track.to`` accepts; the alias is the one place they are written.
TrackerName = Literal["tensorboard", "wandb", "mlflow"]
TRACKERS: tuple[TrackerName, ...] = typing.get_args(TrackerName)
#: ``track.wandb_mode``: ``None`` lets wandb decide (``WANDB_MODE``, login state).
WandbMode = Literal["online", "offline"]


def unknown_tracker(names: Iterable[str]) -> str | None:
    """The problem with a ``track.to`` value (without the key), or None."""
    for name in names:
        if name not in TRACKERS:
            return f"unknown tracker '{name}' (choose {', '.join(TRACKERS)})"
    return None


def _check_to(v: Any) -> str | None:
    return unknown_tracker([v] if isinstance(v, str) else v)


def _nonempty(v: str) -> str | None:
    return None if v.strip() else "must not be empty"


@dataclass
class TrackConfig:
    to: list[TrackerName] = knob(
        [],
        "Experiment trackers fed from the event log (rank 0 only): any of tensorboard, "
        "wandb, mlflow, comma-separated. Empty: none. Needs pip install 'shoestring[track]'.",
        check=_check_to,
    )
    project: str = knob("shoestring", "W&B project and MLflow experiment name.", check=_nonempty)
    name: str | None = knob(None, "Run display name in W&B and MLflow (default: theirs).")
    mlflow_uri: str | None = knob(
        None,
        "MLflow tracking URI (http://host:5000, sqlite:///mlflow.db, file:/path). "
        "Default: a file store in OUTPUT/mlruns.",
    )
    wandb_mode: WandbMode | None = knob(
        None, "W&B mode: online or offline. Default: wandb's own (WANDB_MODE, login)."
    )
    queue: int = knob(
        10000,
        "Records buffered for the tracker thread; when full, new records are dropped "
        "(counted) so a slow tracker never blocks a training step.",
        check=positive,
    )

    def __post_init__(self) -> None:
        raw: Any = self.to
        names = [n.strip() for n in raw.split(",") if n.strip()] if isinstance(raw, str) else raw
        problem = unknown_tracker(names)
        if problem:
            raise ValueError(f"track.to: {problem}")
        self.to = list(dict.fromkeys(typing.cast(list[TrackerName], names)))  # order kept
        if self.queue <= 0:
            raise ValueError(f"track.queue: must be > 0; got {self.queue!r}")
