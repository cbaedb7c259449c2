"""Azure Spot: ``Preempt`` scheduled events on the instance metadata service.

Protocol (learn.microsoft.com, "Azure Metadata Service: Scheduled Events for
Linux VMs"): ``GET /metadata/scheduledevents?api-version=2020-07-01`` with header
``Metadata: true`` (400 without it) returns ``{"DocumentIncarnation": n,
"Events": [{"EventId", "EventType", "EventStatus", "Resources", "NotBefore",
...}]}``. Spot eviction is ``EventType: "Preempt"`` with ``NotBefore`` at least
30 s ahead; ``Terminate`` also ends the VM and counts as a notice here.
``Reboot``, ``Redeploy`` and ``Freeze`` are logged as early warnings only.

Events are sent to every VM of an availability set or scale-set placement group,
so an event counts only if ``Resources`` names this VM (read once from
``/metadata/instance/compute/name``; if that fails, every event counts: a false
stop costs one resume, a missed one costs the work since the last checkpoint).

The service starts lazily: the first call can take up to 2 minutes. The watcher
thread makes that call at startup with a long timeout, so training never waits.

Not done, on purpose: acknowledging the event (``POST`` ``StartRequests``). It
only lets Azure evict the VM *before* ``NotBefore``, which shortens the time left
for other ranks, a remote upload or the logs; nothing is gained by it.
"""

from __future__ import annotations

import email.utils
import json
import urllib.parse
from typing import Any

from shoestring.preempt.notice import Http, MetadataError, Notice

API_VERSION = "2020-07-01"
EVENTS_PATH = "/metadata/scheduledevents"
NAME_PATH = "/metadata/instance/compute/name"
PREEMPTING = ("Preempt", "Terminate")
WARNING_ONLY = ("Reboot", "Redeploy", "Freeze")


def parse_rfc1123(text: str) -> float | None:
    """``Mon, 19 Sep 2016 18:29:47 GMT`` -> epoch seconds; empty (event started) -> None."""
    if not text:
        return None
    return email.utils.parsedate_to_datetime(text).timestamp()


class AzureScheduledEventsSource:
    """Polls scheduled events; the first call (the warm-up) may take minutes."""

    provider = "azure"

    def __init__(
        self,
        base: str = "http://169.254.169.254",
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
        first_timeout_s: float = 150.0,
    ) -> None:
        self.base = base.rstrip("/")
        self.endpoint = f"{self.base}{EVENTS_PATH}?api-version={API_VERSION}"
        self.interval_s, self.timeout_s, self.first_timeout_s = (
            interval_s,
            timeout_s,
            first_timeout_s,
        )
        self._http = Http()
        self._warm = False
        self._vm_name: str | None = None
        self._name_tried = False
        self._incarnation: Any = None
        self._seen: set[str] = set()

    def _name(self) -> str | None:
        if not self._name_tried:
            self._name_tried = True
            q = urllib.parse.urlencode({"api-version": "2021-02-01", "format": "text"})
            try:
                r = self._http.request(
                    "GET", f"{self.base}{NAME_PATH}?{q}", {"Metadata": "true"}, self.timeout_s
                )
                if r.status == 200 and r.body.strip():
                    self._vm_name = r.body.decode().strip()
            except OSError:
                pass  # every event counts (see the module docstring)
        return self._vm_name

    def _ours(self, event: dict[str, Any]) -> bool:
        name = self._name()
        return name is None or name in (event.get("Resources") or [])

    def poll(self) -> Notice | None:
        timeout = self.timeout_s if self._warm else self.first_timeout_s
        r = self._http.request("GET", self.endpoint, {"Metadata": "true"}, timeout)
        if r.status != 200:
            raise MetadataError(f"{EVENTS_PATH}: HTTP {r.status} {r.body[:200]!r}")
        if not self._warm:
            self._warm = True
            self._name()  # now, not in the middle of a notice
        doc = json.loads(r.body)
        incarnation = doc.get("DocumentIncarnation")
        if incarnation is not None and incarnation == self._incarnation:
            return None  # the document did not change
        fresh = [
            ev
            for ev in doc.get("Events") or []
            if ev.get("EventType") in PREEMPTING + WARNING_ONLY
            and str(ev.get("EventId", "")) not in self._seen
            and self._ours(ev)
        ]
        fresh.sort(key=lambda ev: ev.get("EventType") not in PREEMPTING)  # stops first
        if len(fresh) <= 1:  # else come back for the rest before skipping this document
            self._incarnation = incarnation
        if not fresh:
            return None
        ev = fresh[0]
        kind, eid = str(ev["EventType"]), str(ev.get("EventId", ""))
        self._seen.add(eid)
        not_before = str(ev.get("NotBefore") or "")
        return Notice(
            "azure",
            kind,
            f"azure scheduled event (EventType={kind}, NotBefore={not_before or '-'}, "
            f"EventId={eid})",
            deadline=parse_rfc1123(not_before),
            preempting=kind in PREEMPTING,
            detail=ev,
        )
