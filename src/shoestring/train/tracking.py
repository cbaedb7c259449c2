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
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from shoestring import exitcodes
from shoestring.config import ConfigError
from shoestring.events import read_events
from shoestring.fsio import atomic_write
from shoestring.rundir import RunDir
from shoestring.track import Tracker, TrackerIds
from shoestring.track.config import TrackConfig
from shoestring.track.sinks import Status, TrackerNotInstalled, require_all
from shoestring.train.trainer import Trainer

log = logging.getLogger("shoestring.finetune")

SUPERVISOR_RANK = -1
OPEN_WAIT_S = 15.0  # ``shoestring run``'s records (the tracker keeps those it shows)


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


def _forward_supervisor(tracker: Tracker, rd: RunDir) -> None:
    """Hand ``shoestring run``'s alarms written since the last forward to the tracker."""
    since = float(_run_json(rd).get("tracked_until", 0.0))
    now = time.time()
    if rd.events.exists():
        for r in read_events(rd.events, tail_bytes=1 << 20):
            ts = r.get("ts")
            if (
                r.get("rank") == SUPERVISOR_RANK
                and isinstance(ts, (int, float))
                and since < ts <= now
            ):
                tracker.submit(r)
    _remember(rd, tracked_until=now, trackers=tracker.ids.to_json())


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
    _forward_supervisor(tracker, run.dir)
    run.events.add_listener(tracker.submit)
    try:
        yield tracked
    finally:
        run.events.remove_listener(tracker.submit)
        _forward_supervisor(tracker, run.dir)
        tracker.close(tracked.status)
        _remember(run.dir, trackers=tracker.ids.to_json())
        _log_losses(tracker)


def _log_losses(tracker: Tracker) -> None:
    if tracker.dropped or tracker.errors:
        log.warning(
            "trackers: %d record(s) dropped (queue full), errors per tracker: %s",
            tracker.dropped,
            dict(tracker.errors) or "none",
        )
