"""Fault points for kill-anywhere testing.

The writer calls ``faults.hit("ckpt.before_manifest")`` at each interesting
moment. A :class:`FaultPlan` parsed from a spec such as
``"ckpt.partial_file@3:kill,upload.before_manifest"`` makes the N-th hit of a
point SIGKILL the process (default), raise ``ENOSPC``, ``hang`` (a stalled disk), or
``term`` (SIGTERM to itself: a preemption notice at that exact moment). The CLI reads the
spec from ``SHOESTRING_FAULTS`` once; library code receives the plan object.

Points: ``ckpt.after_file``, ``ckpt.partial_file`` (dies with a half-written
file), ``ckpt.before_manifest``, ``ckpt.before_rename``, ``ckpt.after_rename``,
``ckpt.retention``, ``upload.after_file``, ``upload.before_manifest``,
``resume.after_load``, ``step.end``, ``step.data`` (while building a batch),
``step.agree`` (the per-step all-reduce of distributed runs; ``skip`` leaves it
out on this rank, ``extra`` issues an additional mis-shaped one), ``step.forward``
(after each forward pass; ``slowNN`` makes every forward from the N-th hit on NN %
slower — a straggler), ``comm.ddp`` (each DDP gradient all-reduce; ``delayMS``
holds every one from the N-th bucket on for MS milliseconds more — a degrading link),
``pass.unit`` (``shoestring infer``: before each unit of a pass after the first),
``step.rollout`` (GRPO: before each prompt's group of completions is sampled),
``start.init`` (a distributed rank, before it announces itself and joins the group).

Qualifiers after the action: ``rankN`` fires only in rank N of a distributed
run; ``once`` fires at most once per run directory (a marker file records it),
so a supervisor that restarts the job does not meet the same fault again;
``saved`` first waits until the checkpoint saves in flight in this process have
finished (:class:`Settle`), so ``step.end@7:kill:saved`` kills at the end of step 7
after the step-4 save committed by construction, however slow the writer (a plain
``step.end@7:kill`` can land while that save is still being written).
"""

from __future__ import annotations

import errno
import os
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

POINTS = frozenset(
    {
        "ckpt.after_file",
        "ckpt.partial_file",
        "ckpt.before_manifest",
        "ckpt.before_rename",
        "ckpt.after_rename",
        "ckpt.retention",
        "upload.after_file",
        "upload.before_manifest",
        "resume.after_load",
        "step.end",
        "step.data",
        "step.agree",
        "step.forward",
        "comm.ddp",
        "pass.unit",
        "step.rollout",
        "start.init",
    }
)
#: kill | enospc | hang act here; skip and extra are returned to the call site, which
#: skips its collective or issues an extra, mis-shaped one (``step.agree``).
ACTIONS = frozenset({"kill", "enospc", "hang", "term", "skip", "extra"})


@dataclass(frozen=True)
class Skip:
    """The call site leaves its collective out on this rank (``step.agree``)."""


@dataclass(frozen=True)
class Extra:
    """The call site issues an additional, mis-shaped collective (``step.agree``)."""


@dataclass(frozen=True)
class Slow:
    """A straggler: from the n-th hit on, the call site's work takes ``percent`` % longer."""

    percent: int

    def stretch(self, seconds: float) -> None:
        """Sleep as long as ``percent`` % of ``seconds``, the work just done."""
        time.sleep(seconds * self.percent / 100)


@dataclass(frozen=True)
class Delay:
    """A degrading link: from the n-th hit on, each operation completes ``ms`` later."""

    ms: int

    def wait(self) -> None:
        time.sleep(self.ms / 1000)


#: The checkpoint writers' background threads, ``Writer.thread_name`` + ``-STEP``
#: (``ckpt-writer`` for files in any mode, ``dcp-writer`` for DCP shards).
SAVE_THREADS = ("ckpt-writer-", "dcp-writer-")


@dataclass(frozen=True)
class Settle:
    """Before a ``saved`` rule fires: the saves in flight (their writer threads) finish."""

    prefixes: tuple[str, ...] = SAVE_THREADS

    def wait(self) -> None:
        me = threading.current_thread()
        for t in threading.enumerate():
            if t is not me and t.name.startswith(self.prefixes):
                t.join()


#: What :meth:`FaultPlan.hit` hands back for the call site to act on.
Action = Skip | Extra | Slow | Delay


