"""Never stall silently: the per-rank recorder and the watchdog's hang analysis."""

from shoestring.watch.hang import HangPolicy, Verdict, analyze
from shoestring.watch.recorder import NullRecorder, Recorder

__all__ = ["HangPolicy", "NullRecorder", "Recorder", "Verdict", "analyze"]
