"""The per-rank recorder: what this rank is doing right now, published out of band.

A :class:`Recorder` lives in the training process. The training thread marks
phases (``with rec.phase("train_step"):``) and the recorder traces collectives:
Python-level ``torch.distributed`` calls on the default group, FSDP2's included (while
:meth:`Recorder.trace_collectives` is active) and DDP's gradient all-reduces
(through a DDP communication hook, :meth:`Recorder.ddp_comm_hook`). Each
collective gets a per-rank sequence number, so ranks can be compared: the
N-th collective of every rank must be the same op on the same shapes.

Nothing here talks to other ranks. A daemon thread writes a small JSON
snapshot (``ranks/rank<R>/live.json``, atomically replaced) every
``interval_s``; the watchdog in ``shoestring run`` reads those files. Marking a
phase or a collective only updates a few fields under a lock — it never
blocks on I/O. Memory is bounded: per-phase duration windows and a ring of the
last collectives.

``faulthandler`` is registered on :data:`STACK_SIGNAL`, so the watchdog can
ask a live rank for the Python stacks of all its threads — even when the
training thread is stuck inside a C++ collective — and read them from
``ranks/rank<R>/stacks.txt``.

Use from any PyTorch loop::

    with Recorder(run_dir, rank=dist.get_rank()) as rec, rec.trace_collectives():
        ddp.register_comm_hook(None, rec.ddp_comm_hook)
        for step in ...:
            with rec.phase("train_step"):
                ...
            rec.step_done(step)
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import json
import os
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from shoestring.checkpoint.faults import Delay
from shoestring.fsio import atomic_write
from shoestring.rundir import LIVE, RunDir

#: Signal that makes a rank dump all thread stacks (faulthandler, no ptrace needed).
STACK_SIGNAL = signal.SIGRTMIN + 3

#: torch.distributed functions traced by :meth:`Recorder.trace_collectives`.
TRACED = (
    "all_reduce",
    "broadcast",
    "barrier",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "reduce",
    "gather",
    "scatter",
    "all_to_all_single",
    "all_gather_object",
    "broadcast_object_list",
    "all_gather_single",
    "reduce_scatter_single",
)  # the last two: FSDP2's, torch >= 2.12

STACKS = "stacks.txt"


def rank_dir(run_dir: Path, rank: int) -> Path:
    return RunDir(Path(run_dir)).rank_dir(rank)


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


class Recorder:
    """One per rank. Thread-safe; cheap to call from the training thread."""

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        *,
        world_size: int = 1,
        interval_s: float = 1.0,
        window: int = 200,
        ring: int = 64,
        clock: Callable[[], float] = time.time,
        faults: Any = None,
    ) -> None:
        self.dir = rank_dir(run_dir, rank)
        self.rank, self.world_size, self.interval_s = rank, world_size, interval_s
        self._clock = clock
        self._faults = faults  # a FaultPlan: ``comm.ddp`` slows the traced all-reduce (tests)
        self._lock = threading.Lock()
        self._durations: dict[str, deque[float]] = {}
        self._window = window
        self._phase: list[tuple[str, float]] = []
        self._step = 0
        self._seq = 0
        self._open: dict[int, dict[str, Any]] = {}
        self._recent: deque[dict[str, Any]] = deque(maxlen=ring)
        self._depth = threading.local()
        self._traced_thread: int | None = None
        self._status = "starting"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stack_file: Any = None
        self._patched: dict[str, Any] = {}
        self._work_step: dict[str, list[float]] = {}
        self._work: dict[str, deque[tuple[float, float, int]]] = {}
        # Cumulative over quiet steps: the watchdog turns deltas into per-minute windows.
        self._totals = {"steps": 0, "tokens": 0, "train_s": 0.0, "comm_s": 0.0}
        self._step_train_s = 0.0
        self._step_comm_s = 0.0

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Recorder:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._stack_file = open(self.dir / STACKS, "a")
        faulthandler.register(STACK_SIGNAL, file=self._stack_file, all_threads=True, chain=False)
        self._status = "running"
        self._thread = threading.Thread(
            target=self._publish_loop, name="shoestring-recorder", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        self._status = "failed" if exc_type else "done"
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.publish()
        faulthandler.unregister(STACK_SIGNAL)
        if self._stack_file is not None:
            self._stack_file.close()

    # ------------------------------------------------------------------ phases
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark a phase (nested phases allowed; the innermost is 'current')."""
        t0 = self._clock()
        with self._lock:
            self._phase.append((name, t0))
            if name == "train_step":
                self._step_comm_s = 0.0
        try:
            yield
        finally:
            dt = self._clock() - t0
            with self._lock:
                self._phase.pop()
                self._durations.setdefault(name, deque(maxlen=self._window)).append(dt)
                if name == "train_step":
                    self._step_train_s = dt

    def work(self, part: str, seconds: float, tokens: int) -> None:
        """Collective-free work of this step (``data``, ``forward``) and the padded tokens it
        covered; summed per step and kept as (seconds, tokens, step) for the straggler
        check."""
        with self._lock:
            acc = self._work_step.setdefault(part, [0.0, 0.0])
            acc[0] += seconds
            acc[1] += tokens

    def step_done(self, step: int, count_work: bool = True) -> None:
        """End of step ``step``. ``count_work=False`` drops this step's work timings (a
        background checkpoint write was competing for the CPU: not the rank's own speed)."""
        with self._lock:
            self._step = step
            for part, (sec, tok) in self._work_step.items() if count_work else ():
                if tok > 0:
                    self._work.setdefault(part, deque(maxlen=self._window)).append((sec, tok, step))
            if count_work:
                t = self._totals
                t["steps"] += 1
                t["tokens"] += int(self._work_step.get("forward", (0.0, 0))[1])
                t["train_s"] += self._step_train_s
                t["comm_s"] += self._step_comm_s
            self._work_step.clear()

    # ------------------------------------------------------------------ collectives
    def _begin(self, op: str, group: str, shapes: list[list[int]], dtype: str) -> int:
        with self._lock:
            self._seq += 1
            seq = self._seq
            self._open[seq] = {
                "seq": seq,
                "op": op,
                "group": group,
                "shapes": shapes,
                "dtype": dtype,
                "start": self._clock(),
                "end": None,
            }
        return seq

    def _begin_on(self, op: str, group: str, tensors: Sequence[Any]) -> int:
        """:meth:`_begin` described by the tensors a collective is called with."""
        return self._begin(
            op,
            group,
            [list(getattr(t, "shape", ())) for t in tensors],
            str(getattr(tensors[0], "dtype", "")) if tensors else "",
        )

    def _end(self, seq: int) -> None:
        with self._lock:
            rec = self._open.pop(seq, None)
            if rec is not None:
                rec["end"] = self._clock()
                self._step_comm_s += rec["end"] - rec["start"]
                self._recent.append(rec)

    @contextlib.contextmanager
    def collective(self, op: str, tensors: list[Any] = (), group: str = "default") -> Iterator[int]:  # type: ignore[assignment]
        seq = self._begin_on(op, group, tensors)
        try:
            yield seq
        finally:
            self._end(seq)

    @property
    def ddp_comm_hook(self) -> Callable[[Any, Any], Any]:
        """A DDP communication hook: the default all-reduce, traced.

        (Returned unannotated: DDP rejects hooks whose annotations are not its own
        types, and this module's annotations are strings.)
        """
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        def hook(state, bucket):  # type: ignore[no-untyped-def]
            buf = bucket.buffer()
            seq = self._begin_on("allreduce[ddp]", "default", [buf])
            fut = default_hooks.allreduce_hook(state, bucket)

            def done(f):  # type: ignore[no-untyped-def]
                delay = self._faults.hit("comm.ddp") if self._faults is not None else None
                if isinstance(delay, Delay):  # injected slow link: completes MS ms later
                    delay.wait()
                self._end(seq)
                return f.value()

            return fut.then(done)

        return hook

    @contextlib.contextmanager
    def trace_collectives(self) -> Iterator[None]:
        """Trace this thread's torch.distributed collectives on the default group.

        Wraps the functions in :data:`TRACED` for the duration of the block and
        restores them after. Calls from other threads, or on another group (the
        checkpoint writer's), are not traced; nested calls count once.
        """
        import torch.distributed as dist

        self._traced_thread = threading.get_ident()
        for name in TRACED:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._patched[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        try:
            yield
        finally:
            for name, fn in self._patched.items():
                setattr(dist, name, fn)
            self._patched.clear()

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        import torch.distributed as dist

        def on_default_group(group: Any) -> bool:
            # FSDP2 passes its mesh's group explicitly; on a 1-D mesh over every rank that is
            # the default group. Other groups (the checkpoint writer's) are not traced.
            return group is None or (dist.is_initialized() and group is dist.group.WORLD)

        @functools.wraps(fn)
        def traced(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            if (
                depth
                or threading.get_ident() != self._traced_thread
                or not on_default_group(kwargs.get("group"))
            ):
                return fn(*args, **kwargs)
            tensors = [a for a in (*args, *kwargs.values()) if hasattr(a, "shape")][:1]
            self._depth.n = 1
            seq = self._begin_on(name, "default", tensors)
            closed_later = False
            try:
                out = fn(*args, **kwargs)
                if kwargs.get("async_op") and out is not None:
                    # An async work (FSDP2's all-gathers and reduce-scatters) stays open
                    # until it completes, so a rank waiting on it is seen waiting in it.
                    try:
                        out.get_future().add_done_callback(lambda _f: self._end(seq))
                        closed_later = True
                    except (AttributeError, RuntimeError):
                        pass  # a backend without futures: closed at return, as sync calls
                return out
            finally:
                self._depth.n = 0
                if not closed_later:
                    self._end(seq)

        return traced

    # ------------------------------------------------------------------ publishing
    def snapshot(self) -> dict[str, Any]:
        now = self._clock()
        with self._lock:
            phase, since = self._phase[-1] if self._phase else ("idle", now)
            outer = self._phase[0][0] if self._phase else "idle"
            stats = {
                k: {
                    "n": len(v),
                    "p50": round(_quantile(list(v), 0.5), 6),
                    "p99": round(_quantile(list(v), 0.99), 6),
                    "max": round(max(v), 6),
                }
                for k, v in self._durations.items()
                if v
            }
            open_ = sorted(self._open.values(), key=lambda r: r["seq"])
            return {
                "rank": self.rank,
                "world_size": self.world_size,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "ts": now,
                "status": self._status,
                "step": self._step,
                "phase": phase,
                "outer_phase": outer,
                "phase_start": since,
                "outer_start": self._phase[0][1] if self._phase else now,
                "seq": self._seq,
                "open_collectives": [dict(r) for r in open_],
                "recent_collectives": [dict(r) for r in list(self._recent)[-8:]],
                "stats": stats,
                "totals": {k: round(v, 6) for k, v in self._totals.items()},
                "work": {
                    k: [[round(sec, 9), int(tok), step] for sec, tok, step in list(v)[-64:]]
                    for k, v in self._work.items()
                },
            }

    def publish(self) -> None:
        snap = self.snapshot()
        try:  # rewritten every second, meaningless after a restart: atomic, not durable
            atomic_write(
                self.dir / LIVE, json.dumps(snap, separators=(",", ":")).encode(), durable=False
            )
        except OSError:
            pass  # a full disk must not stop training; the watchdog sees a stale file

    def _publish_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.publish()


class StartupBeacon:
    """A rank's first sign of life, before it joins the process group.

    Writes ``live.json`` with status ``starting`` (once: the process-group join
    blocks the thread) and lets the watchdog ask for stacks, so a start-up that
    never ends — a rank that never arrives, or every rank stuck forming the
    group — is named and its stacks kept, like a hang in training. The
    :class:`Recorder` replaces the file once training starts.
    """

    def __init__(self, run_dir: Path, rank: int, world_size: int) -> None:
        self.dir = rank_dir(run_dir, rank)
        self.rank, self.world_size = rank, world_size
        self._stack_file: Any = None

    def __enter__(self) -> StartupBeacon:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._stack_file = open(self.dir / STACKS, "a")
        faulthandler.register(STACK_SIGNAL, file=self._stack_file, all_threads=True, chain=False)
        snap = {
            "rank": self.rank,
            "world_size": self.world_size,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "ts": time.time(),
            "status": "starting",
            "step": 0,
            "phase": "start",
            "seq": 0,
        }
        atomic_write(
            self.dir / LIVE, json.dumps(snap, separators=(",", ":")).encode(), durable=False
        )
        return self

    def __exit__(self, *exc: object) -> None:
        # The recorder registered its own handler meanwhile; this file only closes.
        if self._stack_file is not None:
            self._stack_file.close()


class NullRecorder:
    """The same interface, doing nothing (single process without a watchdog)."""

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield

    def step_done(self, step: int, count_work: bool = True) -> None:
        pass

    def work(self, part: str, seconds: float, tokens: int) -> None:
        pass

    @contextlib.contextmanager
    def trace_collectives(self) -> Iterator[None]:
        yield

    def __enter__(self) -> NullRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        pass
