"""One typed timeline of a run directory, merged from every rank and every attempt.

A run directory holds rank 0's ``events.jsonl`` (which ``shoestring run`` also
appends its own records to, as rank -1) and ``ranks/rank<R>/events.jsonl`` for
the other ranks. The files are read whole, merged by time and cut into
attempts. Attempt boundaries come from the supervisor's ``attempt_start``
records when there are any (they are the only records that see an attempt
that died before its first step); without a supervisor, each ``run_start`` a
rank writes begins its next attempt.

The reader never trusts a file to be complete: a SIGKILLed writer can leave a
torn last line, a crashed one an empty file. Unparseable lines are skipped and
counted per file, so a view can say how much it could not read rather than
fail or silently pretend.
"""

from __future__ import annotations

import bisect
import json
import statistics
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoestring.events import segments
from shoestring.exitcodes import RESUMABLE
from shoestring.rundir import RunDir

#: Events that report a problem: listed in the alarms table and marked on the timeline.
#: ``alarm`` is the generic kind (its own ``kind`` field says which).
ALARM_EVENTS = frozenset(
    {
        "hang",
        "straggler",
        "alarm",
        "peer_lost",
        "gave_up",
        "checkpoint_failed",
        "checkpoint_invalid",
    }
)

SUPERVISOR_RANK = -1


@dataclass(frozen=True)
class Event:
    """One record of any kind. ``data`` is the record as written (unknown fields kept)."""

    ts: float
    kind: str
    rank: int
    attempt: int
    data: Mapping[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    @property
    def until(self) -> float:
        """The end of the moment a record covers: a ``start`` (dated at its process's
        start) lasts until it was written."""
        logged = self.data.get("ts")
        return max(self.ts, float(logged)) if isinstance(logged, (int, float)) else self.ts


@dataclass(frozen=True)
class Step:
    ts: float
    rank: int
    attempt: int
    step: int
    step_ms: float | None
    loss: float | None
    tokens: int | None
    tokens_per_s: float | None
    #: time in collectives during the step, when the step record carries it
    comm_ms: float | None = None


@dataclass(frozen=True)
class Attempt:
    index: int
    start: float
    end: float | None  # None: still running, or its end was never logged
    exit_code: int | None
    hung: bool = False
    restart_reason: str | None = None  # why the *next* attempt was started


@dataclass(frozen=True)
class Alarm:
    """Any problem report, normalized: what, who, where, in one line."""

    ts: float
    kind: str  # "hang/stuck_rank", "straggler", "comm_degraded", "gave_up", ...
    ranks: tuple[int, ...]
    message: str
    attempt: int
    collective: str = ""
    event: Event | None = None


@dataclass(frozen=True)
class MetricSample:
    """One value of one ``metrics`` series: ``series`` is e.g. ``cpu_pct``, ``owner`` a
    rank (``rank 1``), a GPU (``gpu 0``) or ``host``."""

    ts: float
    series: str
    owner: str
    value: float


@dataclass
class SourceFile:
    path: Path
    lines: int = 0
    skipped: int = 0


@dataclass
class Timeline:
    run_dir: Path
    events: list[Event] = field(default_factory=list)
    sources: list[SourceFile] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)

    # ------------------------------------------------------------------ selections
    def of(self, *kinds: str) -> list[Event]:
        return [e for e in self.events if e.kind in kinds]

    @property
    def skipped_lines(self) -> int:
        return sum(s.skipped for s in self.sources)

    @property
    def t0(self) -> float | None:
        return self.events[0].ts if self.events else None

    @property
    def t1(self) -> float | None:
        return self.events[-1].ts if self.events else None

    @property
    def wall_s(self) -> float:
        return (self.t1 - self.t0) if self.events else 0.0  # type: ignore[operator]

    @property
    def run_start(self) -> Event | None:
        """The latest ``run_start`` (model, world size, ... of the attempt that counts)."""
        starts = [e for e in self.of("run_start") if e.rank in (0, SUPERVISOR_RANK)] or self.of(
            "run_start"
        )
        return starts[-1] if starts else None

    @property
    def run_id(self) -> str:
        for e in reversed(self.events):
            rid = e.get("run_id")
            if rid and rid != "supervisor":
                return str(rid)
        try:
            return str(json.loads(RunDir(self.run_dir).run_json.read_text())["run_id"])
        except (OSError, ValueError, KeyError, TypeError):
            return "?"

    @property
    def world_size(self) -> int:
        rs = self.run_start
        ws = int(rs.get("world_size") or 1) if rs else 1
        return max([ws] + [r + 1 for r in self.ranks])

    @property
    def ranks(self) -> list[int]:
        return sorted({e.rank for e in self.events if e.rank >= 0})

    def steps(self) -> dict[int, list[Step]]:
        """Step records per rank, in time order (redone steps after a resume appear again)."""
        out: dict[int, list[Step]] = {}
        for e in self.of("step"):
            out.setdefault(e.rank, []).append(
                Step(
                    ts=e.ts,
                    rank=e.rank,
                    attempt=e.attempt,
                    step=int(e.get("step", 0)),
                    step_ms=_num(e.get("step_ms")),
                    loss=_num(e.get("loss")),
                    tokens=_int(e.get("tokens")),
                    tokens_per_s=_num(e.get("tokens_per_s")),
                    comm_ms=_num(e.get("comm_ms")),
                )
            )
        return out

    def last_step(self) -> int:
        steps = [int(e.get("step", 0)) for e in self.of("step")]
        return max(steps) if steps else 0

    def checkpoints(self) -> list[Event]:
        """Committed checkpoints (rank 0's record: one per save, whatever the world size)."""
        cks = self.of("checkpoint")
        rank0 = [e for e in cks if e.rank == 0]
        return rank0 or cks

    def preemptions(self) -> list[Event]:
        """One record per preempted attempt: its ``preempt`` event, or the supervisor's
        ``attempt_end`` with exit 75 when the job died before it could log one."""
        out: dict[int, Event] = {}
        for e in self.of("preempt"):
            out.setdefault(e.attempt, e)
        for e in self.of("attempt_end"):
            if e.get("exit_code") in RESUMABLE and e.attempt not in out:
                out[e.attempt] = e
        return sorted(out.values(), key=lambda e: e.ts)

    def restarts(self) -> list[Event]:
        return self.of("restart")

    def alarms(self) -> list[Alarm]:
        return [to_alarm(e) for e in self.events if e.kind in ALARM_EVENTS]

    def metrics(self) -> list[MetricSample]:
        out: list[MetricSample] = []
        for e in self.of("metrics"):
            out.extend(metric_samples(e))
        return out

    def final_loss(self) -> float | None:
        losses = [e for e in self.of("step") if e.get("loss") is not None]
        if not losses:
            return None
        top = max(int(e.get("step", 0)) for e in losses)
        return _num([e for e in losses if int(e.get("step", 0)) == top][-1].get("loss"))

    def final_eval(self) -> Event | None:
        evals = [e for e in self.of("eval") if e.get("loss") is not None]
        return evals[-1] if evals else None


