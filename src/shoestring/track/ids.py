"""Per-tracker run identity, kept in ``run.json`` so a resumed job continues the SAME
tracker run: ``{"wandb": "<run id>", "mlflow": "<run id>", "tensorboard": "<logdir>"}``
(the TensorBoard entry is the log directory relative to the run directory)."""

from __future__ import annotations

import dataclasses
import hashlib
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: TensorBoard's log directory, relative to the run directory.
TENSORBOARD_DIR = "tensorboard"


@dataclass(frozen=True)
class TrackerIds:
    wandb: str | None = None
    mlflow: str | None = None
    tensorboard: str | None = None

    def to_json(self) -> dict[str, str]:
        """The known entries (JSON-ready, for ``run.json`` and checkpoint metadata)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> TrackerIds:
        """Read what :meth:`to_json` wrote; unknown keys and non-string values are ignored."""
        if not data:
            return cls()
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names and isinstance(v, str) and v})

    def merged(self, entries: Mapping[str, str]) -> TrackerIds:
        """These ids with ``entries`` (a sink's answer to ``open``) set."""
        names = {f.name for f in dataclasses.fields(self)}
        return dataclasses.replace(self, **{k: v for k, v in entries.items() if k in names})


def new_wandb_id(run_id: str | None = None) -> str:
    """A W&B run id: derived from shoestring's stable ``run_id`` when known (so a job
    that lost its stored ids still lands in the same W&B run), else random."""
    if run_id:
        return "ss" + hashlib.sha256(run_id.encode()).hexdigest()[:10]
    return uuid.uuid4().hex[:8]
