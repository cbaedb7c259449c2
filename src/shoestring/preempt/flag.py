"""The preemption flag and the signal source that raises it.

Loops poll :meth:`PreemptionFlag.is_set` at safe points (end of a step, between
eval batches, between data batches). Sources — POSIX signals here, cloud
metadata watchers in :mod:`shoestring.preempt.notice` — only call
:meth:`PreemptionFlag.set`; they never touch training state.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

from shoestring import exitcodes


class PreemptionFlag:
    """Thread-safe 'please checkpoint and stop' flag with the reason and time."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason: str = ""
        self.set_at: float | None = None

    def set(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
            self.set_at = time.time()
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


class SignalSource:
    """Context manager: SIGTERM, SIGINT and one configurable signal raise the flag.

    The first signal sets the flag so the run can finish the current step and
    write an emergency checkpoint. A second signal means "now": the process
    exits at once with :data:`exitcodes.PREEMPTED_HARD` without touching any
    committed checkpoint (an in-flight one stays uncommitted and is ignored).
    SIGHUP (a hung-up terminal, a dead supervisor) counts as a notice too, unless
    the job was started ignoring it (``nohup``).
    """

    def __init__(
        self,
        flag: PreemptionFlag,
        extra_signal: str = "SIGUSR1",
        hard_exit: Callable[[int], None] = os._exit,
    ) -> None:
        self.flag = flag
        self.signals = [signal.SIGTERM, signal.SIGINT]
        if extra_signal and extra_signal != "none":
            self.signals.append(getattr(signal, extra_signal))
        if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # nohup'd jobs ignore it
            # A closed terminal, or `shoestring run` killed: the kernel sends its job
            # SIGHUP (once per thread the dead parent had, hence the echo rule below).
            self.signals.append(signal.SIGHUP)
        self._hard_exit = hard_exit
        self._previous: dict[int, object] = {}
        self.count = 0
        self._first: tuple[int, float] = (0, 0.0)
        #: A repeat of the same warning signal (not SIGINT/SIGTERM) within this many
        #: seconds is the same notice delivered twice, not a second signal.
        self.echo_s = 2.0

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if (
            self.count
            and signum == self._first[0]
            and signum not in (signal.SIGINT, signal.SIGTERM)
            and now - self._first[1] < self.echo_s
        ):
            # The same warning delivered twice at once (Slurm signals every process of a
            # job step, and `shoestring run` forwards it too): one notice, not "now".
            return
        self.count += 1
        if self.count > 1:
            self._hard_exit(exitcodes.PREEMPTED_HARD)
            return
        self._first = (signum, now)
        self.flag.set(signal.Signals(signum).name)

    def __enter__(self) -> SignalSource:
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)  # type: ignore[arg-type]
        self._previous.clear()