# ---------------------------------------------------------------------- reading
def event_files(run_dir: Path) -> list[Path]:
    """Earlier attempts' logs from other machines (``attempts/``), rank 0's log, then
    every other rank's, in rank order; each with its rotated segments
    (``events.N.jsonl``) first, oldest first."""
    rd = RunDir(run_dir)
    # Attempts on other machines (a managed spot job's earlier ones), copied from the bucket.
    files = sorted(rd.attempts.glob("*.jsonl")) + segments(rd.events)
    rank_files = []
    for p in rd.event_files()[1:]:
        try:
            rank_files.append((int(p.parent.name[4:]), p))
        except ValueError:
            continue
    for _, p in sorted(rank_files):
        files += segments(p)
    return [p for p in files if p.is_file()]


def read_lines(path: Path) -> tuple[list[dict[str, Any]], SourceFile]:
    """Parse one JSONL file; count (and skip) lines that are not a JSON object."""
    src = SourceFile(path)
    return list(records(path, src)), src


def records(path: Path, src: SourceFile, containing: bytes = b"") -> Iterator[dict[str, Any]]:
    """The records of one JSONL file, a line at a time (never the whole file in memory);
    lines that are not an event record are counted in ``src`` and skipped. With
    ``containing``, only lines holding those bytes are parsed (a cheap first pass)."""
    try:
        f = open(path, "rb")
    except OSError:
        return
    with f:
        for line in f:
            if containing and containing not in line:
                continue
            if not line.strip():
                continue
            src.lines += 1
            try:
                rec = json.loads(line.decode("utf-8", "replace"))
            except json.JSONDecodeError:
                src.skipped += 1
                continue
            if (
                not isinstance(rec, dict)
                or "event" not in rec
                or not isinstance(rec.get("ts"), (int, float))
            ):
                src.skipped += 1
                continue
            yield rec


#: The records a process writes first, in this order, before its first step.
ATTEMPT_OPENERS = ("start", "resume", "run_start")


def load_phase_text(r: Mapping[str, Any]) -> str:
    """A ``load`` record in words: ``model 412.3 s (read 98.1 s, quantize 301.0 s, from
    model_dir)``."""
    parts = [
        f"{k.removesuffix('_s')} {float(r[k]):.1f} s"
        for k in ("verify_s", "read_s", "quantize_s", "save_s")
        if isinstance(r.get(k), (int, float)) and (r[k] or k == "read_s")
    ]
    if r.get("source"):
        parts.append(f"from {r['source']}")
    detail = f" ({', '.join(parts)})" if parts else ""
    return f"{r.get('phase', '?')} {float(r.get('seconds') or 0):.1f} s{detail}"


