"""The pass clock of the chunk loop: how long each pass took, and when to save the state."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shoestring.infer.report import Stats


@dataclass
class PassClock:
    """When the running pass began, and when the running chunk's state was last saved."""

    now: Callable[[], float] = time.perf_counter
    pass_started: float = field(default=0.0, init=False)
    last_save: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self.start_chunk()

    def start_chunk(self) -> None:
        """A chunk begins: its first pass starts now, and nothing of it is unsaved yet."""
        self.pass_started = self.last_save = self.now()

    def end_pass(self, stats: Stats) -> float:
        """Count the pass that just ended in ``stats``; returns how long it took."""
        seconds = self.now() - self.pass_started
        stats.count_pass(seconds)
        return seconds

    def start_pass(self) -> None:
        self.pass_started = self.now()

    def save_due(self, every_s: float) -> bool:
        """Whether a periodic save is due (``every_s`` 0: never)."""
        return bool(every_s) and self.now() - self.last_save >= every_s

    def saved(self) -> None:
        self.last_save = self.now()
