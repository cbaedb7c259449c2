"""The watchdog thread of ``shoestring run``: reads the ranks' live snapshots,
decides whether the job is hung, and on a verdict captures every rank's Python
stacks (faulthandler, in-process), records the verdict and asks the supervisor
to kill and restart the job. On the same poll it checks for stragglers, closes
the per-window degradation statistics and, at its own interval, samples host
and GPU metrics; records and alarms go to the supervisor's callbacks.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shoestring.rundir import RunDir
from shoestring.watch.degrade import DegradationMonitor, DegradePolicy
from shoestring.watch.hang import HangPolicy, Verdict, analyze, not_started
from shoestring.watch.recorder import STACK_SIGNAL, STACKS
from shoestring.watch.straggler import StragglerPolicy, StragglerWatch

log = logging.getLogger("shoestring.watch")


def read_snapshots(run_dir: Path, since: float) -> dict[int, dict[str, Any]]:
    """Live snapshots written after ``since`` (older ones belong to an earlier attempt)."""
    out: dict[int, dict[str, Any]] = {}
    for p in RunDir(run_dir).live_files():
        try:
            snap = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if snap.get("ts", 0) >= since:
            out[int(snap["rank"])] = snap
    return out


def capture_stacks(
    run_dir: Path,
    snaps: dict[int, dict[str, Any]],
    wait_s: float = 1.0,
) -> dict[int, str]:
    """Signal each live rank to dump all thread stacks; return what each one wrote."""
    host = os.uname().nodename
    sizes: dict[int, int] = {}
    for r, s in snaps.items():
        path = RunDir(run_dir).rank_dir(r) / STACKS
        sizes[r] = path.stat().st_size if path.exists() else 0
        if s.get("host") == host:
            try:
                os.kill(int(s["pid"]), STACK_SIGNAL)
            except (ProcessLookupError, PermissionError):
                pass
    time.sleep(wait_s)
    stacks: dict[int, str] = {}
    for r in snaps:
        path = RunDir(run_dir).rank_dir(r) / STACKS
        try:
            with open(path, "rb") as f:
                f.seek(sizes[r])
                stacks[r] = f.read(64 * 1024).decode("utf-8", "replace")
        except OSError:
            stacks[r] = ""
    return stacks


Record = Callable[[str, dict[str, Any]], None]


class Watchdog:
    """Context manager around one attempt; ``verdict`` is set when a hang was found.

    ``on_alarm(kind, fields)`` receives stragglers and degradation alarms;
    ``on_record(event, fields)`` receives ``window`` and ``metrics`` records;
    ``on_snapshots(snaps)`` sees every poll's snapshots (the Prometheus view).
    ``sampler`` (a :class:`~shoestring.watch.metrics.MetricsSampler`) is sampled
    every ``metrics_interval_s`` when given.
    """

    def __init__(
        self,
        run_dir: Path,
        policy: HangPolicy,
        on_hang: Callable[[Verdict], None],
        *,
        on_alarm: Record | None = None,
        on_record: Record | None = None,
        on_snapshots: Callable[[dict[int, dict[str, Any]]], None] | None = None,
        stragglers: StragglerPolicy | None = None,
        degrade: DegradePolicy | None = None,
        sampler: Any = None,
        metrics_interval_s: float = 10.0,
        poll_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.run_dir, self.policy, self.on_hang = run_dir, policy, on_hang
        self.on_alarm, self.on_record, self.on_snapshots = on_alarm, on_record, on_snapshots
        self.stragglers = StragglerWatch(stragglers or StragglerPolicy())
        self.degrade_policy = degrade
        self.sampler, self.metrics_interval_s = sampler, metrics_interval_s
        self.poll_s, self._clock = poll_s, clock
        self.verdict: Verdict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._since = 0.0
        self._degrade: DegradationMonitor | None = None
        self._next_sample = 0.0

    def __enter__(self) -> Watchdog:
        self._since = self._clock()
        if self.degrade_policy is not None:
            self._degrade = DegradationMonitor(self.degrade_policy)
        self._next_sample = self._since + min(1.0, self.metrics_interval_s)
        self._thread = threading.Thread(target=self._loop, name="shoestring-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.verdict is None:
            self._last_look()

    def _last_look(self) -> None:
        """Judge stragglers once more on the snapshots every rank published as it
        finished: a short run can end between two polls, right after its straggler
        was confirmed, and would otherwise never report it."""
        snaps = read_snapshots(self.run_dir, self._since)
        if snaps and all(s.get("status") == "done" for s in snaps.values()):
            world = max(int(s.get("world_size", 1)) for s in snaps.values())
            self._check_stragglers(snaps, world, status="done")

    def check_once(self) -> Verdict | None:
        snaps = read_snapshots(self.run_dir, self._since)
        if not snaps:
            return None
        world = max(int(s.get("world_size", 1)) for s in snaps.values())
        if self.on_snapshots is not None:
            self.on_snapshots(snaps)
        self._check_stragglers(snaps, world)
        self._check_windows(snaps)
        self._sample(snaps)
        now = self._clock()
        verdict = analyze(snaps, now, self.policy, world) or not_started(
            snaps, now, self.policy, world, self._since
        )
        if verdict is None:
            return None
        stacks = capture_stacks(self.run_dir, {r: snaps[r] for r in snaps})
        for r, text in stacks.items():
            verdict.ranks.setdefault(r, {})["stacks"] = text
        return verdict

    def _check_stragglers(
        self, snaps: dict[int, dict[str, Any]], world: int, status: str = "running"
    ) -> None:
        running = {r: s for r, s in snaps.items() if s.get("status") == status}
        if self.on_alarm is None or len(running) < max(world, 2):
            return
        found = self.stragglers.observe(running)
        if found is None:
            return
        found["message"] = (
            f"its {found['part']} work is {found['slower_by']:.0%} slower than "
            f"its peers' for the same batch size (since step "
            f"{found['slower_since_step']})"
        )
        self.on_alarm("straggler", found)

    def _check_windows(self, snaps: dict[int, dict[str, Any]]) -> None:
        if self._degrade is None:
            return
        windows, alarms = self._degrade.observe(self._clock(), snaps)
        for w in windows:
            if self.on_record is not None:
                self.on_record("window", w.to_json())
        for a in alarms:
            if self.on_alarm is not None:
                a["step"] = snaps[a["rank"]]["step"]
                self.on_alarm("alarm", a)

    def _sample(self, snaps: dict[int, dict[str, Any]]) -> None:
        now = self._clock()
        if self.sampler is None or now < self._next_sample:
            return
        self._next_sample = now + self.metrics_interval_s
        host = os.uname().nodename
        pids = {
            r: int(s["pid"])
            for r, s in snaps.items()
            if s.get("host") == host and s.get("status") == "running"
        }
        rec = self.sampler.sample(pids)
        if self.on_record is not None:
            self.on_record("metrics", rec)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                verdict = self.check_once()
            except Exception as e:  # noqa: BLE001 - the watchdog must not die silently
                log.warning("watchdog check failed: %s", e)
                continue
            if verdict is not None:
                self.verdict = verdict
                self.on_hang(verdict)
                return
