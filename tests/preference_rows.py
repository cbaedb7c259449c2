"""Preference pairs shared by the preference tests (no TRL import: the FSDP tests use
them where TRL may be missing)."""

from __future__ import annotations

#: Four reversal pairs; answers of different lengths, so per-token means and sums differ.
ROWS = [
    {"prompt": "reverse: abcd =", "chosen": " dcba", "rejected": " abcd"},
    {"prompt": "reverse: qwxyz =", "chosen": " zyxwq", "rejected": " qwxzy"},
    {"prompt": "reverse: mn =", "chosen": " nm", "rejected": " mnn"},
    {"prompt": "reverse: hijklmo =", "chosen": " omlkjih", "rejected": " hij"},
]
#: A fifth pair: an odd number, so batches split over two ranks are uneven.
ODD_ROW = {"prompt": "reverse: tuv =", "chosen": " vut", "rejected": " tvu"}
