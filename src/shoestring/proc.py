"""Helper processes that must not outlive the job that started them."""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; a no-op
    elsewhere). A forked helper otherwise survives a SIGKILLed parent, holding the
    file descriptors it inherited — the run directory's and the data cache's locks.
    ``parent``: the pid that forked us; if it is already gone, exit now."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # pragma: no cover - not Linux
        return
    if parent is not None and os.getppid() != parent:  # died before prctl took effect
        os._exit(1)


def parent_death_signal(parent: int, sig: int) -> Callable[[], None]:
    """For a ``preexec_fn``: prepared in the parent (libc is loaded here, never in a
    child forked from a threaded process), it makes the child receive ``sig`` when
    ``parent`` dies, and exits the child if ``parent`` is already gone."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:  # pragma: no cover - not Linux
        return lambda: None

    def arm() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:
            os._exit(1)

    return arm