def _returned(action: str) -> Action:
    """The typed action of a rule that the call site carries out."""
    if action == "skip":
        return Skip()
    if action == "extra":
        return Extra()
    if action.startswith("slow"):
        return Slow(int(action[4:]))
    return Delay(int(action[5:]))


@dataclass
class _Rule:
    point: str
    nth: int
    action: str
    rank: int | None = None
    once: bool = False
    settle: Settle | None = None  # ``saved``: wait for the saves in flight first
    text: str = ""


@dataclass
class FaultPlan:
    """Which fault fires where. The empty plan (the default) never fires."""

    rules: list[_Rule] = field(default_factory=list)
    spec: str = ""
    kill_pids: tuple[int, ...] = ()  # also SIGKILLed on a "kill" (the writer process's parent)
    once_dir: Path | None = None  # where "once" rules leave their marker
    _counts: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def parse(
        cls,
        spec: str,
        kill_pids: tuple[int, ...] = (),
        *,
        rank: int = 0,
        once_dir: Path | None = None,
    ) -> FaultPlan:
        """Parse ``point[@N][:action[:rankR][:once]]``, comma-separated. Rules for other
        ranks are dropped here, so a plan only holds this process's faults."""
        rules = []
        for part in filter(None, (p.strip() for p in spec.split(","))):
            point, *quals = part.split(":")
            point, _, nth = point.partition("@")
            action = quals.pop(0) if quals else "kill"
            action = action or "kill"
            if point not in POINTS:
                raise ValueError(
                    f"SHOESTRING_FAULTS: unknown fault point {point!r}; "
                    f"known: {', '.join(sorted(POINTS))}"
                )
            if action not in ACTIONS and not re.fullmatch(r"(slow|delay)\d+", action):
                raise ValueError(
                    f"SHOESTRING_FAULTS: unknown action {action!r} "
                    f"({'|'.join(sorted(ACTIONS))}|slowNN|delayMS)"
                )
            rule = _Rule(point, int(nth or 1), action, text=part)
            for q in quals:
                if q == "once":
                    rule.once = True
                elif q == "saved":
                    rule.settle = Settle()
                elif q.startswith("rank") and q[4:].isdigit():
                    rule.rank = int(q[4:])
                else:
                    raise ValueError(
                        f"SHOESTRING_FAULTS: unknown qualifier {q!r} in {part!r} (rankN|once|saved)"
                    )
            if rule.rank is None or rule.rank == rank:
                rules.append(rule)
        return cls(rules, spec, kill_pids, once_dir)

    def _claim(self, rule: _Rule) -> bool:
        """For a ``once`` rule: True the first time in this run directory."""
        if self.once_dir is None:
            return True
        self.once_dir.mkdir(parents=True, exist_ok=True)
        try:
            name = "".join(c if c.isalnum() else "_" for c in rule.text)
            fd = os.open(self.once_dir / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.fsync(fd)
        os.close(fd)
        return True

    def wants(self, point: str) -> bool:
        """True if the next hit of ``point`` would fire (lets callers stage a partial write)."""
        with self._lock:
            n = self._counts.get(point, 0) + 1
        return any(r.point == point and r.nth == n for r in self.rules)

    def hit(self, point: str) -> Action | None:
        """Count a hit of ``point``; fire a rule that matches (a ``saved`` one once the
        saves in flight finished). Kills, full disks, hangs and SIGTERMs happen here; a
        :data:`Action` is returned for the call site to carry out (skip or add a
        collective, slow down), else ``None``."""
        with self._lock:
            n = self._counts[point] = self._counts.get(point, 0) + 1
        for r in self.rules:
            if r.action.startswith(("slow", "delay")) and r.point == point and n >= r.nth:
                return _returned(r.action)  # every hit from the nth on: it slows down
            if r.point == point and r.nth == n:
                if r.once and not self._claim(r):
                    continue
                if r.settle is not None:
                    r.settle.wait()
                if r.action in ("skip", "extra"):
                    return _returned(r.action)
                if r.action == "hang":  # a stalled disk or network
                    time.sleep(3600)
                if r.action == "enospc":
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + f" (fault {point})")
                if r.action == "term":
                    os.kill(os.getpid(), signal.SIGTERM)
                    return None
                for pid in self.kill_pids:
                    os.kill(pid, signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
        return None


NO_FAULTS = FaultPlan()
