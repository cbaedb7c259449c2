"""GCP Spot / preemptible VMs: ``instance/preempted`` on the metadata server.

Protocol (cloud.google.com, "Detect if a VM was preempted"; "Waiting for
updates"): ``GET /computeMetadata/v1/instance/preempted`` with header
``Metadata-Flavor: Google`` (403 without it) returns ``FALSE`` or ``TRUE`` and an
``ETag``. ``?wait_for_change=true&last_etag=E&timeout_sec=T`` holds the request
until the value's ETag differs from ``E`` (returning at once if it already
does) or ``T`` seconds pass. Passing the last ETag is what makes a flip between
two long polls impossible to miss. The VM gets about 30 s (Spot) after the flip.
"""

from __future__ import annotations

import time
import urllib.parse

from shoestring.preempt.notice import Http, MetadataError, Notice

PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
#: Seconds between the preempted flag and the hard stop, for Spot and preemptible VMs.
GRACE_S = 30.0


class GcpPreemptedSource:
    """Long-polls ``instance/preempted``; ``poll`` blocks up to ``wait_s`` seconds."""

    provider = "gcp"

    def __init__(
        self, base: str = "http://169.254.169.254", wait_s: int = 60, timeout_s: float = 2.0
    ) -> None:
        self.base = base.rstrip("/")
        self.endpoint = self.base + PREEMPTED_PATH
        self.wait_s, self.timeout_s = wait_s, timeout_s
        self._http = Http()
        self._etag: str | None = None

    @property
    def interval_s(self) -> float:
        """0: the long poll does the waiting; 1 s of plain polling if there is no ETag."""
        return 0.0 if self._etag else 1.0

    def poll(self) -> Notice | None:
        if self._etag is None:  # first call (or after an answer without ETag): no waiting
            url, timeout = self.endpoint, self.timeout_s
        else:
            q = urllib.parse.urlencode(
                {"wait_for_change": "true", "last_etag": self._etag, "timeout_sec": self.wait_s}
            )
            url, timeout = f"{self.endpoint}?{q}", self.wait_s + self.timeout_s
        r = self._http.request("GET", url, {"Metadata-Flavor": "Google"}, timeout)
        if r.status != 200:
            raise MetadataError(f"{PREEMPTED_PATH}: HTTP {r.status}")
        if r.headers.get("Metadata-Flavor") != "Google":
            # Something else answered (a proxy, a captive portal): not the metadata server.
            raise MetadataError(f"{PREEMPTED_PATH}: response lacks Metadata-Flavor: Google")
        self._etag = r.headers.get("ETag")
        value = r.body.decode().strip().upper()
        if value == "TRUE":
            return Notice(
                "gcp",
                "preempt",
                "gcp preemption (instance/preempted=TRUE)",
                deadline=time.time() + GRACE_S,
                detail={"deadline_basis": f"seen + {GRACE_S:g} s (Spot grace)"},
            )
        if value != "FALSE":
            raise MetadataError(f"{PREEMPTED_PATH}: unexpected value {value[:40]!r}")
        return None
