"""Hang detection and the culprit verdict, from the ranks' live snapshots.

Pure functions over the dicts :class:`~shoestring.watch.recorder.Recorder`
publishes, so they are tested with hand-made snapshots and a fake clock.

A rank is *blocked* while it has an open collective: it waits for peers, which
is fine as long as those peers are busy within their own budgets (rank 0
evaluating alone while rank 1 waits in the next all-reduce is not a hang).
The budget of a phase is ``max(multiple × p99 of its past durations, floor)``;
a phase with fewer than ``min_samples`` past durations (the first step, the
first eval, the first checkpoint) gets ``first_timeout_s``. An alarm fires when

* a rank that is not blocked has been in its phase longer than its budget
  (stuck in compute, data loading, I/O, or sleeping);
* every rank is blocked and the last one to enter has waited longer than the
  train-step budget (a collective that never completes, or ranks that called
  different collectives at the same sequence number);
* a rank's snapshot is stale (the process is frozen or gone).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class HangPolicy:
    multiple: float = 3.0
    floor_s: float = 10.0
    first_timeout_s: float = 300.0
    min_samples: int = 3
    stale_s: float = 15.0

    def budget(self, snap: Mapping[str, Any], phase: str) -> float:
        st = snap.get("stats", {}).get(phase)
        if not st or st["n"] < self.min_samples:
            return self.first_timeout_s
        return max(self.multiple * float(st["p99"]), self.floor_s)


@dataclass
class Verdict:
    kind: str  # stuck_rank | collective_mismatch | collective_hang | stale | not_started
    culprits: list[int]
    summary: str
    collective: dict[str, Any] | None = None
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)
    detected_after_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "culprits": self.culprits,
            "summary": self.summary,
            "collective": self.collective,
            "detected_after_s": round(self.detected_after_s, 3),
            "ranks": {str(r): v for r, v in sorted(self.ranks.items())},
        }


def _open(snap: Mapping[str, Any]) -> dict[str, Any] | None:
    colls = snap.get("open_collectives") or []
    return colls[0] if colls else None


def _desc(c: Mapping[str, Any]) -> str:
    return f"{c['op']} #{c['seq']} {c.get('shapes')} {c.get('dtype', '')}".strip()


def _rank_view(snap: Mapping[str, Any], now: float, policy: HangPolicy) -> dict[str, Any]:
    c = _open(snap)
    phase = snap["outer_phase"]
    return {
        "step": snap["step"],
        "phase": snap["phase"],
        "outer_phase": phase,
        "in_phase_s": round(now - snap["outer_start"], 3),
        "budget_s": round(policy.budget(snap, phase), 3),
        "waiting_in": _desc(c) if c else None,
        "last_seq": snap["seq"],
        "pid": snap["pid"],
        "host": snap["host"],
    }


def not_started(
    snaps: Mapping[int, Mapping[str, Any]],
    now: float,
    policy: HangPolicy,
    world_size: int,
    since: float,
) -> Verdict | None:
    """A verdict when the attempt began more than ``first_timeout_s`` ago and some ranks
    never reached training: the ranks that never announced themselves (a process stuck
    or gone before joining), else those still forming the process group (rendezvous,
    ``init_process_group``). Needs at least one rank's snapshot: a command that does
    not publish any is not judged."""
    waited = now - since
    if not snaps or waited <= policy.first_timeout_s:
        return None
    missing = sorted(set(range(world_size)) - set(snaps))
    starting = sorted(r for r, s in snaps.items() if s.get("status") == "starting")
    if missing:
        culprits = missing
        summary = (
            f"rank(s) {missing} never started ({waited:.0f}s after launch, no sign "
            f"of life)"
            + (f"; rank(s) {starting} wait for them to form the process group" if starting else "")
        )
    elif starting:
        culprits = starting
        summary = (
            f"rank(s) {starting} still forming the process group {waited:.0f}s after "
            f"launch (rendezvous / init_process_group)"
        )
    else:
        return None
    views = {
        r: {
            "step": s.get("step"),
            "phase": s.get("phase"),
            "status": s.get("status"),
            "in_phase_s": round(now - float(s.get("ts", now)), 3),
            "budget_s": policy.first_timeout_s,
            "waiting_in": None,
            "pid": s.get("pid"),
            "host": s.get("host"),
        }
        for r, s in snaps.items()
    }
    return Verdict("not_started", culprits, summary, None, views, waited)


def analyze(
    snaps: Mapping[int, Mapping[str, Any]], now: float, policy: HangPolicy, world_size: int
) -> Verdict | None:
    """A verdict if the job is hung now, else ``None``."""
    if not snaps:
        return None
    running = {r: s for r, s in snaps.items() if s.get("status") == "running"}
    if len(running) < world_size:
        return None  # still starting, or finishing: exits are the supervisor's business
    views = {r: _rank_view(s, now, policy) for r, s in running.items()}

    stale = [r for r, s in running.items() if now - s["ts"] > policy.stale_s]
    if stale:
        return Verdict(
            "stale",
            stale,
            f"rank(s) {stale} stopped publishing for more than "
            f"{policy.stale_s:.0f}s (process frozen or gone)",
            None,
            views,
            max(now - running[r]["ts"] for r in stale),
        )

    blocked = {r: c for r, s in running.items() if (c := _open(s)) is not None}
    free = [r for r in running if r not in blocked]
    overdue = [
        r
        for r in free
        if now - running[r]["outer_start"] > policy.budget(running[r], running[r]["outer_phase"])
    ]
    if overdue:
        waiting = sorted(blocked.items())
        coll = waiting[0][1] if waiting else None
        where = ""
        if coll is not None:
            where = (
                f"; rank(s) {sorted(blocked)} wait in {_desc(coll)}, which rank(s) "
                f"{overdue} never entered (their last collective is "
                f"#{max(running[r]['seq'] for r in overdue)})"
            )
        phases = ", ".join(
            f"rank {r} in {running[r]['phase']} for "
            f"{now - running[r]['outer_start']:.1f}s (budget "
            f"{policy.budget(running[r], running[r]['outer_phase']):.1f}s)"
            for r in overdue
        )
        return Verdict(
            "stuck_rank",
            overdue,
            f"{phases}{where}",
            coll,
            views,
            max(now - running[r]["outer_start"] for r in overdue),
        )

    if free or not blocked:
        return None
    return _all_blocked(blocked, running, views, now, policy)


def _all_blocked(
    blocked: Mapping[int, dict[str, Any]],
    running: Mapping[int, Mapping[str, Any]],
    views: Any,
    now: float,
    policy: HangPolicy,
) -> Verdict | None:
    """Everyone waits in a collective: hung past the budget? Same sequence number, same op
    and shapes (a hang in the collective), or not (a mismatch; the minority is the culprit)?"""
    last_entry = max(c["start"] for c in blocked.values())
    budget = max(policy.budget(running[r], "train_step") for r in running)
    if now - last_entry <= budget:
        return None
    by_seq: dict[int, list[int]] = {}
    for r, c in blocked.items():
        by_seq.setdefault(c["seq"], []).append(r)
    sigs = {(c["op"], str(c.get("shapes")), c.get("dtype")) for c in blocked.values()}
    if len(by_seq) > 1 or len(sigs) > 1:
        detail = "; ".join(f"rank {r}: {_desc(c)}" for r, c in sorted(blocked.items()))
        groups: dict[tuple[Any, ...], list[int]] = {}
        for r, c in blocked.items():
            groups.setdefault((c["seq"], c["op"], str(c.get("shapes"))), []).append(r)
        odd = min(groups.values(), key=len) if len(groups) > 1 else sorted(blocked)
        return Verdict(
            "collective_mismatch",
            sorted(odd),
            f"ranks called different collectives: {detail}",
            blocked[sorted(odd)[0]],
            views,
            now - last_entry,
        )
    c = next(iter(blocked.values()))
    return Verdict(
        "collective_hang",
        sorted(blocked),
        f"all ranks entered {_desc(c)} and it has not completed for {now - last_entry:.1f}s",
        c,
        views,
        now - last_entry,
    )
