"""Fake cloud metadata services on 127.0.0.1, to test and rehearse a preemption.

``FakeMetadataServer("aws"|"gcp"|"azure")`` speaks the real request/response
shapes of each provider's service, including the parts clients get wrong:
IMDSv2 tokens (401 without a valid one), GCP's ``Metadata-Flavor: Google``
header (403 without it) and ``wait_for_change``/``last_etag`` long polls,
Azure's ``Metadata: true`` header (400 without it), ``DocumentIncarnation`` and
its slow first call. The notice is sent by :meth:`FakeMetadataServer.preempt_now`
or after ``notice_after_s``. Rehearse with a real run::

    python -m shoestring.preempt.fakes aws --notice-after 60
    shoestring finetune --preempt.cloud aws --preempt.metadata_url http://127.0.0.1:PORT ...
"""

from __future__ import annotations

import argparse
import email.utils
import hashlib
import json
import secrets
import signal
import sys
import threading
import time
import urllib.parse
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from shoestring.preempt.providers import PROVIDERS

#: Seconds from notice to the machine going away, as each provider announces it.
GRACE_S = {"aws": 120.0, "gcp": 30.0, "azure": 30.0}
DEFAULT_ACTION = {"aws": "terminate", "gcp": "preempt", "azure": "Preempt"}


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeMetadataServer:
    """One provider's metadata service on ``127.0.0.1:port`` (0: any free port).

    Context manager; ``url`` is the base to pass as ``preempt.metadata_url``.
    ``noticed_at`` is the wall-clock time the notice became visible, the zero of
    any notice-to-commit measurement. ``requests`` logs ``(method, path, status)``.
    """

    def __init__(
        self,
        provider: str,
        notice_after_s: float | None = None,
        *,
        action: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        first_call_delay_s: float = 0.0,
        vm_name: str = "shoestring-fake-vm",
    ) -> None:
        if provider not in PROVIDERS:
            raise ValueError(f"provider must be one of {PROVIDERS}, not {provider!r}")
        self.provider = provider
        self.action = action or DEFAULT_ACTION[provider]
        self.first_call_delay_s = first_call_delay_s  # Azure: the lazy first call
        self.vm_name = vm_name
        self.noticed_at: float | None = None
        self.requests: list[tuple[str, str, int]] = []
        self.acknowledged: list[str] = []  # Azure StartRequests EventIds
        self._cond = threading.Condition()
        self._notice_after_s = notice_after_s
        self._started = time.time()
        self._tokens: dict[str, float] = {}  # AWS token -> expiry
        self._rebalance_at: float | None = None
        self._events: list[dict[str, Any]] = []  # Azure
        self._incarnation = 1
        self._fail: list[int] = []  # statuses to answer the next requests with
        self._closed = False
        self._httpd = ThreadingHTTPServer((host, port), _handler_for(self))
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ control
    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FakeMetadataServer:
        self._started = time.time()
        # A short poll interval: close() waits up to one interval for the serve loop.
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            args=(0.05,),
            daemon=True,
            name=f"fake-{self.provider}-metadata",
        )
        self._thread.start()
        return self

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()  # release GCP long polls
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> FakeMetadataServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def preempt_now(
        self, *, resources: list[str] | None = None, event_type: str | None = None
    ) -> float:
        """Publish the notice now; returns its time. Azure: ``resources`` (default this
        VM) and ``event_type`` (default ``action``) shape the scheduled event."""
        with self._cond:
            now = time.time()
            if self.provider == "azure":
                self._add_event(event_type or self.action, resources or [self.vm_name], now)
                if resources is not None and self.vm_name not in resources:
                    self._cond.notify_all()
                    return now  # someone else's event: not our notice
            if self.noticed_at is None:
                self.noticed_at = now
            self._cond.notify_all()
            return now

    def rebalance_now(self) -> None:
        """AWS: publish a rebalance recommendation (an early warning, no deadline)."""
        with self._cond:
            self._rebalance_at = time.time()

    def expire_tokens(self) -> None:
        """AWS: invalidate every IMDSv2 token handed out so far."""
        with self._cond:
            self._tokens.clear()

    def fail_next(self, n: int, status: int = 500) -> None:
        """Answer the next ``n`` requests with ``status`` (an outage)."""
        with self._cond:
            self._fail.extend([status] * n)

    # ------------------------------------------------------------ state
    def _preempted(self) -> bool:
        """Called with the lock held; applies a due ``notice_after_s`` lazily."""
        if self.noticed_at is None and self._notice_after_s is not None:
            due = self._started + self._notice_after_s
            if time.time() >= due:
                self.noticed_at = due
                if self.provider == "azure":
                    self._add_event(self.action, [self.vm_name], due)
        return self.noticed_at is not None

    def _add_event(self, kind: str, resources: list[str], at: float) -> None:
        self._incarnation += 1
        self._events.append(
            {
                "EventId": str(uuid.uuid4()).upper(),
                "EventStatus": "Scheduled",
                "EventType": kind,
                "ResourceType": "VirtualMachine",
                "Resources": resources,
                "NotBefore": email.utils.formatdate(at + GRACE_S["azure"], usegmt=True),
                "Description": "The virtual machine is being evicted (shoestring fake).",
                "EventSource": "Platform",
                "DurationInSeconds": -1,
            }
        )

    def _seconds_to_notice(self) -> float | None:
        if self.noticed_at is not None or self._notice_after_s is None:
            return None
        return max(self._started + self._notice_after_s - time.time(), 0.0)


