"""PyTorch's NCCL Flight Recorder, attached to a hang verdict.

Every NCCL process group keeps a ring of its last collectives (op, sequence
number, sizes, state: scheduled / started / completed) in the rank's memory:
PyTorch's *flight recorder*. ``shoestring run`` turns it on in the ranks'
environment (:func:`flight_recorder_env`) and, on a hang verdict, asks every
rank of this host to dump it (:func:`collect_traces`) before the job is killed,
so the verdict says which collective each rank's communicator was stuck in,
below the Python-level trace of :mod:`shoestring.watch.recorder`.

The variables, as read by torch 2.13 (``torch/csrc/distributed/c10d``):

* ``TORCH_NCCL_TRACE_BUFFER_SIZE``: entries in the ring (``ProcessGroupNCCL.hpp``;
  ``FlightRecorder.hpp`` reads ``TORCH_FR_BUFFER_SIZE`` first, then this one and
  warns it is deprecated). The dump pipe exists only when it is > 0; 2000 by
  default since 2.13, 0 before, so it is set for older releases only.
* ``TORCH_NCCL_DUMP_ON_TIMEOUT``: torch dumps by itself when a collective times
  out; it also makes the heartbeat-monitor thread poll the dump pipe every
  ``TORCH_NCCL_COORD_CHECK_MILSEC`` (1 s) instead of every heartbeat timeout (8 min).
* ``TORCH_FR_DUMP_TEMP_FILE`` (formerly ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``, still
  read second): the dump goes to ``<prefix><global rank>``, written in place (not
  atomically) by ``DebugInfoWriter::write`` (``FlightRecorder.cpp``).
* ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``: the default group (uid 0) of each rank
  creates the FIFO ``<prefix><global rank>.pipe`` (``DumpPipe`` in
  ``ProcessGroupNCCL.hpp``: unlink, ``mkfifo``, opened ``O_RDONLY|O_NONBLOCK``);
  any bytes written to it make the rank dump, and training goes on.

Under gloo there is no pipe (its flight recorder can only be dumped from inside
the process), and nothing is waited for. Cost of a verdict: at most ``wait_s``
more before the kill, and only when some rank of this host read the request
(torch polls its pipe every second, so a dump usually lands within 1-2 s), plus
reading the dumps (each summarised only under 64 MiB). The dump
is a pickle (torch's C++ pickler, no class references) of a dict with
``version``, ``pg_config``, ``pg_status`` and ``entries``; it is read here with
an unpickler that refuses every global, not with torch's
``flight_recorder.components.loader.read_dump`` (a plain ``pickle.load``, and
importing torch would cost the supervisor seconds at the worst moment).
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoestring.rundir import RunDir

#: Names under the run directory: dumps beside the verdicts, pipes beside the ranks' state.
TRACE_NAME = "nccl_trace_rank_"
PIPE_NAME = "nccl_pipe_rank_"
BUFFER_ENTRIES = 2000
MAX_PARSE_BYTES = 64 << 20  # a larger dump is attached but not summarised

Sig = tuple[int, int]  # (mtime_ns, size) of a dump file


def records_by_default(torch_version: str | None) -> bool:
    """Whether this torch keeps a 2000-entry ring and makes the dump pipe without
    ``TORCH_NCCL_TRACE_BUFFER_SIZE`` (2.13: ``FlightRecorder.hpp``, ``ProcessGroupNCCL``);
    there, setting it only earns a deprecation warning in every rank, gloo's too.
    Older releases default to 0 (no ring, no pipe). Unknown: ``False``."""
    m = re.match(r"(\d+)\.(\d+)", torch_version or "")
    return m is not None and (int(m.group(1)), int(m.group(2))) >= (2, 13)


def installed_torch_version() -> str | None:
    """torch's version from its package metadata (no import: the supervisor stays light)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return None


def flight_recorder_env(
    env: Mapping[str, str],
    run_dir: Path,
    torch_version: str | None = None,
    buffer_size: int = BUFFER_ENTRIES,
) -> dict[str, str]:
    """The ranks' environment: ``env`` plus the flight-recorder variables it does not
    set already (a value the user set, even empty, is kept). Paths are absolute; the
    ring size is set only where ``torch_version`` needs it (:func:`records_by_default`)."""
    out = dict(env)
    root = Path(os.path.abspath(run_dir))
    if not records_by_default(torch_version):
        out.setdefault(
            "TORCH_NCCL_TRACE_BUFFER_SIZE", env.get("TORCH_FR_BUFFER_SIZE") or str(buffer_size)
        )
    out.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    if "TORCH_FR_DUMP_TEMP_FILE" not in env and "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in env:
        out["TORCH_FR_DUMP_TEMP_FILE"] = str(RunDir(root).verdicts / TRACE_NAME)
    out.setdefault("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", str(RunDir(root).ranks / PIPE_NAME))
    return out


