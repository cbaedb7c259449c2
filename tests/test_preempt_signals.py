"""The signal source: configurable signals raise the flag; a second one exits at once."""

from __future__ import annotations

import os
import signal

import pytest

from shoestring import exitcodes
from shoestring.preempt import PreemptionFlag, SignalSource


@pytest.mark.parametrize("extra", ["SIGUSR1", "SIGUSR2"])
def test_configured_signal_sets_flag_and_second_exits(extra: str) -> None:
    flag = PreemptionFlag()
    exits: list[int] = []
    with SignalSource(flag, extra, hard_exit=exits.append):
        os.kill(os.getpid(), getattr(signal, extra))
        assert flag.is_set() and flag.reason == extra and flag.set_at is not None
        assert exits == []
        os.kill(os.getpid(), signal.SIGTERM)
        assert exits == [exitcodes.PREEMPTED_HARD]
    # Handlers are restored on exit.
    assert signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, signal.default_int_handler)


def test_unconfigured_user_signal_is_not_ours() -> None:
    flag = PreemptionFlag()
    with SignalSource(flag, "SIGUSR2", hard_exit=lambda code: None):
        assert signal.getsignal(signal.SIGUSR1) is not signal.getsignal(signal.SIGUSR2)
    with SignalSource(flag, "none", hard_exit=lambda code: None) as src:
        assert src.signals == [signal.SIGTERM, signal.SIGINT]
