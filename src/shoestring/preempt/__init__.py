"""Preemption: one flag, many sources (signals, AWS/GCP/Azure metadata notices)."""

from shoestring.preempt.cloud import cloud_watcher, detect_cloud
from shoestring.preempt.flag import PreemptionFlag, SignalSource
from shoestring.preempt.notice import Notice, NoticeSource, NoticeWatcher

__all__ = [
    "Notice",
    "NoticeSource",
    "NoticeWatcher",
    "PreemptionFlag",
    "SignalSource",
    "cloud_watcher",
    "detect_cloud",
]
