"""The run directory: the contract between every pillar and every view.

One type names each path, so the layout is written down once::

    OUTPUT/run.json                 stable run_id
    OUTPUT/config.yaml              the resolved config
    OUTPUT/events.jsonl             rank 0's (and the supervisor's) event log
    OUTPUT/ranks/rank<R>/           other ranks' events.jsonl, every rank's live.json
                                    and stacks; NCCL flight-recorder pipes
    OUTPUT/verdicts/                hang verdicts with stacks and flight-recorder dumps
    OUTPUT/checkpoints/step-N/      committed checkpoints (the local cache)
    OUTPUT/final/, OUTPUT/merged/   exports
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

EVENTS = "events.jsonl"
LIVE = "live.json"


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def events(self) -> Path:
        return self.root / EVENTS

    @property
    def run_json(self) -> Path:
        return self.root / "run.json"

    @property
    def config_yaml(self) -> Path:
        return self.root / "config.yaml"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def ranks(self) -> Path:
        return self.root / "ranks"

    @property
    def verdicts(self) -> Path:
        return self.root / "verdicts"

    def rank_dir(self, rank: int) -> Path:
        return self.ranks / f"rank{rank}"

    def rank_events(self, rank: int) -> Path:
        """Where ``rank`` logs: rank 0 owns ``events.jsonl``, the others log beside it."""
        return self.events if rank == 0 else self.rank_dir(rank) / EVENTS

    def live(self, rank: int) -> Path:
        return self.rank_dir(rank) / LIVE

    def live_files(self) -> Iterator[Path]:
        return self.ranks.glob(f"rank*/{LIVE}")

    def event_files(self) -> list[Path]:
        """Every event log of the run: rank 0's first, then the other ranks'."""
        return [self.events, *sorted(self.ranks.glob(f"rank*/{EVENTS}"))]

    def run_id(self) -> str | None:
        """The stable run id from ``run.json`` (None before the first start)."""
        try:
            return str(json.loads(self.run_json.read_text())["run_id"])
        except (OSError, ValueError, KeyError):
            return None
