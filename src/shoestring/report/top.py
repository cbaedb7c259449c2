"""``shoestring top``: a live terminal view of a run directory.

Reads files only — the event logs (incrementally: each refresh parses just the
lines appended since the last one) and the ranks' ``live.json`` snapshots — and
never signals or connects to the training processes, so it is safe to run
anywhere the run directory is visible (another shell, a login node reading a
shared file system) and costs the job nothing.
"""

from __future__ import annotations

import datetime as _dt
import heapq
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from shoestring.report.live import Tail, read_live
from shoestring.report.timeline import (
    ALARM_EVENTS,
    SUPERVISOR_RANK,
    Alarm,
    Event,
    load_phase_text,
    to_alarm,
)
from shoestring.rundir import RunDir

#: A running rank whose snapshot is older than this is shown as stale.
STALE_S = 5.0
#: Step times kept per rank for the median.
WINDOW = 50

RED, YELLOW, GREEN, DIM, BOLD, RESET = (
    "\x1b[31m",
    "\x1b[33m",
    "\x1b[32m",
    "\x1b[2m",
    "\x1b[1m",
    "\x1b[0m",
)


@dataclass
class RankState:
    step: int | None = None
    step_ts: float | None = None
    step_ms: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    alarms: list[str] = field(default_factory=list)  # kinds, current attempt
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class JobState:
    attempt: int = 0
    attempt_ts: float | None = None
    restarts: int = 0
    last_restart: str | None = None
    preemptions: int = 0
    checkpoint: tuple[int, float] | None = None  # (step, ts)
    status: str = "starting"
    ended: bool = False  # the current attempt is over (its ranks publish no more)
    run_id: str = "?"
    model: str = ""
    world_size: int = 0
    strategy: str = ""
    max_steps: int | None = None
    alarms: deque[Alarm] = field(default_factory=lambda: deque(maxlen=20))
    gpus: dict[str, dict[str, float]] = field(default_factory=dict)
    started: float | None = None  # this attempt's process start (rank 0)
    loads: list[str] = field(default_factory=list)  # its load phases so far


