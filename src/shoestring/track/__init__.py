"""Experiment trackers (TensorBoard, Weights & Biases, MLflow) fed from the event log.

Rank 0 opens a :class:`Tracker` from :class:`TrackConfig` and hands it every record the
:class:`~shoestring.events.EventLog` emits (``tracker.submit(record)``); tracker run ids
(:class:`TrackerIds`) are kept in ``run.json`` so a resumed job continues the same
tracker runs. What each record shows is decided in :mod:`.metrics`; the sinks
(:mod:`.sinks`) only render. A tracker outage never fails or slows a run. This package
imports only the spine. See ``docs/tracking.md``.
"""

from shoestring.track.config import TRACKERS, TrackConfig, TrackerName
from shoestring.track.ids import TrackerIds, new_wandb_id
from shoestring.track.metrics import EVENTS, TrackerRow, to_row
from shoestring.track.registry import TRACKER_KINDS, build_sinks
from shoestring.track.sinks import (
    MlflowSink,
    Sink,
    Status,
    TensorBoardSink,
    TrackerNotInstalled,
    WandbSink,
)
from shoestring.track.tracker import Tracker

__all__ = [
    "EVENTS",
    "TRACKERS",
    "TRACKER_KINDS",
    "MlflowSink",
    "Sink",
    "Status",
    "TensorBoardSink",
    "TrackConfig",
    "Tracker",
    "TrackerIds",
    "TrackerName",
    "TrackerNotInstalled",
    "TrackerRow",
    "WandbSink",
    "build_sinks",
    "new_wandb_id",
    "to_row",
]
