"""Each attempt's event records in the bucket, so a run's history outlives its machines.

A managed spot job (``shoestring launch``) runs every attempt on a new machine with an
empty disk: the checkpoint comes back from ``checkpoint.storage``, and so must the
event log, or the cost ledger at the end would count the last attempt only. So rank 0
keeps, beside the checkpoints, one object per attempt::

    <storage>/events/<run_id>-<start ms>-<pid>.jsonl    the records this process wrote

and a start copies the other machines' objects (another ``run_id``: each run
directory has its own) into ``OUTPUT/attempts/``, which the views read with the run's
own log (:func:`shoestring.report.timeline.event_files`). Attempts on the same disk are
already in its ``events.jsonl`` and are not copied again. An attempt's object is
rewritten whole at its start, after each save, after a step once a minute
(:data:`PUSH_EVERY_S`), and at its end (preempted or done): the bytes it appended to
``events.jsonl``, so nothing is counted twice; a SIGKILL without notice loses at most
its last minute of records (the steps it would count as lost among them).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from shoestring.checkpoint.remote import RemoteStore
from shoestring.rundir import RunDir

log = logging.getLogger("shoestring.checkpoint")

#: Folder under checkpoint.storage holding one event-log object per attempt.
EVENTS_DIR = "events"
#: Seconds between uploads at step boundaries (one small PUT; saves and ends upload too).
PUSH_EVERY_S = 60.0


class AttemptLog:
    """This attempt's share of ``events.jsonl`` (from ``offset`` on), mirrored as
    ``<storage>/events/<key>.jsonl``."""

    def __init__(self, remote: RemoteStore, log_path: Path, key: str, offset: int) -> None:
        self.remote = remote
        self.log_path = log_path
        self.key = key
        self.offset = offset
        self._warned = False
        self._pushed_at: float | None = None  # time.monotonic() of the last upload

    @classmethod
    def open(cls, remote: RemoteStore, run_dir: RunDir, run_id: str) -> AttemptLog:
        """Before this attempt writes its first record: where its records will begin,
        and the other machines' attempts copied into ``run_dir.attempts``."""
        offset = run_dir.events.stat().st_size if run_dir.events.exists() else 0
        key = f"{run_id}-{int(time.time() * 1000):013d}-{os.getpid()}"
        attempts = cls(remote, run_dir.events, key, offset)
        attempts.pull(run_dir.attempts, run_id)
        return attempts

    def pull(self, into: Path, run_id: str) -> list[Path]:
        """Copy the attempts of other run directories (other machines) into ``into``."""
        got = []
        try:
            names = self.remote.list_files(EVENTS_DIR)
            for name in names:
                if not name.endswith(".jsonl") or (run_id and name.startswith(f"{run_id}-")):
                    continue
                into.mkdir(parents=True, exist_ok=True)
                tmp = into / f".{name}.part"
                self.remote.get_file(f"{EVENTS_DIR}/{name}", tmp)
                os.replace(tmp, into / name)
                got.append(into / name)
        except Exception as e:  # noqa: BLE001 - the history must never stop a run
            log.warning("earlier attempts' event logs not copied from %s: %s", self.remote.url, e)
        return got

    def due(self, every_s: float) -> bool:
        """Whether ``every_s`` seconds have passed since the last upload (0: always)."""
        last = self._pushed_at
        return not every_s or last is None or time.monotonic() - last >= every_s

    def push(self) -> None:
        """Upload this attempt's records so far (the whole object, rewritten)."""
        self._pushed_at = time.monotonic()
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
            self.remote.put_file(f"{EVENTS_DIR}/{self.key}.jsonl", data)
        except Exception as e:  # noqa: BLE001 - the history must never stop a run
            if not self._warned:
                log.warning("event log not copied to %s: %s", self.remote.url, e)
                self._warned = True


def fetch_attempts(storage: str, run_dir: Path) -> list[Path]:
    """Every attempt's event log under ``storage`` (a finished managed job's bucket,
    its machines gone) copied into ``run_dir/attempts/``: a run directory the views read."""
    remote = RemoteStore(storage)
    reader = AttemptLog(remote, RunDir(run_dir).events, "", 0)
    return reader.pull(RunDir(run_dir).attempts, run_id="")
