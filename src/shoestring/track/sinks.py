"""Tracker sinks: TensorBoard, Weights & Biases and MLflow, each rendering
:class:`~shoestring.track.metrics.TrackerRow` s (what to show is decided in ``metrics``).

Every sink imports its library lazily, in :meth:`Sink.open` (called on the tracker's
thread); its constructor only checks that the library is installed and raises
:class:`TrackerNotInstalled` with the install hint otherwise.

**The same tracker run across restarts.** A resumed job passes the stored
:class:`TrackerIds` back, and restarts from its last checkpoint, so it re-logs the
steps after that checkpoint that a SIGKILL threw away (preemption by SIGTERM
checkpoints at the stopping step: nothing is re-logged). Per tracker:

* **TensorBoard**: the same log directory; the writer opens with
  ``purge_step = resume step + 1`` (and a ``resume`` record writes the same marker),
  so TensorBoard hides every point an earlier attempt logged at or after it: each step
  shows once, with the values of the attempt that survived.
* **W&B**: the same run id, ``resume="allow"``; the W&B step is the training step
  (``run.log(..., step=step)``). W&B refuses a step below its current one, so
  (a) online, a resumed run starts at W&B's last step + 1 and the sink skips re-logged
  rows below it (W&B keeps the first attempt's values there: with deterministic
  training they are the same numbers), and (b) a record that arrives late (a
  checkpoint committed in the background after later steps) is logged at the current
  step; its true step is in ``checkpoint/step``. W&B commits a step's row when a later
  step arrives, so a SIGKILL loses the last logged step's row, and offline runs flush
  their ``.wandb`` file every 15 s (``WANDB__TRANSACTION_LOG_FLUSH_INTERVAL``).
  Offline, W&B ignores ``resume``: each attempt writes its own
  ``RUN_DIR/wandb/offline-run-*-<id>`` directory with the same id, starting at its
  resume step; ``wandb sync`` uploads them in start order into that one run, where the
  rule of (a) applies again. No custom step metric is used, so W&B's step axis is the
  training step and is monotone.
* **MLflow**: the same run (``update_run(RUNNING)`` then log); MLflow keeps every logged
  value, so after a SIGKILL the re-logged steps appear twice in a metric's history
  (the thrown-away value, then the re-logged one, with their timestamps); every other
  step once. A run id that the store does not know is replaced by a new run; without a
  stored id the run is found by its ``shoestring.run_id`` tag.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

from shoestring.exitcodes import FAILED, OK, PREEMPTED
from shoestring.track.ids import TENSORBOARD_DIR, TrackerIds
from shoestring.track.metrics import TrackerRow, number, render_config

log = logging.getLogger("shoestring.track")

#: How a run ended, as the tracker is told at close.
Status = Literal["completed", "preempted", "failed"]
INSTALL_HINT = "pip install 'shoestring[track]'"
#: MLflow tag with shoestring's run_id (finds the run when no id was stored).
MLFLOW_RUN_TAG = "shoestring.run_id"
MLFLOW_STATUS: Mapping[Status, str] = {
    "completed": "FINISHED",
    "preempted": "KILLED",
    "failed": "FAILED",
}
WANDB_EXIT: Mapping[Status, int] = {"completed": OK, "preempted": PREEMPTED, "failed": FAILED}
#: Conservative MLflow limits (older tracking servers allow 500-character params).
MLFLOW_PARAM_LEN = 500
MLFLOW_TAG_LEN = 5000
#: Metrics buffered before a ``log_batch`` (else sent on flush, about once a second).
MLFLOW_BATCH = 800


class TrackerNotInstalled(ImportError):
    """``track.to`` names a tracker whose library is not installed."""


class Sink(Protocol):
    """One tracker. Called only from the tracker's thread, in this order: ``open``
    once, ``write`` per row, ``close`` once. Errors propagate to the tracker, which
    logs and contains them."""

    name: str

    def open(self, ids: TrackerIds, resume_step: int | None) -> dict[str, str]:
        """Start or continue the tracker run; return this sink's id entry."""
        ...

    def planned(self, ids: TrackerIds) -> dict[str, str]:
        """This sink's id entry when it is known before ``open`` (else empty)."""
        ...

    def write(self, row: TrackerRow) -> None: ...

    def flush(self) -> None:
        """Put what ``write`` buffered on disk or the wire (called at the end of each
        batch the tracker thread takes: at most about a second after a step record, at
        once after a checkpoint record)."""
        ...

    def close(self, status: Status) -> None:
        """Flush and end the tracker run with ``status``."""
        ...