def _handler_for(server: FakeMetadataServer) -> type[BaseHTTPRequestHandler]:
    class Handler(_Handler):
        fake = server

    return Handler


class _Handler(BaseHTTPRequestHandler):
    fake: FakeMetadataServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass

    def _send(
        self,
        status: int,
        body: str | bytes = b"",
        ctype: str = "text/plain",
        headers: dict[str, str] | None = None,
    ) -> None:
        data = body.encode() if isinstance(body, str) else body
        # Logged before the answer goes out: a client that has its answer sees it logged.
        self.fake.requests.append((self.command, self.path, status))
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        try:
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away (a preempted run exits mid long-poll)

    def _dispatch(self) -> None:
        fake = self.fake
        with fake._cond:
            status = fake._fail.pop(0) if fake._fail else None
        if status is not None:
            return self._send(status, "injected failure")
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        getattr(self, f"_{fake.provider}")(url.path, query)

    do_GET = do_PUT = do_POST = _dispatch

    # ------------------------------------------------------------ AWS IMDSv2
    def _aws(self, path: str, query: dict[str, str]) -> None:
        fake = self.fake
        if "X-Forwarded-For" in self.headers:
            return self._send(403, "Forbidden")
        if path == "/latest/api/token":
            if self.command != "PUT":
                return self._send(405, "Method Not Allowed")
            try:
                ttl = int(self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", ""))
            except ValueError:
                return self._send(400, "Bad Request")
            if not 1 <= ttl <= 21600:
                return self._send(400, "Bad Request")
            token = secrets.token_urlsafe(32)
            with fake._cond:
                fake._tokens[token] = time.time() + ttl
            return self._send(
                200, token, headers={"X-aws-ec2-metadata-token-ttl-seconds": str(ttl)}
            )
        token = self.headers.get("X-aws-ec2-metadata-token", "")
        with fake._cond:
            valid = fake._tokens.get(token, 0.0) > time.time()
            preempted = fake._preempted()
            rebalance_at = fake._rebalance_at
            noticed = fake.noticed_at
        if not valid:  # IMDSv2 required ("http-tokens required")
            return self._send(401, "Unauthorized")
        if path == "/latest/meta-data/spot/instance-action":
            if not preempted or noticed is None:
                return self._send(404, "Not Found")
            return self._send(
                200, json.dumps({"action": fake.action, "time": _iso(noticed + GRACE_S["aws"])})
            )
        if path == "/latest/meta-data/events/recommendations/rebalance":
            if rebalance_at is None:
                return self._send(404, "Not Found")
            return self._send(200, json.dumps({"noticeTime": _iso(rebalance_at)}))
        if path == "/latest/meta-data/instance-id":
            return self._send(200, "i-0fa4e5ea7e000000f")
        return self._send(404, "Not Found")

    # ------------------------------------------------------------ GCP
    def _gcp(self, path: str, query: dict[str, str]) -> None:
        fake = self.fake
        if self.headers.get("Metadata-Flavor") != "Google" or "X-Forwarded-For" in self.headers:
            return self._send(403, "Missing Metadata-Flavor:Google header.", "text/html")
        if path != "/computeMetadata/v1/instance/preempted":
            return self._send(404, "Not Found", "text/html")

        def current() -> tuple[str, str]:
            value = "TRUE" if fake._preempted() else "FALSE"
            return value, hashlib.sha1(value.encode()).hexdigest()[:16]

        with fake._cond:
            value, etag = current()
            if query.get("wait_for_change") == "true":
                # Without last_etag: wait for a change from now. With it: return at once
                # if the value already differs from the one the client last saw.
                last = query.get("last_etag", etag)
                deadline = time.time() + float(query.get("timeout_sec", 3600))
                while etag == last and time.time() < deadline and not fake._closed:
                    wait = deadline - time.time()
                    due = fake._seconds_to_notice()
                    fake._cond.wait(min(wait, due + 0.001) if due is not None else wait)
                    value, etag = current()
        return self._send(
            200, value, "application/text", {"ETag": etag, "Metadata-Flavor": "Google"}
        )

    # ------------------------------------------------------------ Azure
    def _azure(self, path: str, query: dict[str, str]) -> None:
        fake = self.fake
        if self.headers.get("Metadata") != "true" or "X-Forwarded-For" in self.headers:
            return self._send(
                400,
                json.dumps({"error": "Bad request. Required metadata header not specified"}),
                "application/json",
            )
        if "api-version" not in query:
            return self._send(
                400,
                json.dumps({"error": "Bad request. api-version was not specified in the request."}),
                "application/json",
            )
        if path == "/metadata/instance/compute/name":
            return self._send(200, fake.vm_name)
        if path != "/metadata/scheduledevents":
            return self._send(404, json.dumps({"error": "Not found"}), "application/json")
        with fake._cond:
            first, fake.first_call_delay_s = fake.first_call_delay_s, 0.0
        if first:
            time.sleep(first)  # the service starts lazily on the first call
        if self.command == "POST":
            length = int(self.headers.get("Content-Length", "0") or 0)
            doc = json.loads(self.rfile.read(length) or b"{}")
            with fake._cond:
                ids = [r.get("EventId") for r in doc.get("StartRequests", [])]
                fake.acknowledged.extend(ids)
                for ev in fake._events:
                    if ev["EventId"] in ids:
                        ev["EventStatus"], ev["NotBefore"] = "Started", ""
                fake._incarnation += 1
            return self._send(200, "", "application/json")
        with fake._cond:
            fake._preempted()
            doc = {
                "DocumentIncarnation": fake._incarnation,
                "Events": [dict(e) for e in fake._events],
            }
        return self._send(200, json.dumps(doc), "application/json")


def main(argv: list[str] | None = None) -> int:
    """``python -m shoestring.preempt.fakes PROVIDER``: serve until Ctrl-C."""
    p = argparse.ArgumentParser(
        prog="python -m shoestring.preempt.fakes",
        description="Serve a fake cloud metadata service on 127.0.0.1 "
        "and send a preemption notice, to rehearse one.",
    )
    p.add_argument("provider", choices=PROVIDERS)
    p.add_argument(
        "--notice-after",
        type=float,
        metavar="S",
        help="send the notice S seconds after start (default: on Enter, or on "
        "SIGUSR1 to this process)",
    )
    p.add_argument("--port", type=int, default=0, help="port (default: any free one)")
    p.add_argument("--action", help="AWS: terminate|stop|hibernate; Azure: Preempt|Terminate")
    args = p.parse_args(argv)
    with FakeMetadataServer(
        args.provider, args.notice_after, action=args.action, port=args.port
    ) as fake:
        print(
            f"fake {args.provider} metadata service at {fake.url}\n"
            f"  shoestring finetune --preempt.cloud {args.provider} "
            f"--preempt.metadata_url {fake.url} ...",
            flush=True,
        )
        signal.signal(signal.SIGUSR1, lambda *_: fake.preempt_now())
        try:
            if args.notice_after is None and sys.stdin.isatty():
                input("press Enter to send the preemption notice\n")
                fake.preempt_now()
            while True:
                with fake._cond:
                    fake._preempted()
                    noticed = fake.noticed_at
                if noticed is not None:
                    print(f"notice sent at {_iso(noticed)}; Ctrl-C to stop", flush=True)
                    break
                time.sleep(0.2)
            threading.Event().wait()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
