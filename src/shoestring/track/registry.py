"""The trackers ``track.to`` can name: one entry each (its library, the package that
brings it, and how its sink is built). A new tracker is one sink class in
:mod:`shoestring.track.sinks` and one entry here; a name without an entry is an error,
never a fall-through to another tracker."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from shoestring.rundir import RunDir
from shoestring.track.config import TrackConfig, TrackerName
from shoestring.track.ids import TENSORBOARD_DIR, TrackerIds, new_wandb_id
from shoestring.track.sinks import MlflowSink, Sink, TensorBoardSink, WandbSink, require

SinkFactory = Callable[[TrackConfig, Path, TrackerIds], Sink]


@dataclass(frozen=True)
class TrackerKind:
    """One tracker: the module its sink imports, the pip package, the sink's builder."""

    module: str
    package: str
    build: SinkFactory


def _tensorboard(cfg: TrackConfig, run_dir: Path, ids: TrackerIds) -> Sink:
    return TensorBoardSink(run_dir, ids.tensorboard or TENSORBOARD_DIR)


def _wandb(cfg: TrackConfig, run_dir: Path, ids: TrackerIds) -> Sink:
    run_id = ids.wandb or new_wandb_id(RunDir(run_dir).run_id())
    return WandbSink(cfg.project, cfg.name, cfg.wandb_mode, run_dir, run_id)


def _mlflow(cfg: TrackConfig, run_dir: Path, ids: TrackerIds) -> Sink:
    uri = cfg.mlflow_uri or (run_dir / "mlruns").resolve().as_uri()
    return MlflowSink(uri, cfg.project, cfg.name, RunDir(run_dir).run_id())


TRACKER_KINDS: Mapping[TrackerName, TrackerKind] = {
    "tensorboard": TrackerKind("tensorboard", "tensorboard", _tensorboard),
    "wandb": TrackerKind("wandb", "wandb", _wandb),
    "mlflow": TrackerKind("mlflow", "mlflow-skinny", _mlflow),
}


def tracker_kind(name: str) -> TrackerKind:
    """The entry for ``name``; an unknown name is a ``ValueError`` naming ``track.to``."""
    kind = next((k for n, k in TRACKER_KINDS.items() if n == name), None)
    if kind is None:
        raise ValueError(f"track.to: no tracker is registered as {name!r}")
    return kind


def require_all(names: Iterable[str]) -> None:
    """Check each named tracker's library is installed (before any expensive work)."""
    for name in names:
        kind = tracker_kind(name)
        require(kind.module, kind.package, name)


def build_sinks(cfg: TrackConfig, run_dir: Path, ids: TrackerIds) -> list[Sink]:
    """The sinks ``cfg.to`` names, in its order."""
    return [tracker_kind(name).build(cfg, run_dir, ids) for name in cfg.to]
