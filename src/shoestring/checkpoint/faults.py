"""Fault points for kill-anywhere testing.

The writer calls ``faults.hit("ckpt.before_manifest")`` at each interesting
moment. A :class:`FaultPlan` parsed from a spec such as
``"ckpt.partial_file@3:kill,upload.before_manifest"`` makes the N-th hit of a
point SIGKILL the process (default), raise ``ENOSPC``, or ``hang`` (a stalled disk). The CLI reads the
spec from ``SHOESTRING_FAULTS`` once; library code receives the plan object.

Points: ``ckpt.after_file``, ``ckpt.partial_file`` (dies with a half-written
file), ``ckpt.before_manifest``, ``ckpt.before_rename``, ``ckpt.after_rename``,
``ckpt.retention``, ``upload.after_file``, ``upload.before_manifest``,
``resume.after_load``, ``step.end``.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from dataclasses import dataclass, field

POINTS = frozenset({
    "ckpt.after_file", "ckpt.partial_file", "ckpt.before_manifest", "ckpt.before_rename",
    "ckpt.after_rename", "ckpt.retention", "upload.after_file", "upload.before_manifest",
    "resume.after_load", "step.end",
})
ACTIONS = frozenset({"kill", "enospc", "hang"})


@dataclass
class _Rule:
    point: str
    nth: int
    action: str


@dataclass
class FaultPlan:
    """Which fault fires where. The empty plan (the default) never fires."""

    rules: list[_Rule] = field(default_factory=list)
    spec: str = ""
    kill_pids: tuple[int, ...] = ()  # also SIGKILLed on a "kill" (the writer process's parent)
    _counts: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def parse(cls, spec: str, kill_pids: tuple[int, ...] = ()) -> "FaultPlan":
        rules = []
        for part in filter(None, (p.strip() for p in spec.split(","))):
            point, _, action = part.partition(":")
            point, _, nth = point.partition("@")
            action = action or "kill"
            if point not in POINTS:
                raise ValueError(f"SHOESTRING_FAULTS: unknown fault point {point!r}; "
                                 f"known: {', '.join(sorted(POINTS))}")
            if action not in ACTIONS:
                raise ValueError(f"SHOESTRING_FAULTS: unknown action {action!r} (kill|enospc|hang)")
            rules.append(_Rule(point, int(nth or 1), action))
        return cls(rules, spec, kill_pids)

    def wants(self, point: str) -> bool:
        """True if the next hit of ``point`` would fire (lets callers stage a partial write)."""
        with self._lock:
            n = self._counts.get(point, 0) + 1
        return any(r.point == point and r.nth == n for r in self.rules)

    def hit(self, point: str) -> None:
        with self._lock:
            n = self._counts[point] = self._counts.get(point, 0) + 1
        for r in self.rules:
            if r.point == point and r.nth == n:
                if r.action == "hang":  # a stalled disk or network
                    time.sleep(3600)
                if r.action == "enospc":
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + f" (fault {point})")
                for pid in self.kill_pids:
                    os.kill(pid, signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)


NO_FAULTS = FaultPlan()
