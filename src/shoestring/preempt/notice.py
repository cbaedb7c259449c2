"""Cloud preemption notices: the :class:`Notice` a source reports, and the watcher
thread that polls a source and raises the :class:`PreemptionFlag`.

A source knows one provider's metadata protocol (:mod:`.aws`, :mod:`.gcp`,
:mod:`.azure`); the watcher knows threads, backoff and logging. Sources raise on
transport trouble; the watcher retries with backoff, warns once and never lets an
exception reach training. Everything here uses the standard library only.
"""

from __future__ import annotations

import email.message
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from shoestring.preempt.flag import PreemptionFlag

log = logging.getLogger("shoestring.preempt")

#: ``EventLog.emit``-shaped callback: ``emit("notice", provider=..., ...)``.
Emit = Callable[..., Any]


@dataclass(frozen=True)
class Notice:
    """One provider message that the machine is (or may soon be) going away."""

    provider: str  # "aws" | "gcp" | "azure"
    action: str  # provider's word: terminate, stop, hibernate, preempt, Preempt, rebalance...
    reason: str  # what PreemptionFlag.reason and the preempt event will say
    deadline: float | None = None  # epoch seconds when the machine goes, if known
    preempting: bool = True  # False: an early warning only (logged, training goes on)
    detail: dict[str, Any] = field(default_factory=dict)


class NoticeSource(Protocol):
    """One provider's metadata protocol. ``poll`` returns a notice or ``None`` and raises
    (``OSError``, ``ValueError``...) on transport or format trouble."""

    provider: str
    endpoint: str

    @property
    def interval_s(self) -> float:
        """Pause between polls; 0 for long-polling sources, whose ``poll`` does the waiting."""

    def poll(self) -> Notice | None: ...


class MetadataError(OSError):
    """The metadata service answered, but not as the protocol says it should."""


@dataclass(frozen=True)
class Response:
    status: int
    headers: email.message.Message
    body: bytes


class Http:
    """Tiny urllib client for link-local metadata services.

    Proxies are bypassed on purpose: an ``http_proxy`` in the environment must not
    route 169.254.169.254 through a proxy (the answer would be the proxy's, and
    Azure's IMDS rejects forwarded requests). HTTP error statuses are returned,
    not raised, because 404/401 are normal answers of these protocols.
    """

    def __init__(self) -> None:
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def request(
        self,
        method: str,
        url: str,
        headers: dict[str, str],
        timeout: float,
        data: bytes | None = None,
    ) -> Response:
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with self._opener.open(req, timeout=timeout) as r:
                return Response(r.status, r.headers, r.read())
        except urllib.error.HTTPError as e:
            with e:
                return Response(e.code, e.headers, e.read())


class NoticeWatcher:
    """Context manager: poll one :class:`NoticeSource` in a daemon thread.

    A preempting notice is logged (``notice`` event, then a warning) and raises the
    flag with the notice's reason; the thread then ends. An early warning is logged
    once and polling goes on. Errors back off from ``interval_s`` doubling up to
    ``max_backoff_s`` — kept short (default 5 s, AWS's own polling advice) so an
    outage never costs more than a few seconds of a 30 s notice window.
    """

    def __init__(
        self,
        source: NoticeSource,
        flag: PreemptionFlag,
        emit: Emit | None = None,
        *,
        max_backoff_s: float = 5.0,
        hint: str = "",
    ) -> None:
        self.source, self.flag, self._emit = source, flag, emit
        self.max_backoff_s = max_backoff_s
        self.hint = hint  # appended to the first warning (e.g. the IMDS hop-limit trap)
        self.notices: list[Notice] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> NoticeWatcher:
        self._thread = threading.Thread(
            target=self._run, daemon=True, name=f"shoestring-notice-{self.source.provider}"
        )
        self._thread.start()
        log.info("watching %s preemption notices at %s", self.source.provider, self.source.endpoint)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        # A long poll may be in flight; it is a daemon thread, so don't wait for it.
        if self._thread is not None:
            self._thread.join(timeout=0.2)

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                notice = self.source.poll()
            except Exception as e:  # noqa: BLE001 - nothing here may reach training
                failures += 1
                self.errors += 1
                if failures == 1 and self.errors == 1:
                    log.warning(
                        "%s metadata at %s: %s: %s; retrying with backoff, training "
                        "goes on (further errors are logged at debug level)%s",
                        self.source.provider,
                        self.source.endpoint,
                        type(e).__name__,
                        e,
                        self.hint,
                    )
                else:
                    log.debug("%s metadata: %s: %s", self.source.provider, type(e).__name__, e)
                base = max(self.source.interval_s, 0.05)
                self._stop.wait(min(base * 2 ** min(failures, 20), self.max_backoff_s))
                continue
            if failures:
                log.info(
                    "%s metadata reachable again after %d failed polls",
                    self.source.provider,
                    failures,
                )
                failures = 0
            if notice is not None:
                self._report(notice)
                if notice.preempting:
                    return
            self._stop.wait(self.source.interval_s)

    def _report(self, notice: Notice) -> None:
        self.notices.append(notice)
        now = time.time()
        try:
            if self._emit is not None:  # the event first, so the log reads notice -> preempt
                self._emit(
                    "notice",
                    provider=notice.provider,
                    action=notice.action,
                    reason=notice.reason,
                    preempting=notice.preempting,
                    deadline=notice.deadline,
                    deadline_in_s=None
                    if notice.deadline is None
                    else round(notice.deadline - now, 3),
                    detail=notice.detail,
                )
        except Exception:  # noqa: BLE001 - a broken log must not cost the notice
            log.exception("could not log the %s notice", notice.provider)
        if notice.preempting:
            self.flag.set(notice.reason)
            log.warning("%s: finishing the step, then an emergency checkpoint", notice.reason)
        else:
            log.warning("%s (early warning; training goes on)", notice.reason)
