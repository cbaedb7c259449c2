"""Views of a run directory: ``shoestring report`` (one self-contained HTML file) and
``shoestring top`` (a live terminal view). Both only read files the run writes
(``events.jsonl`` of every rank, ``ranks/rank<R>/live.json``); see docs/report.md."""

from shoestring.report.timeline import Timeline, load

__all__ = ["Timeline", "load"]