def _happened(r: Mapping[str, Any]) -> float:
    """When a record's moment was: its time, except ``start``, which stands for the
    process start it carries (interpreter, imports and loading count in the attempt)."""
    ts = float(r["ts"])
    began = r.get("process_start") if r["event"] == "start" else None
    return min(ts, float(began)) if isinstance(began, (int, float)) else ts


class AttemptIndex:
    """Which attempt each record belongs to. With a supervisor, its ``attempt_start``
    records bound the attempts by time. Without one, a process logs ``start``, ``resume``
    (if it loaded a checkpoint), then ``run_start`` (logs before 2026-12-06 have no
    ``start``): ``start`` always begins a rank's next attempt (a process killed while
    loading ends one without a ``run_start``); the others begin one unless an opener came
    before them. Records are given in each rank's written order."""

    def __init__(self, supervisor_starts: Iterable[tuple[float, int]]) -> None:
        self._starts = sorted(supervisor_starts)
        self._times = [t for t, _ in self._starts]
        self._count: dict[int, int] = {}
        self._opened: dict[int, bool] = {}

    @property
    def supervised(self) -> bool:
        return bool(self._starts)

    def of(self, r: Mapping[str, Any], rank: int) -> int:
        if self._starts:
            i = bisect.bisect_right(self._times, float(r["ts"])) - 1
            return self._starts[max(i, 0)][1]
        if r["event"] in ATTEMPT_OPENERS:
            if r["event"] == "start" or not self._opened.get(rank, False):
                self._count[rank] = self._count.get(rank, -1) + 1
            self._opened[rank] = r["event"] != "run_start"
        return max(self._count.get(rank, 0), 0)


def _is_supervisor_start(r: Mapping[str, Any]) -> bool:
    return r["event"] == "attempt_start" and _int(r.get("rank")) == SUPERVISOR_RANK


def _event(r: Mapping[str, Any], index: AttemptIndex) -> Event:
    rank = _int(r.get("rank"))
    rank = 0 if rank is None else rank
    data = {k: v for k, v in r.items() if k not in ("_order", "_ts")}
    return Event(
        ts=_happened(r), kind=str(r["event"]), rank=rank, attempt=index.of(r, rank), data=data
    )


def load(run_dir: str | Path) -> Timeline:
    """Read every event log of ``run_dir`` into one :class:`Timeline`, merged by time."""
    run_dir = Path(run_dir)
    tl = Timeline(run_dir)
    raw: list[dict[str, Any]] = []
    for i, path in enumerate(event_files(run_dir)):
        recs, src = read_lines(path)
        tl.sources.append(src)
        for seq, r in enumerate(recs):
            r.setdefault("rank", 0)
            raw.append({**r, "_order": (i, seq), "_ts": _happened(r)})
    raw.sort(key=lambda r: (r["_ts"], r["_order"]))
    index = AttemptIndex(
        (float(r["ts"]), int(r.get("attempt", 0))) for r in raw if _is_supervisor_start(r)
    )
    tl.events = [_event(r, index) for r in raw]
    tl.attempts = _attempts(tl.events, index.supervised)
    return tl


def stream(run_dir: str | Path) -> Iterator[Event]:
    """Every record of ``run_dir``'s logs as an :class:`Event`, file by file in written
    order (not merged by time), holding one record at a time: for folds over a long
    history (the end-of-run cost ledger). Two passes: the supervisor's attempt bounds
    first (only lines that name ``attempt_start`` are parsed), then everything."""
    files = event_files(Path(run_dir))
    starts = [
        (float(r["ts"]), int(r.get("attempt", 0)))
        for path in files
        for r in records(path, SourceFile(path), containing=b"attempt_start")
        if _is_supervisor_start(r)
    ]
    index = AttemptIndex(starts)
    for path in files:
        for r in records(path, SourceFile(path)):
            yield _event(r, index)


def _attempts(events: list[Event], supervised: bool) -> list[Attempt]:
    if not events:
        return []
    by_index: dict[int, dict[str, Any]] = {}
    for e in events:
        a = by_index.setdefault(
            e.attempt,
            {"start": e.ts, "end": None, "exit_code": None, "hung": False, "reason": None},
        )
        a["start"] = min(a["start"], e.ts)
        if e.kind == "attempt_end":
            a["end"], a["exit_code"], a["hung"] = (
                e.ts,
                _int(e.get("exit_code")),
                bool(e.get("hung")),
            )
        elif e.kind == "run_end" and not supervised:
            a["end"], a["exit_code"] = e.ts, 0
    for e in events:  # "restart" carries the index of the attempt it starts
        if e.kind == "restart" and _int(e.get("attempt")) is not None:
            prev = by_index.get(int(e.get("attempt")) - 1)
            if prev is not None:
                prev["reason"] = e.get("reason")
    out = []
    for i, a in sorted(by_index.items()):
        end = a["end"]
        if end is None and not supervised:  # last record of the attempt is the best we know
            end = max(e.until for e in events if e.attempt == i)
        out.append(
            Attempt(
                index=i,
                start=a["start"],
                end=end,
                exit_code=a["exit_code"],
                hung=a["hung"],
                restart_reason=a["reason"],
            )
        )
    return out