def require(module: str, package: str, tracker: str) -> None:
    """Raise :class:`TrackerNotInstalled` (with the install hint) unless ``module`` exists."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise TrackerNotInstalled(
            f"track.to: {tracker} needs the {package} package: {INSTALL_HINT} "
            f"(or pip install {package})"
        )


# --------------------------------------------------------------------------- TensorBoard


class TensorBoardSink:
    """``torch.utils.tensorboard.SummaryWriter`` in ``RUN_DIR/<logdir>``."""

    name = "tensorboard"

    def __init__(self, run_dir: str | Path, logdir: str = TENSORBOARD_DIR) -> None:
        require("tensorboard", "tensorboard", self.name)
        self.run_dir = Path(run_dir)
        self.logdir = logdir
        self._writer: Any = None
        self._purged: int | None = None
        self._config_logged = False

    def planned(self, ids: TrackerIds) -> dict[str, str]:
        return {"tensorboard": ids.tensorboard or self.logdir}

    def open(self, ids: TrackerIds, resume_step: int | None) -> dict[str, str]:
        from torch.utils.tensorboard import SummaryWriter

        rel = ids.tensorboard or self.logdir
        self._purged = None if resume_step is None else resume_step + 1
        self._writer = SummaryWriter(str(self.run_dir / rel), purge_step=self._purged)
        return {"tensorboard": rel}

    def write(self, row: TrackerRow) -> None:
        w = self._writer
        step, wall = row.step or 0, row.ts or None
        if row.rewind is not None and row.rewind != self._purged:
            self._rewind(row.rewind)
        for tag, value in row.scalars.items():
            w.add_scalar(tag, value, step, walltime=wall)
        for tag, text in row.texts.items():
            w.add_text(tag, text, step, walltime=wall)
        if row.alarm is not None:
            w.add_text("events", f"**{row.event}**: {row.alarm}", step, walltime=wall)
        if row.config is not None and not self._config_logged:
            w.add_text("config", render_config(row.config), step, walltime=wall)
            self._config_logged = True

    def flush(self) -> None:
        self._writer.flush()

    def _rewind(self, step: int) -> None:
        """Hide everything logged at or after ``step`` (what ``purge_step`` writes)."""
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        start = Event(step=step, session_log=SessionLog(status=SessionLog.START))
        self._writer.file_writer.add_event(start)
        self._purged = step

    def close(self, status: Status) -> None:
        if self._writer is not None:
            self._writer.close()


# --------------------------------------------------------------------------- W&B


class WandbSink:
    """A W&B run (``wandb.init(id=..., resume="allow")``); step = training step."""

    name = "wandb"

    def __init__(
        self,
        project: str,
        name: str | None,
        mode: Literal["online", "offline"] | None,
        dir: str | Path,
        run_id: str,
    ) -> None:
        require("wandb", "wandb", self.name)
        self.project, self.run_name, self.mode = project, name, mode
        self.dir, self.run_id = Path(dir), run_id
        self._run: Any = None
        self._floor = 0  # W&B refuses steps below this (a resumed online run's next step)
        self._step = 0  # the step of W&B's open row
        self.skipped = 0  # re-logged rows below the floor

    def planned(self, ids: TrackerIds) -> dict[str, str]:
        return {"wandb": ids.wandb or self.run_id}

    def open(self, ids: TrackerIds, resume_step: int | None) -> dict[str, str]:
        import wandb

        settings = wandb.Settings(console="off", silent=True, reinit="create_new")
        self.dir.mkdir(parents=True, exist_ok=True)
        self._run = run = wandb.init(
            id=ids.wandb or self.run_id,
            resume="allow",
            project=self.project,
            name=self.run_name,
            dir=str(self.dir),
            mode=self.mode,
            settings=settings,
        )
        self._floor = int(run.starting_step) if run.resumed else 0
        self._step = max(self._floor, resume_step or 0)
        log.info("track: wandb run %s (%s)", run.id, run.url or "offline")
        return {"wandb": str(run.id)}

    def write(self, row: TrackerRow) -> None:
        run = self._run
        step = self._step if row.step is None else row.step
        if row.scalars and step < self._floor:
            self.skipped += 1
        elif row.scalars:
            self._step = max(step, self._step)
            run.log(dict(row.scalars), step=self._step)
        if row.config is not None:
            run.config.update(row.config, allow_val_change=True)
        if row.texts:
            run.summary.update(row.texts)
        if row.final:
            run.summary.update(row.final)
        if row.alarm is not None:
            self._alert(row.event, row.alarm)

    def _alert(self, kind: str, message: str) -> None:
        run = self._run
        run.summary[f"alarm/{kind}"] = message
        if kind == "preempt":
            run.mark_preempting()
        try:
            run.alert(title=f"shoestring: {kind}", text=message, level="WARN")
        except Exception as e:  # offline or alerts off: the summary above keeps it
            log.debug("track: wandb alert not sent: %s", e)

    def flush(self) -> None:
        """Nothing: wandb-core writes and uploads in the background."""

    def close(self, status: Status) -> None:
        run = self._run
        if run is None:
            return
        if self.skipped:
            run.summary["shoestring/relogged_rows_skipped"] = self.skipped
        if status == "preempted":
            run.mark_preempting()
        run.finish(exit_code=WANDB_EXIT[status])


# --------------------------------------------------------------------------- MLflow


def is_file_uri(uri: str) -> bool:
    return uri.startswith("file:") or ("://" not in uri and not uri.startswith("databricks"))


def _key(key: str) -> str:
    """A valid MLflow key (alphanumerics, ``_ - . / : space``), at most 250 characters."""
    return re.sub(r"[^\w\-./: ]", "_", key)[:250]


class MlflowSink:
    """An MLflow run through ``MlflowClient``; metrics by step, config as params."""

    name = "mlflow"

    def __init__(
        self, tracking_uri: str, experiment: str, name: str | None, run_tag: str | None
    ) -> None:
        require("mlflow", "mlflow-skinny", self.name)
        self.uri, self.experiment, self.run_name, self.run_tag = (
            tracking_uri,
            experiment,
            name,
            run_tag,
        )
        self._client: Any = None
        self.run_id = ""
        self._params: dict[str, str] = {}
        self._pending: list[Any] = []  # metrics batched until flush (or a tag/param row)

    def planned(self, ids: TrackerIds) -> dict[str, str]:
        return {}  # the store chooses the id when the run opens

    def open(self, ids: TrackerIds, resume_step: int | None) -> dict[str, str]:
        from mlflow.tracking import MlflowClient

        if is_file_uri(self.uri):
            # MLflow 3 keeps its file store only on request; it is the zero-setup default.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        client = self._client = MlflowClient(tracking_uri=self.uri)
        run = self._existing(client, ids.mlflow)
        if run is None:
            tags = {MLFLOW_RUN_TAG: self.run_tag} if self.run_tag else None
            run = client.create_run(self._experiment_id(client), run_name=self.run_name, tags=tags)
        else:
            client.update_run(run.info.run_id, status="RUNNING")
            self._params = dict(run.data.params)
        self.run_id = str(run.info.run_id)
        return {"mlflow": self.run_id}

    def _existing(self, client: Any, run_id: str | None) -> Any:
        from mlflow.exceptions import MlflowException

        if run_id:
            try:
                return client.get_run(run_id)
            except MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                log.warning("track: mlflow run %s not found at %s; starting one", run_id, self.uri)
                return None
        exp = client.get_experiment_by_name(self.experiment)
        if exp is None or not self.run_tag:
            return None
        found = client.search_runs(
            [exp.experiment_id],
            filter_string=f"tags.`{MLFLOW_RUN_TAG}` = '{self.run_tag}'",
            max_results=1,
            order_by=["attributes.start_time DESC"],
        )
        return found[0] if found else None

    def _experiment_id(self, client: Any) -> str:
        from mlflow.exceptions import MlflowException

        exp = client.get_experiment_by_name(self.experiment)
        if exp is not None:
            return str(exp.experiment_id)
        try:
            return str(client.create_experiment(self.experiment))
        except MlflowException:  # created meanwhile by another job
            return str(client.get_experiment_by_name(self.experiment).experiment_id)

    def write(self, row: TrackerRow) -> None:
        from mlflow.entities import Metric, Param, RunTag

        ts_ms, step = int((row.ts or time.time()) * 1000), row.step or 0
        metrics = [Metric(_key(k), v, ts_ms, step) for k, v in row.scalars.items()]
        tags = {f"shoestring.{tag}": text for tag, text in row.texts.items()}
        if row.alarm is not None:
            tags[f"shoestring.alarm.{row.event}"] = row.alarm
            if row.event == "preempt":
                tags["shoestring.preempted"] = "true"
        for k, v in (row.final or {}).items():
            num = number(v)
            if num is None:
                tags["shoestring." + k.replace("/", ".")] = str(v)
            elif k not in row.scalars:
                metrics.append(Metric(_key(k), num, ts_ms, step))
        params = self._new_params(row.config, tags) if row.config is not None else {}
        self._pending += metrics
        if params or tags or len(self._pending) >= MLFLOW_BATCH:
            self._log(
                [Param(k, v) for k, v in params.items()],
                [RunTag(_key(k), v[:MLFLOW_TAG_LEN]) for k, v in tags.items()],
            )

    def _new_params(self, config: Mapping[str, Any], tags: dict[str, str]) -> dict[str, str]:
        """Params not logged yet. MLflow params are immutable: a value changed on resume
        (a resume-safe key) goes to the tag ``shoestring.config.<key>`` instead."""
        new: dict[str, str] = {}
        for k, v in config.items():
            key, value = _key(k), str(v)[:MLFLOW_PARAM_LEN]
            old = self._params.get(key)
            if old is None:
                new[key] = value
            elif old != value:
                tags[f"shoestring.config.{key}"] = value
        self._params.update(new)
        return new

    def flush(self) -> None:
        if self._pending:
            self._log([], [])

    def _log(self, params: list[Any], tags: list[Any]) -> None:
        """The pending metrics, ``params`` and ``tags`` in ``log_batch`` calls within
        MLflow's limits (1000 metrics, 100 params, 100 tags per call)."""
        metrics, self._pending = self._pending, []
        while metrics or params or tags:
            self._client.log_batch(
                self.run_id, metrics=metrics[:800], params=params[:100], tags=tags[:100]
            )
            metrics, params, tags = metrics[800:], params[100:], tags[100:]

    def close(self, status: Status) -> None:
        if self._client is not None and self.run_id:
            self.flush()
            self._client.set_terminated(self.run_id, status=MLFLOW_STATUS[status])
