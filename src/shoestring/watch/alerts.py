"""Where alarms go: the event log, stderr, a webhook, a Prometheus counter.

An :class:`Alerts` object fans one alarm out to its sinks. Sinks are small
objects with ``send(kind, fields)``; the watchdog never waits on them: the
webhook posts from its own thread with a bounded queue, so a slow or dead
receiver can delay a notification but never the hang detection.

The webhook body is JSON with a Slack-compatible ``text`` line plus the
structured alarm (``kind``, ``job``, ``host`` and the alarm's own fields)::

    {"text": "shoestring job-42: THROUGHPUT_DROP rank 1: ...", "event": "alarm",
     "kind": "throughput_drop", "job": "job-42", "host": ..., "rank": 1, ...}
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, Protocol

from shoestring.secrets import redact_text, redact_webhook

log = logging.getLogger("shoestring.alerts")


class AlertSink(Protocol):
    def send(self, kind: str, fields: dict[str, Any]) -> None: ...


def headline(job: str, kind: str, fields: dict[str, Any]) -> str:
    """One human line for an alarm."""
    msg = fields.get("message") or fields.get("summary")
    if msg is None:
        msg = ", ".join(f"{k}={v}" for k, v in fields.items() if not isinstance(v, (dict, list)))
    rank = fields.get("rank")
    where = f" rank {rank}" if rank is not None and f"rank {rank}" not in str(msg) else ""
    return f"shoestring {job}: {str(fields.get('kind', kind)).upper()}{where}: {msg}"


class StderrSink:
    def __init__(self, job: str) -> None:
        self.job = job

    def send(self, kind: str, fields: dict[str, Any]) -> None:
        log.warning("%s", headline(self.job, kind, fields))


class CallbackSink:
    """Adapts a function (the supervisor's event-log writer) to a sink."""

    def __init__(self, fn: Callable[[str, dict[str, Any]], None]) -> None:
        self.fn = fn

    def send(self, kind: str, fields: dict[str, Any]) -> None:
        self.fn(kind, fields)


class WebhookSink:
    """POST each alarm as JSON to ``url`` from a background thread, with retries."""

    def __init__(
        self,
        url: str,
        job: str,
        host: str,
        *,
        timeout_s: float = 5.0,
        retries: int = 3,
        backoff_s: float = 1.0,
        max_queue: int = 100,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"webhook: expected an http(s) URL, got {redact_webhook(url)!r}")
        self.url, self.job, self.host = url, job, host
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self._q: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=max_queue)
        self.sent = 0
        self.failed = 0
        self._thread = threading.Thread(target=self._loop, name="shoestring-webhook", daemon=True)
        self._thread.start()

    def send(self, kind: str, fields: dict[str, Any]) -> None:
        body = {
            "text": headline(self.job, kind, fields),
            "event": kind,
            "job": self.job,
            "host": self.host,
            "ts": round(time.time(), 3),
            **fields,
        }
        body["kind"] = fields.get("kind", kind)
        try:
            self._q.put_nowait(body)
        except queue.Full:
            self.failed += 1
            log.warning("alert webhook queue full; dropped a %s alarm", kind)

    def _post(self, body: dict[str, Any]) -> None:
        data = json.dumps(body, default=str).encode()
        req = urllib.request.Request(
            self.url,
            data=data,
            method="POST",
            headers={"Content-Type": "application/json", "User-Agent": "shoestring"},
        )
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:  # noqa: S310 - user URL
            resp.read()

    def _loop(self) -> None:
        while True:
            body = self._q.get()
            if body is None:
                return
            for attempt in range(self.retries):
                try:
                    self._post(body)
                    self.sent += 1
                    break
                except (urllib.error.URLError, OSError, ValueError) as e:
                    if attempt == self.retries - 1:
                        self.failed += 1
                        # The URL is the secret (Slack, Discord): name its host only.
                        log.warning(
                            "alert webhook %s failed after %d tries: %s",
                            redact_webhook(self.url),
                            self.retries,
                            redact_text(str(e), known=(self.url,)),
                        )
                    else:
                        time.sleep(self.backoff_s * 2**attempt)
            self._q.task_done()

    def close(self, timeout_s: float = 10.0) -> None:
        """Deliver what is queued (up to ``timeout_s``), then stop."""
        deadline = time.monotonic() + timeout_s
        while self._q.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            self._q.put_nowait(None)
        except queue.Full:
            pass


class Alerts:
    """Fan-out to every sink; a failing sink is logged, never raised into the watchdog."""

    def __init__(self, sinks: list[AlertSink]) -> None:
        self.sinks = sinks

    def __call__(self, kind: str, fields: dict[str, Any]) -> None:
        for s in self.sinks:
            try:
                s.send(kind, dict(fields))
            except Exception as e:  # noqa: BLE001
                log.warning("alert sink %s failed: %s", type(s).__name__, e)

    def close(self) -> None:
        for s in self.sinks:
            close = getattr(s, "close", None)
            if close is not None:
                close()
