"""AWS EC2 Spot: the interruption notice on the instance metadata service (IMDSv2).

Protocol (docs.aws.amazon.com, "Spot Instance interruption notices"; "Use IMDSv2"):
``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds`` returns a
session token; every ``GET`` sends it as ``X-aws-ec2-metadata-token`` (401 when it
is missing or expired). ``/latest/meta-data/spot/instance-action`` is 404 until
the interruption is scheduled, then ``{"action": "terminate|stop|hibernate",
"time": "<ISO 8601 UTC>"}`` about two minutes ahead (best effort). AWS suggests
polling every 5 s. ``/latest/meta-data/events/recommendations/rebalance`` gives
an earlier, softer hint (``{"noticeTime": ...}``): logged, not acted on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime

from shoestring.preempt.notice import Http, MetadataError, Notice, Response

TOKEN_PATH = "/latest/api/token"
ACTION_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
#: Why a token PUT times out inside a container on EC2: the PUT's response has an IP
#: hop limit of 1 by default and dies at the container bridge.
HOP_LIMIT_HINT = (
    " (inside a container on EC2, the IMDSv2 token PUT times out unless the "
    "instance's metadata hop limit is 2: aws ec2 modify-instance-metadata-options "
    "--http-put-response-hop-limit 2)"
)


def parse_iso8601(text: str) -> float:
    """``2026-12-03T08:22:00Z`` (IMDS style) -> epoch seconds."""
    return datetime.fromisoformat(text.strip().replace("Z", "+00:00")).timestamp()


class AwsSpotSource:
    """Polls ``spot/instance-action`` with an IMDSv2 token, refreshed before it expires."""

    provider = "aws"

    def __init__(
        self,
        base: str = "http://169.254.169.254",
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
        token_ttl_s: int = 21600,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.base = base.rstrip("/")
        self.endpoint = self.base + ACTION_PATH
        self.interval_s, self.timeout_s, self.token_ttl_s = interval_s, timeout_s, token_ttl_s
        self._clock = clock
        self._http = Http()
        self._token: str | None = None
        self._token_expires = 0.0
        self._rebalance_seen = False

    def _fresh_token(self) -> str:
        # Refresh at 80 % of the TTL: a token expiring between our check and the
        # GET would cost one 401 round trip at the worst moment.
        if self._token is None or self._clock() >= self._token_expires:
            r = self._http.request(
                "PUT", self.base + TOKEN_PATH, {TTL_HEADER: str(self.token_ttl_s)}, self.timeout_s
            )
            if r.status != 200 or not r.body:
                raise MetadataError(f"IMDSv2 token: HTTP {r.status}")
            self._token = r.body.decode().strip()
            self._token_expires = self._clock() + 0.8 * self.token_ttl_s
        return self._token

    def _get(self, path: str) -> Response:
        for _ in range(2):  # one retry with a new token after a 401
            r = self._http.request(
                "GET", self.base + path, {TOKEN_HEADER: self._fresh_token()}, self.timeout_s
            )
            if r.status != 401:
                return r
            self._token = None
        raise MetadataError(f"IMDSv2: {path} refused a fresh token (HTTP 401)")

    def poll(self) -> Notice | None:
        r = self._get(ACTION_PATH)
        if r.status == 200:
            doc = json.loads(r.body)
            action, when = str(doc["action"]), str(doc["time"])
            return Notice(
                "aws",
                action,
                f"aws spot interruption (action={action}, time={when})",
                deadline=parse_iso8601(when),
                detail=doc,
            )
        if r.status != 404:
            raise MetadataError(f"{ACTION_PATH}: HTTP {r.status}")
        if not self._rebalance_seen:
            r = self._get(REBALANCE_PATH)
            if r.status == 200:
                self._rebalance_seen = True
                doc = json.loads(r.body)
                return Notice(
                    "aws",
                    "rebalance",
                    f"aws rebalance recommendation (noticeTime={doc.get('noticeTime')})",
                    preempting=False,
                    detail=doc,
                )
            if r.status != 404:
                raise MetadataError(f"{REBALANCE_PATH}: HTTP {r.status}")
        return None