class Top:
    """Follows one run directory; :meth:`poll` reads what is new, :meth:`frame` draws."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.tails: dict[Path, Tail] = {}
        self.job = JobState()
        self.ranks: dict[int, RankState] = {}

    # ------------------------------------------------------------------ reading
    def _files(self) -> list[Path]:
        return [p for p in RunDir(self.run_dir).event_files() if p.is_file()]

    def poll(self) -> None:
        # Each file is in its writer's order, which wins over its timestamps (a wall
        # clock stepped back must not put a supervisor's attempt_end after its gave_up);
        # the files are merged by time.
        news = [self.tails.setdefault(p, Tail(p)).read() for p in self._files()]
        recs = heapq.merge(*news, key=lambda r: float(r.get("ts", 0) or 0))
        for r in recs:
            try:
                self._apply(r)
            except (TypeError, ValueError, KeyError):
                continue  # a record of an unexpected shape must not stop the view

    @property
    def skipped(self) -> int:
        return sum(t.skipped for t in self.tails.values())

    def _rank(self, r: int) -> RankState:
        return self.ranks.setdefault(r, RankState())

    def _apply(self, r: dict[str, Any]) -> None:
        kind, rank, ts = str(r["event"]), int(r.get("rank", 0)), float(r["ts"])
        job = self.job
        if r.get("run_id") and r["run_id"] != "supervisor":
            job.run_id = str(r["run_id"])
        if kind == "attempt_start" and rank == SUPERVISOR_RANK:
            job.attempt, job.attempt_ts, job.status = int(r.get("attempt", 0)), ts, "starting"
            job.ended = False
            for st in self.ranks.values():
                st.alarms.clear()
        elif kind == "attempt_end":
            job.ended = True
            code = r.get("exit_code")
            if code != 0 or job.status != "completed":
                job.status = f"attempt exited {code}"
        elif kind == "restart":
            job.restarts += 1
            job.last_restart = str(r.get("reason", ""))
        elif kind == "start" and rank == 0:
            began = r.get("process_start")
            job.started = float(began) if isinstance(began, (int, float)) else ts
            job.loads = []
            job.status = "loading"
        elif kind == "load" and rank == 0:
            job.loads.append(load_phase_text(r))
        elif kind == "run_start":
            st = self._rank(rank)
            st.step_ms.clear()
            job.status = "running"
            if rank == 0:  # every rank writes one; rank 0's speaks for the job
                job.model = str(r.get("model", "")).rstrip("/").split("/")[-1]
                job.world_size = int(r.get("world_size") or 1)
                job.strategy = str(r.get("strategy", ""))
                job.max_steps = r.get("max_steps")
        elif kind == "step":
            st = self._rank(rank)
            st.step, st.step_ts = int(r["step"]), ts
            if isinstance(r.get("step_ms"), (int, float)):
                st.step_ms.append(float(r["step_ms"]))
        elif kind == "checkpoint" and rank in (0, SUPERVISOR_RANK):
            job.checkpoint = (int(r.get("step", 0)), ts)
        elif kind == "preempt" and rank in (0, SUPERVISOR_RANK):
            job.preemptions += 1
            job.status = "preempted"
        elif kind == "run_end":
            job.status = "completed"
        elif kind == "gave_up":
            job.status = "gave up"
        elif kind == "metrics":
            self._metrics(r)
        if kind in ALARM_EVENTS:
            alarm = to_alarm(Event(ts=ts, kind=kind, rank=rank, attempt=job.attempt, data=r))
            job.alarms.append(alarm)
            for ar in alarm.ranks:
                self._rank(ar).alarms.append(alarm.kind)

    def _metrics(self, r: dict[str, Any]) -> None:
        for rk, vals in (r.get("ranks") or {}).items():
            if isinstance(vals, dict):
                self._rank(int(rk)).metrics = {
                    k: float(v) for k, v in vals.items() if isinstance(v, (int, float))
                }
        for g in r.get("gpus") or []:
            if isinstance(g, dict):
                self.job.gpus[str(g.get("gpu", "?"))] = {
                    k: float(v) for k, v in g.items() if isinstance(v, (int, float))
                }

    # ------------------------------------------------------------------ drawing
    def frame(self, now: float, width: int = 120, color: bool = False) -> str:
        """One screen of text (no cursor movement)."""
        live = read_live(self.run_dir)
        job = self.job

        def c(code: str, s: str) -> str:
            return f"{code}{s}{RESET}" if color else s

        clock = _dt.datetime.fromtimestamp(now, _dt.timezone.utc).strftime("%H:%M:%S UTC")
        world = job.world_size or len(live) or len(self.ranks)
        head = (
            f"shoestring top  {self.run_dir}  run {job.run_id}  {job.model}  "
            f"{world} rank(s){' ' + job.strategy if job.strategy else ''}"
        )
        lines = [c(BOLD, head) + "  " + clock]
        steps = [s.step for s in self.ranks.values() if s.step is not None]
        ck = (
            f"step {job.checkpoint[0]}, {_ago(now - job.checkpoint[1])} ago"
            if job.checkpoint
            else "none"
        )
        status = job.status
        if status in ("gave up", "preempted") or status.startswith("attempt exited"):
            status = c(RED, status)
        restarts = f"{job.restarts}" + (f" (last: {job.last_restart})" if job.last_restart else "")
        lines.append(
            f"job  attempt {job.attempt} | restarts {restarts} | preemptions "
            f"{job.preemptions} | step {max(steps) if steps else '-'}"
            f"/{job.max_steps or '?'} | last checkpoint {ck} | {status}"
        )
        lines += self._load_line(now)
        show_metrics = any(s.metrics for s in self.ranks.values())
        hdr = (
            f"{'RANK':>4}  {'STATUS':<9} {'PHASE':<22} {'STEP':>6} {'LAST ms':>8} "
            f"{'MED ms':>7} {'NO PROGRESS':>11}  {'COLLECTIVE IN FLIGHT':<28}"
        )
        if show_metrics:
            hdr += f" {'CPU%':>5} {'RSS':>7}"
        lines.append(c(DIM, hdr + "  ALARMS"))  # (ALARMS last: it is the ragged column)
        for rank in sorted(set(live) | set(self.ranks)):
            lines.append(self._rank_line(rank, live.get(rank), now, show_metrics, c))
        for gpu, g in sorted(job.gpus.items()):
            mem = ""
            if "mem_used_bytes" in g:
                mem = (
                    f"{g['mem_used_bytes'] / 2**30:.1f}/"
                    f"{g.get('mem_total_bytes', 0) / 2**30:.0f} GiB"
                )
            util = f"{g['util_pct']:.0f}% util" if "util_pct" in g else ""
            lines.append(f"gpu {gpu}  {util}  {mem}".rstrip())
        if job.alarms:
            lines.append(c(DIM, "alarms (latest last)"))
            for a in list(job.alarms)[-5:]:
                when = _dt.datetime.fromtimestamp(a.ts, _dt.timezone.utc).strftime("%H:%M:%S")
                who = f"rank {','.join(map(str, a.ranks))}" if a.ranks else "job"
                coll = f"  [{a.collective}]" if a.collective else ""
                lines.append(c(RED, f"  {when}  {a.kind}  {who}{coll}  {a.message}"))
        if self.skipped:
            lines.append(c(DIM, f"({self.skipped} unreadable event line(s) skipped)"))
        return "\n".join(_clip(line.rstrip(), width) for line in lines) + "\n"

    def _load_line(self, now: float) -> list[str]:
        """The current attempt's process start and its load phases so far."""
        if self.job.started is None:
            return []
        phases = " | ".join(self.job.loads) if self.job.loads else "..."
        return [f"load  process started {_ago(now - self.job.started)} ago | {phases}"]

    def _rank_line(
        self,
        rank: int,
        snap: dict[str, Any] | None,
        now: float,
        show_metrics: bool,
        c: Callable[[str, str], str],
    ) -> str:
        st = self.ranks.get(rank, RankState())
        job = self.job
        fresh = snap is not None and (
            job.attempt_ts is None or float(snap.get("ts", 0)) >= job.attempt_ts - 1
        )
        status, phase, coll = "-", "-", ""
        step = st.step
        if snap is not None and fresh:
            status = str(snap.get("status", "?"))
            seen = float(snap.get("ts", now))
            at = now  # durations run to now while the rank publishes, else to its last word
            if status == "running" and now - seen > STALE_S:
                status, at = ("gone" if job.ended else "stale"), seen
            in_phase = (
                at - float(snap.get("phase_start", at))
                if status in ("running", "stale", "gone")
                else 0
            )
            phase = str(snap.get("phase", "?")) + (f" {in_phase:.1f}s" if in_phase >= 0.05 else "")
            step = max(step or 0, int(snap.get("step") or 0))
            open_ = snap.get("open_collectives") or []
            if open_:
                o = open_[0]
                coll = f"{o.get('op')} #{o.get('seq')} {at - float(o.get('start', at)):.1f}s"
        elif snap is not None:
            status = "previous"
        last = st.step_ms[-1] if st.step_ms else None
        med = statistics.median(st.step_ms) if st.step_ms else None
        idle = now - st.step_ts if st.step_ts is not None and status == "running" else None
        text_status = f"{status:<9}"
        if status in ("stale", "failed", "gone"):
            text_status = c(RED, text_status)
        elif status == "running":
            text_status = c(GREEN, text_status)
        idle_s = f"{_ago(idle):>11}" if idle is not None else f"{'-':>11}"
        if idle is not None and med and idle > max(3 * med / 1e3, 10):
            idle_s = c(YELLOW, idle_s)
        line = (
            f"{rank:>4}  {text_status} {phase:<22.22} {step if step is not None else '-':>6} "
            f"{_ms(last):>8} {_ms(med):>7} {idle_s}  {coll:<28.28}"
        )
        if show_metrics:
            m = st.metrics
            line += f" {m['cpu_pct']:>5.0f}" if "cpu_pct" in m else f" {'-':>5}"
            line += f" {m['rss_bytes'] / 2**30:>5.1f}Gi" if "rss_bytes" in m else f" {'-':>7}"
        alarms = ", ".join(dict.fromkeys(st.alarms))
        return (line + ("  " + c(RED, alarms) if alarms else "")).rstrip()


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _ago(s: float) -> str:
    s = max(0.0, s)
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def _clip(line: str, width: int) -> str:
    """Cut to ``width`` visible characters, keeping ANSI codes intact."""
    out, n, i = [], 0, 0
    while i < len(line):
        if line[i] == "\x1b":
            j = line.find("m", i)
            if j < 0:
                break
            out.append(line[i : j + 1])
            i = j + 1
            continue
        if n >= width:
            break
        out.append(line[i])
        n += 1
        i += 1
    s = "".join(out)
    return s + RESET if "\x1b" in s and not s.endswith(RESET) else s


def run_top(
    run_dir: Path,
    *,
    once: bool,
    interval_s: float,
    color: bool,
    width: Callable[[], int],
    out: TextIO | None = None,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Draw frames until interrupted (or one with ``once``)."""
    out = out or sys.stdout
    top = Top(run_dir)
    if once:
        top.poll()
        out.write(top.frame(clock(), width(), color))
        return 0
    try:
        out.write("\x1b[?25l")  # hide the cursor
        while True:
            top.poll()
            out.write("\x1b[H\x1b[2J" + top.frame(clock(), width(), color))
            out.flush()
            sleep(interval_s)
    except KeyboardInterrupt:
        return 0
    finally:
        out.write("\x1b[?25h")
        out.flush()
