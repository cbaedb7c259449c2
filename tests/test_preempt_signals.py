"""The signal source: configurable signals raise the flag; a second one exits at once."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

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


@pytest.fixture
def hangup_heard() -> Iterator[None]:
    """SIGHUP at its default, as in a job not started under nohup (pytest itself may
    run under nohup, which the SignalSource respects)."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_unconfigured_user_signal_is_not_ours(hangup_heard: None) -> None:
    flag = PreemptionFlag()
    with SignalSource(flag, "SIGUSR2", hard_exit=lambda code: None):
        assert signal.getsignal(signal.SIGUSR1) is not signal.getsignal(signal.SIGUSR2)
    with SignalSource(flag, "none", hard_exit=lambda code: None) as src:
        assert src.signals == [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]


def test_a_hangup_twice_is_one_notice_and_a_nohup_job_keeps_ignoring_it(
    hangup_heard: None,
) -> None:
    # A dead supervisor's job gets SIGHUP once per thread the supervisor had.
    flag = PreemptionFlag()
    exits: list[int] = []
    with SignalSource(flag, "none", hard_exit=exits.append):
        os.kill(os.getpid(), signal.SIGHUP)
        os.kill(os.getpid(), signal.SIGHUP)
        assert flag.is_set() and flag.reason == "SIGHUP" and exits == []
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup starts a job
    try:
        with SignalSource(PreemptionFlag(), "none", hard_exit=exits.append) as src:
            assert signal.SIGHUP not in src.signals
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_the_same_warning_delivered_twice_is_one_notice() -> None:
    # Slurm signals every process of a job step and `shoestring run` forwards the same
    # warning: a repeat within echo_s is not the "stop now" second signal.
    flag = PreemptionFlag()
    exits: list[int] = []
    with SignalSource(flag, "SIGUSR1", hard_exit=exits.append) as src:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.is_set() and exits == []
        src.echo_s = 0.0  # later, the same signal again means "now"
        os.kill(os.getpid(), signal.SIGUSR1)
        assert exits == [exitcodes.PREEMPTED_HARD]
