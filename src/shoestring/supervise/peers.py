"""Ranks of other nodes that vanished: why a multi-node attempt failed.

When a node dies (its processes killed, the machine gone, its network cut), the
survivors' ranks fail in their next collective ("Connection reset by peer") and
their ``shoestring run`` sees only a failed attempt. The ranks of the lost node
say nothing; that silence is the evidence. Each rank's recorder rewrites its
``live.json`` every second on the shared run directory: a rank that is alive
keeps doing so, or writes its end (``failed``, ``done``) when its collective
fails too. A rank of another host that was training in this attempt and whose
live state stays unchanged for ``silence_s`` after the local job ended is lost.
A single-node job has no such ranks and costs nothing here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shoestring.watch.watchdog import read_snapshots

#: Seconds without a change of a peer's live state (rewritten every second) that make it lost.
PEER_SILENCE_S = 4.0


def lost_peers(
    run_dir: Path,
    since: float,
    host: str,
    silence_s: float = PEER_SILENCE_S,
    poll_s: float = 0.25,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[int, dict[str, Any]]:
    """Ranks of other hosts, running in the attempt that began at ``since``, that show no
    sign of life for ``silence_s``: rank → ``host``, ``pid``, ``step``, ``phase``,
    ``silent_s`` (since its last update, by this host's clock). Returns as soon as every
    such rank has shown life; waits ``silence_s`` when one has not."""
    silent = {
        r: s
        for r, s in read_snapshots(run_dir, since).items()
        if s.get("host") != host and s.get("status") == "running"
    }
    t0 = clock()
    while silent and clock() - t0 < silence_s:
        sleep(poll_s)
        now = read_snapshots(run_dir, since)
        silent = {r: s for r, s in silent.items() if now.get(r, s).get("ts") == s.get("ts")}
    t = clock()
    return {
        r: {
            "host": s.get("host"),
            "pid": s.get("pid"),
            "step": s.get("step"),
            "phase": s.get("phase"),
            "silent_s": round(t - float(s.get("ts", t)), 3),
        }
        for r, s in sorted(silent.items())
    }


def summary(lost: dict[int, dict[str, Any]]) -> str:
    """One line: which ranks on which hosts, where they were."""
    hosts = sorted({str(v["host"]) for v in lost.values()})
    return (
        f"lost rank(s) {sorted(lost)} on {', '.join(hosts)}: no sign of life for "
        f"{min(v['silent_s'] for v in lost.values()):.1f}s (last seen at step "
        f"{max(int(v['step'] or 0) for v in lost.values())}); the node is gone or cut off"
    )