# ---------------------------------------------------------------------- normalizing
def to_alarm(e: Event) -> Alarm:
    """One line per problem, whichever component reported it."""
    d = e.data
    ranks: tuple[int, ...] = ()
    coll = ""
    if e.kind == "hang":
        kind = f"hang/{d.get('kind', '?')}"
        ranks = tuple(int(r) for r in d.get("culprits") or ())
        msg = str(d.get("summary") or "")
        c = d.get("collective") or {}
        if isinstance(c, dict) and c.get("op"):
            coll = f"{c.get('op')} #{c.get('seq', '?')}"
        if d.get("detected_after_s") is not None:
            msg += f" (caught after {float(d['detected_after_s']):.1f} s)"
    elif e.kind == "straggler":
        kind = "straggler"
        ranks = _ranks(d.get("rank"))
        slower = _num(d.get("slower_by"))
        msg = (
            f"{d.get('part', '?')} work per step "
            f"{'+' + format(slower, '.0%') if slower is not None else '?'} vs peers"
            f" at step {d.get('step', '?')}"
        )
    elif e.kind == "alarm":
        kind = str(d.get("kind") or "alarm")
        ranks = _ranks(d.get("rank", d.get("ranks")))
        msg = str(d.get("message") or d.get("summary") or _kv(d))
    elif e.kind == "peer_lost":
        kind = "peer_lost"
        ranks = _ranks(list(d.get("ranks") or ()))
        msg = str(d.get("summary") or "")
    elif e.kind == "gave_up":
        kind = "gave_up"
        msg = (
            f"out of restarts after {d.get('attempts', '?')} attempt(s), exit {d.get('exit_code')}"
        )
    else:  # checkpoint_failed, checkpoint_invalid
        kind = e.kind
        ranks = () if e.rank < 0 else (e.rank,)
        msg = f"step {d.get('step', '?')}: {d.get('error', '')}".strip()
    return Alarm(
        ts=e.ts, kind=kind, ranks=ranks, message=msg, attempt=e.attempt, collective=coll, event=e
    )


#: ``metrics`` fields plotted, per owner: (series name, unit scale).
METRIC_FIELDS = (
    "cpu_pct",
    "rss_bytes",
    "util_pct",
    "mem_used_bytes",
    "mem_util_pct",
    "temp_c",
    "power_w",
    "sm_clock_mhz",
    "load1",
)


def metric_samples(e: Event) -> Iterable[MetricSample]:
    """Flatten a ``metrics`` record: ``ranks`` {rank: {...}}, ``gpus`` [{gpu: i, ...}],
    ``host`` {...}; anything missing is simply absent."""
    d = e.data
    ranks = d.get("ranks")
    if isinstance(ranks, dict):
        for r, vals in ranks.items():
            yield from _fields(e.ts, f"rank {r}", vals)
    gpus = d.get("gpus")
    if isinstance(gpus, list):
        for i, vals in enumerate(gpus):
            if isinstance(vals, dict):
                yield from _fields(e.ts, f"gpu {vals.get('gpu', i)}", vals)
    if isinstance(d.get("host"), dict):
        yield from _fields(e.ts, "host", d["host"])


def _fields(ts: float, owner: str, vals: Any) -> Iterable[MetricSample]:
    if not isinstance(vals, dict):
        return
    for k in METRIC_FIELDS:
        v = _num(vals.get(k))
        if v is not None:
            yield MetricSample(ts, k, owner, v)


def median(xs: Iterable[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if x == x else None  # NaN is absent


def _int(x: Any) -> int | None:
    try:
        return int(x)
    except (TypeError, ValueError):
        return None


def _ranks(x: Any) -> tuple[int, ...]:
    """The rank(s) a record is about; -1 (the supervisor writing it) is about no rank."""
    if isinstance(x, list):
        return tuple(int(r) for r in x if _int(r) is not None and int(r) >= 0)
    r = _int(x)
    return () if r is None or r < 0 else (r,)


def _kv(d: Mapping[str, Any]) -> str:
    skip = {"v", "ts", "event", "run_id", "rank", "kind"}
    return ", ".join(
        f"{k}={v}" for k, v in d.items() if k not in skip and not isinstance(v, (dict, list))
    )