@dataclass(frozen=True)
class TracePaths:
    """Where the ranks' dumps and pipes are (``None``: not configured)."""

    dump_prefix: str | None
    pipe_prefix: str | None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> TracePaths:
        """As torch resolves them in a rank started with ``env``."""
        dump = env.get("TORCH_FR_DUMP_TEMP_FILE")
        if dump is None:
            dump = env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
        return cls(dump or None, env.get("TORCH_NCCL_DEBUG_INFO_PIPE_FILE") or None)

    def dump(self, rank: int) -> Path | None:
        return Path(f"{self.dump_prefix}{rank}") if self.dump_prefix else None


def find_pipes(pipe_prefix: str) -> dict[int, Path]:
    """The ranks' dump FIFOs that exist now, by global rank."""
    base = Path(pipe_prefix)
    pattern = re.compile(re.escape(base.name) + r"(\d+)\.pipe")
    try:
        names = os.listdir(base.parent)
    except OSError:
        return {}
    pipes: dict[int, Path] = {}
    for name in names:
        m = pattern.fullmatch(name)
        if m is None:
            continue
        try:
            if stat.S_ISFIFO(os.stat(base.parent / name).st_mode):
                pipes[int(m.group(1))] = base.parent / name
        except OSError:
            continue
    return pipes


def poke(pipe: Path) -> str | None:
    """Ask the rank reading ``pipe`` to dump. Never blocks: ``None`` when the request
    went in, else why it could not."""
    try:
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ENXIO:
            return "no process reads its dump pipe (rank gone, or on another host)"
        return f"cannot open the dump pipe {pipe}: {e.strerror}"
    try:
        os.write(fd, b"dump\n")
    except BlockingIOError:
        return "its dump pipe is full: the rank does not read it"
    except OSError as e:
        return f"cannot write the dump pipe {pipe}: {e.strerror}"
    finally:
        os.close(fd)
    return None


def _sig(path: Path) -> Sig | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _ends_pickle(path: Path) -> bool:
    """Whether the file ends with pickle's STOP opcode (a complete dump, very likely)."""
    try:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == pickle.STOP
    except OSError:
        return False


@dataclass(frozen=True)
class Dumped:
    """What :func:`wait_for_dumps` saw of one rank's dump file."""

    sig: Sig | None  # (mtime_ns, size) of the new dump; None: no new dump
    finished: bool = False


