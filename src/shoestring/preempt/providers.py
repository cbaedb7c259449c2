"""The clouds whose preemption notices shoestring watches: named once, here."""

from __future__ import annotations

from typing import Literal, get_args

Provider = Literal["aws", "gcp", "azure"]
PROVIDERS: tuple[Provider, ...] = get_args(Provider)
