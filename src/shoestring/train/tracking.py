"""Experiment trackers for a fine-tuning run: rank 0 feeds them from its event log.

The run directory stays the record (``events.jsonl``); W&B, MLflow and TensorBoard
are views of it, fed by :class:`shoestring.track.Tracker` on its own thread, so a
slow or unreachable tracker never holds a step. Their run ids are kept in
``run.json`` and in every checkpoint's manifest, so a resumed, requeued or
restarted job — also on a fresh machine that resumes from the bucket — continues
the same tracker runs. ``shoestring run``'s own records (hangs, restarts,
stragglers) are written by another process; they are forwarded when an attempt
opens and closes its trackers, from a watermark kept in ``run.json``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from shoestring import exitcodes
from shoestring.config import ConfigError
from shoestring.events import read_tail
from shoestring.fsio import atomic_write
from shoestring.rundir import RunDir
from shoestring.track import Tracker, TrackerIds
from shoestring.track.config import TrackConfig
from shoestring.track.registry import require_all
from shoestring.track.sinks import Status, TrackerNotInstalled
from shoestring.train.trainer import Trainer

log = logging.getLogger("shoestring.finetune")

#: The records only ``shoestring run`` writes (rank -1, though a per-rank one such as
#: ``straggler`` carries the rank it is about in ``rank``); the tracker keeps those it shows.
SUPERVISOR_EVENTS = frozenset(
    {"attempt_start", "attempt_end", "restart", "hang", "straggler", "gave_up", "requeue"}
    | {"no_requeue", "window", "alarm", "metrics"}
)
OPEN_WAIT_S = 15.0  # at most this long at start for the trackers to open
POLL_S = 2.0  # how often shoestring run's new records are read
TAIL_BYTES = 1 << 20  # how far back the first read looks


@dataclass
class Tracked:
    """The open trackers of this attempt; ``status`` says how it ended."""

    tracker: Tracker | None
    status: Status = "failed"

    def ended_with(self, code: int) -> int:
        resumable = code in exitcodes.RESUMABLE
        self.status = (
            "completed" if code == exitcodes.OK else "preempted" if resumable else "failed"
        )
        return code


def check_trackers(cfg: TrackConfig) -> None:
    """Refuse ``track.to`` naming a tracker whose package is missing, before the model
    or the data is loaded (the message carries the install hint)."""
    try:
        require_all(cfg.to)
    except TrackerNotInstalled as e:
        raise ConfigError(str(e)) from e


def _run_json(rd: RunDir) -> dict[str, Any]:
    try:
        doc: dict[str, Any] = json.loads(rd.run_json.read_text())
    except (OSError, ValueError):
        return {}
    return doc


def _remember(rd: RunDir, **fields: Any) -> None:
    """Add ``fields`` to ``run.json`` (atomically; a failure is only a warning)."""
    doc = {**_run_json(rd), **fields}
    try:
        atomic_write(rd.run_json, json.dumps(doc).encode())
    except OSError as e:
        log.warning("could not record tracker state in %s: %s", rd.run_json, e)


def stored_ids(t: Trainer) -> TrackerIds:
    """The tracker ids of earlier attempts: the resumed checkpoint's (they travel with
    the bucket), else ``run.json``'s."""
    saved = TrackerIds.from_json(t.resumed_meta.get("trackers"))
    local = TrackerIds.from_json(_run_json(t.run.dir).get("trackers"))
    return local.merged(saved.to_json())


class SupervisorFeed:
    """``shoestring run``'s records (rank -1: hangs, restarts, stragglers, alarms, host
    and GPU samples) handed to the tracker as they are written to ``events.jsonl``:
    first those since the last forward (``tracked_until`` in ``run.json``), then the
    new lines every ``POLL_S`` on a daemon thread."""

    def __init__(self, tracker: Tracker, rd: RunDir) -> None:
        self.tracker, self.rd = tracker, rd
        self.since = float(_run_json(rd).get("tracked_until", 0.0))
        self.offset = rd.events.stat().st_size if rd.events.exists() else 0
        # What was written since the last forward may sit in a segment this start
        # rotated away: the recent history across segments, then the live file on.
        for rec in read_tail(rd.events, TAIL_BYTES):
            self._submit_record(rec)
        self._stop = threading.Event()
        self.poll()
        self._thread = threading.Thread(target=self._run, name="shoestring-feed", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.poll()

    def poll(self) -> None:
        try:
            with open(self.rd.events, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        end = data.rfind(b"\n") + 1  # whole lines only; a line being written waits
        self.offset += end
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill
            if isinstance(rec, dict):
                self._submit_record(rec)

    def _submit_record(self, rec: dict[str, Any]) -> None:
        """Hand on ``shoestring run``'s records newer than the last one handed on."""
        ts = rec.get("ts")
        ours = rec.get("event") in SUPERVISOR_EVENTS
        if ours and isinstance(ts, (int, float)) and ts > self.since:
            self.tracker.submit(rec)
            self.since = float(ts)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.poll()
        _remember(self.rd, tracked_until=self.since)


@contextlib.contextmanager
def tracking(t: Trainer, resume_step: int | None) -> Iterator[Tracked]:
    """Rank 0's trackers (``track.to``) for the rest of this attempt; none elsewhere."""
    cfg, run = t.cfg.track, t.run
    if not cfg.to or run.strategy.rank != 0:
        yield Tracked(None, "completed")
        return
    tracker = Tracker.open(cfg, run.out, stored_ids(t), resume_step=resume_step)
    # Before the first step (not during one): give the trackers a bounded moment to open,
    # so ids a server assigns (MLflow's) reach the first checkpoint's manifest.
    if not tracker.flush(timeout=OPEN_WAIT_S):
        log.warning("trackers still opening after %.0f s; training goes on", OPEN_WAIT_S)
    tracked = Tracked(tracker)
    t.tracker_ids = lambda: tracker.ids.to_json()
    _remember(run.dir, trackers=tracker.ids.to_json())
    feed = SupervisorFeed(tracker, run.dir)
    run.events.add_listener(tracker.submit)
    try:
        yield tracked
    finally:
        run.events.remove_listener(tracker.submit)
        feed.close()
        tracker.close(tracked.status)
        _remember(run.dir, trackers=tracker.ids.to_json())
        _log_losses(tracker)


def _log_losses(tracker: Tracker) -> None:
    errors = {name: n for name, n in tracker.errors.items() if n}
    if tracker.dropped or errors:
        log.warning(
            "trackers: %d record(s) dropped (queue full), errors per tracker: %s",
            tracker.dropped,
            errors or "none",
        )
