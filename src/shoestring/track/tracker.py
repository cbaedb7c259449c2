"""The tracker: event records in, tracker runs out, never in the training step's way.

``Tracker.submit(record)`` only puts the record on a bounded queue (a full queue drops
it and counts the drop); ONE daemon thread opens the sinks, maps each record to a
:class:`TrackerRow` (``metrics.to_row``) and hands it to every sink. Step records, the
only frequent ones, do not wake the thread: it takes them in one batch at most
:data:`FLUSH_EVERY_S` later (or when the queue is half full), so the sinks' Python
work runs in one burst a second instead of contending with every step for the GIL;
any other record (checkpoint, eval, alarm, ...) wakes it at once, and every batch
ends with a flush of the sinks. A sink that raises
(network outage, library error) is logged as a warning at most once a minute per sink,
skipped for a growing back-off (1 s doubling to 60 s, reset by a success) and retried;
the error never reaches the training loop. ``close(status)`` drains the queue and closes
the sinks within a timeout, then gives up on them.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from shoestring.exitcodes import RESUMABLE
from shoestring.rundir import RunDir
from shoestring.track.config import TrackConfig
from shoestring.track.ids import TrackerIds
from shoestring.track.metrics import EVENTS, TrackerRow, flatten, to_row
from shoestring.track.registry import build_sinks
from shoestring.track.sinks import Sink, Status

log = logging.getLogger("shoestring.track")

WARN_EVERY_S = 60.0
MAX_BACKOFF_S = 60.0
CLOSE_TIMEOUT_S = 30.0
#: The longest a step record waits for the tracker thread; every batch of records the
#: thread takes ends with a flush of the sinks (MLflow batches metrics until then).
FLUSH_EVERY_S = 1.0
#: Records that do not wake the tracker thread (taken with the next batch).
BATCHED = frozenset({"step"})


@dataclass
class _Slot:
    """A sink and its health, touched only by the tracker thread."""

    sink: Sink
    opened: bool = False
    failures: int = 0  # in a row
    errors: int = 0  # in all
    retry_at: float = 0.0
    warned_at: float = float("-inf")


@dataclass(frozen=True)
class _Stop:
    status: Status


def planned_ids(sinks: Sequence[Sink], ids: TrackerIds) -> TrackerIds:
    """The ids known before any sink opens (W&B's is chosen by us; TensorBoard's is a dir)."""
    for s in sinks:
        ids = ids.merged(s.planned(ids))
    return ids


def read_config_file(path: Path | None) -> dict[str, Any]:
    """The resolved ``config.yaml`` as flat ``section.key`` params ({} if unreadable)."""
    if path is None:
        return {}
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return flatten(data, sep=".") if isinstance(data, Mapping) else {}


class Tracker:
    """Owns the sinks, the queue and the thread that feeds them."""

    def __init__(
        self,
        sinks: Sequence[Sink],
        *,
        ids: TrackerIds | None = None,
        resume_step: int | None = None,
        queue_size: int = 10000,
        config_file: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        batch_s: float = FLUSH_EVERY_S,
    ) -> None:
        self._slots = [_Slot(s) for s in sinks]
        self._ids = planned_ids(sinks, ids or TrackerIds())
        self._resume_step = resume_step
        self._last_step = resume_step or 0
        self._config_file = config_file
        self._clock = clock
        self._batch_s = batch_s  # how long a step record may wait for the thread
        self._q: queue.Queue[Mapping[str, Any] | threading.Event | _Stop] = queue.Queue(
            maxsize=queue_size
        )
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._dropped = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        if self._slots:
            self._thread = threading.Thread(target=self._run, name="shoestring-track", daemon=True)
            self._thread.start()

    @classmethod
    def open(
        cls,
        cfg: TrackConfig,
        run_dir: str | Path,
        ids: TrackerIds | None = None,
        resume_step: int | None = None,
    ) -> Tracker:
        """Start feeding the trackers ``cfg.to`` names for the run in ``run_dir``.
        ``ids``: the stored :attr:`ids` of an earlier attempt (the same tracker runs
        continue); ``resume_step``: the checkpoint step this attempt resumed from."""
        root = Path(run_dir)
        ids = ids or TrackerIds()
        sinks = build_sinks(cfg, root, ids)
        rd = RunDir(root)
        return cls(
            sinks,
            ids=ids,
            resume_step=resume_step,
            queue_size=cfg.queue,
            config_file=rd.config_yaml,
        )

    # ----------------------------------------------------------------- caller side

    @property
    def ids(self) -> TrackerIds:
        """Tracker run ids to persist (MLflow's appears once its sink has opened)."""
        with self._lock:
            return self._ids

    @property
    def dropped(self) -> int:
        """Records dropped because the queue was full."""
        return self._dropped

    @property
    def errors(self) -> dict[str, int]:
        """Failed calls per sink so far."""
        return {s.sink.name: s.errors for s in self._slots}

    def submit(self, record: Mapping[str, Any]) -> None:
        """Queue one event record for the trackers; never blocks, never raises."""
        if self._thread is None or self._closed or record.get("event") not in EVENTS:
            return
        try:
            self._q.put_nowait(record)
            if record.get("event") not in BATCHED or 2 * self._q.qsize() >= self._q.maxsize:
                self._wake.set()
        except queue.Full:
            with self._lock:
                self._dropped += 1
                first = self._dropped == 1
            if first:
                log.warning(
                    "track: tracker queue full (%d records); dropping records until it "
                    "drains (training continues)",
                    self._q.maxsize,
                )

    def flush(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Wait until every record submitted so far reached the sinks (False: timed out)."""
        if self._thread is None or self._closed:
            return True
        deadline = time.monotonic() + timeout
        done = threading.Event()
        try:
            self._q.put(done, timeout=timeout)
        except queue.Full:
            return False
        self._wake.set()
        return done.wait(max(0.0, deadline - time.monotonic()))

    def close(self, status: Status = "completed", timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Deliver what is queued, close every sink with ``status``; give up after
        ``timeout`` seconds (the sinks are then left to the daemon thread)."""
        if self._closed:
            return
        self._closed = True
        if self._thread is None:
            return
        deadline = time.monotonic() + timeout
        try:
            self._q.put(_Stop(status), timeout=timeout)
        except queue.Full:
            log.warning("track: trackers still busy after %.0f s; not waiting", timeout)
            return
        self._wake.set()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.warning("track: trackers did not finish within %.0f s; not waiting", timeout)
        if self._dropped:
            log.warning("track: %d records were dropped (tracker queue full)", self._dropped)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(status_of(exc))

    # ----------------------------------------------------------------- tracker thread

    def _run(self) -> None:
        self._each(_nothing)
        while True:
            self._wake.wait(self._batch_s)
            self._wake.clear()  # a record put after this wakes the next wait
            if self._take_batch():
                return

    def _take_batch(self) -> bool:
        """Deliver every queued record, flush the sinks if anything was written (closing
        them at a stop), then release the ``flush`` callers waiting; True once stopped."""
        written, stopped = False, False
        waiting: list[threading.Event] = []
        while not stopped:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Stop):
                self._close_sinks(item.status)  # closing flushes
                stopped = True
            elif isinstance(item, threading.Event):
                waiting.append(item)
            elif self._deliver(item):
                written = True
        if written and not stopped:
            self._each(lambda s: s.flush(), opened_only=True)
        for done in waiting:
            done.set()
        return stopped

    def _deliver(self, record: Mapping[str, Any]) -> bool:
        """Write the record's row to every sink; False when it shows nothing."""
        try:
            row = self._prepare(record)
        except Exception as e:  # a malformed record must not stop the thread
            log.warning("track: skipped a %s record: %s", record.get("event"), e)
            return False
        if row is None:
            return False
        self._each(lambda s: s.write(row))
        return True

    def _close_sinks(self, status: Status) -> None:
        self._each(lambda s: s.close(status), opened_only=True, force=True)

    def _each(
        self, action: Callable[[Sink], object], *, opened_only: bool = False, force: bool = False
    ) -> None:
        """``action(sink)`` on every sink (opening it first unless ``opened_only``);
        ``force``: even on one that is backing off after an error."""
        for slot in self._slots:
            if slot.opened or not opened_only:
                self._call(slot, action, force)

    def _prepare(self, record: Mapping[str, Any]) -> TrackerRow | None:
        """The record's row with its step filled in (the current step when it has
        none) and, at ``run_start``, the resolved config.yaml merged into its config."""
        row = to_row(record)
        if row is None:
            return None
        if row.step is not None and row.event in ("step", "resume"):
            self._last_step = row.step if row.event == "resume" else max(row.step, self._last_step)
        changes: dict[str, Any] = {}
        if row.step is None:
            changes["step"] = self._last_step
        if row.config is not None:
            changes["config"] = {**read_config_file(self._config_file), **row.config}
        return dataclasses.replace(row, **changes) if changes else row

    def _call(self, slot: _Slot, action: Callable[[Sink], object], force: bool) -> None:
        """Open the sink if needed, then ``action(sink)``; errors are counted, logged
        and backed off, never raised."""
        now = self._clock()
        if now < slot.retry_at and not force:
            return
        try:
            if not slot.opened:
                entry = slot.sink.open(self.ids, self._resume_step)
                with self._lock:
                    self._ids = self._ids.merged(entry)
                slot.opened = True
            action(slot.sink)
        except Exception as e:
            self._failed(slot, e)
        else:
            slot.failures = 0

    def _failed(self, slot: _Slot, e: Exception) -> None:
        now = self._clock()
        slot.failures += 1
        slot.errors += 1
        backoff = min(MAX_BACKOFF_S, 2.0 ** (slot.failures - 1))
        slot.retry_at = now + backoff
        if now - slot.warned_at >= WARN_EVERY_S:
            slot.warned_at = now
            log.warning(
                "track: %s failed (%s: %s); training continues, %s is retried in %.0f s "
                "(%d errors so far; next warning in a minute at most)",
                slot.sink.name,
                type(e).__name__,
                e,
                slot.sink.name,
                backoff,
                slot.errors,
            )


def _nothing(sink: Sink) -> None:
    """``_call``'s action when only opening the sink is wanted."""


def status_of(exc: BaseException | None) -> Status:
    """How a run ended, from the exception leaving it (``SystemExit(75)``: preempted)."""
    if exc is None:
        return "completed"
    if isinstance(exc, SystemExit):
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code in RESUMABLE:
            return "preempted"
        return "completed" if code == 0 else "failed"
    return "failed"