def wait_for_dumps(
    dumps: Mapping[int, Path],
    before: Mapping[int, Sig | None],
    wait_s: float,
    *,
    poll_s: float = 0.1,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[int, Dumped]:
    """Wait until every dump is new (differs from ``before``), not empty and finished, or
    until ``wait_s`` passed. torch truncates the file and writes in place, so finished
    means unchanged over one poll and ending with pickle's STOP, or unchanged over
    five polls."""
    deadline = clock() + wait_s
    last: dict[int, Sig | None] = {r: None for r in dumps}
    stable = {r: 0 for r in dumps}
    done: set[int] = set()
    while True:
        for r, path in dumps.items():
            if r in done:
                continue
            sig = _sig(path)
            fresh = sig is not None and sig != before.get(r) and sig[1] > 0
            stable[r] = stable[r] + 1 if fresh and sig == last[r] else 0
            last[r] = sig if fresh else None
            if stable[r] >= 5 or (stable[r] >= 1 and _ends_pickle(path)):
                done.add(r)
        if len(done) == len(dumps) or clock() >= deadline:
            return {r: Dumped(last[r], r in done) for r in dumps}
        sleep(poll_s)


class _NoGlobals(pickle.Unpickler):
    """torch's C++ pickler writes dicts, lists, tuples, strings and numbers only."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused a reference to {module}.{name}")


def load_dump(path: Path, max_bytes: int = MAX_PARSE_BYTES) -> dict[str, Any]:
    """A flight-recorder dump as a dict; raises on anything else."""
    size = path.stat().st_size
    if size > max_bytes:
        raise ValueError(f"{size} bytes, over the {max_bytes}-byte limit for a summary")
    with open(path, "rb") as f:
        dump = _NoGlobals(f).load()
    if not isinstance(dump, dict) or not isinstance(dump.get("entries", []), list):
        raise ValueError("not a flight-recorder dump (no 'entries' list)")
    return dump


def _describe_entry(e: Mapping[str, Any]) -> str:
    seq = e.get("p2p_seq_id") if e.get("is_p2p") else e.get("collective_seq_id")
    pg = e.get("process_group")
    pg_name = pg[0] if isinstance(pg, (tuple, list)) and pg else e.get("pg_id", "?")
    sizes = str(e.get("input_sizes", ""))
    sizes = sizes if len(sizes) <= 60 else sizes[:57] + "..."
    return (
        f"{e.get('profiling_name', '?')} #{seq} {e.get('state', '?')} "
        f"(pg {pg_name}, input sizes {sizes})"
    )


def summarize(dump: Mapping[str, Any]) -> dict[str, Any]:
    """One line about a rank's dump: its newest entry and, if that is not it, the oldest
    entry not completed (where the rank's communicator got stuck)."""
    entries = [e for e in dump.get("entries") or [] if isinstance(e, dict)]
    version = dump.get("version", "?")
    if not entries:
        return {"summary": f"no collectives recorded (flight recorder v{version})", "entries": 0}
    last = entries[-1]
    # gloo's entries stay "scheduled" once retired: only NCCL's track start and completion.
    pending = next(
        (e for e in entries if e.get("state") != "completed" and not e.get("retired")), None
    )
    line = f"last: {_describe_entry(last)}"
    if pending is not None and pending is not last:
        line += f"; oldest not completed: {_describe_entry(pending)}"
    seq = last.get("p2p_seq_id") if last.get("is_p2p") else last.get("collective_seq_id")
    return {
        "summary": f"{line} [{len(entries)} entries, flight recorder v{version}]",
        "entries": len(entries),
        "last_collective": {
            "profiling_name": last.get("profiling_name"),
            "seq": seq,
            "state": last.get("state"),
            "process_group": last.get("process_group"),
        },
    }


def _attach(dump: Path, seen: Dumped, wait_s: float, keep_prefix: str) -> dict[str, Any]:
    """The verdict's record of one rank's dump: renamed so a later dump cannot overwrite
    it, with its size and summary; every failure becomes ``nccl_trace_error``."""
    if seen.sig is None:
        return {
            "path": None,
            "nccl_trace_error": f"no new dump at {dump} within {wait_s:g}s "
            "(flight recorder off, or the rank's NCCL monitor thread is stuck)",
        }
    kept = dump.with_name(keep_prefix + dump.name) if keep_prefix else dump
    try:
        os.replace(dump, kept)
    except OSError:
        kept = dump
    rec: dict[str, Any] = {"path": str(kept), "bytes": seen.sig[1]}
    try:
        rec.update(summarize(load_dump(kept)))
    except Exception as e:  # noqa: BLE001 - a bad dump must never fail the verdict
        rec["nccl_trace_error"] = f"cannot read the dump: {type(e).__name__}: {e}"
    if not seen.finished:
        rec["nccl_trace_error"] = f"still being written after {wait_s:g}s, may be cut short" + (
            f"; {rec['nccl_trace_error']}" if "nccl_trace_error" in rec else ""
        )
    return rec


def collect_traces(
    paths: TracePaths,
    wait_s: float,
    keep_prefix: str = "",
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, dict[str, Any]]:
    """Make every rank whose dump pipe exists dump its flight recorder; wait at most
    ``wait_s`` for the dumps. Keyed by rank (a string, as in the verdict's JSON): ``path``
    (``None`` without a dump), ``bytes``, ``summary``, or ``nccl_trace_error``. Empty
    when no rank has a pipe (gloo, or NCCL without the variables): then nothing waits."""
    if paths.pipe_prefix is None or wait_s <= 0:
        return {}
    pipes = find_pipes(paths.pipe_prefix)
    dumps = {r: d for r in pipes if (d := paths.dump(r)) is not None}
    before = {r: _sig(d) for r, d in dumps.items()}
    out: dict[str, dict[str, Any]] = {}
    asked: dict[int, Path] = {}
    for r, pipe in sorted(pipes.items()):
        why = poke(pipe)
        if why is not None:
            out[str(r)] = {"path": None, "nccl_trace_error": why}
        elif r not in dumps:
            out[str(r)] = {
                "path": None,
                "nccl_trace_error": "dump location unknown (TORCH_FR_DUMP_TEMP_FILE is empty)",
            }
        else:
            asked[r] = dumps[r]
    seen = wait_for_dumps(asked, before, wait_s, clock=clock, sleep=sleep) if asked else {}
    for r, dump in asked.items():
        out[str(r)] = _attach(dump, seen[r], wait_s, keep_prefix)
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))
