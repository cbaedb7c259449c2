"""Choose the cloud notice source for this machine: by config, or detected from DMI.

Detection reads a few small files under ``/sys/class/dmi/id`` (the firmware's
vendor strings): microseconds, no network. Probing 169.254.169.254 instead would
cost a timeout on every non-cloud machine and could hit the wrong provider's
service behind some NATs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol, cast

from shoestring.config import ConfigError
from shoestring.preempt.aws import HOP_LIMIT_HINT, AwsSpotSource
from shoestring.preempt.azure import AzureScheduledEventsSource
from shoestring.preempt.flag import PreemptionFlag
from shoestring.preempt.gcp import GcpPreemptedSource
from shoestring.preempt.notice import Emit, NoticeSource, NoticeWatcher
from shoestring.preempt.providers import PROVIDERS, Provider

log = logging.getLogger("shoestring.preempt")

#: All three services live at the link-local address (GCP also answers as
#: metadata.google.internal; the address needs no DNS, which containers may lack).
DEFAULT_BASE = "http://169.254.169.254"
#: Azure's fixed chassis asset tag; plain Hyper-V shares the "Microsoft Corporation" vendor.
AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"
DMI_DIR = Path("/sys/class/dmi/id")


class PreemptSettings(Protocol):
    """The ``preempt.*`` config keys this module reads (read-only: a ``Literal`` field
    of the config satisfies ``str``)."""

    @property
    def cloud(self) -> str: ...

    @property
    def metadata_url(self) -> str: ...

    @property
    def poll_s(self) -> float: ...


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:  # missing on non-x86/containers; some files are root-only
        return ""


def detect_cloud(
    dmi_dir: Path = DMI_DIR, hypervisor_uuid: Path = Path("/sys/hypervisor/uuid")
) -> str | None:
    """'aws', 'gcp', 'azure' or None, from the DMI vendor strings (no network)."""
    f = {
        n: _read(dmi_dir / n)
        for n in (
            "sys_vendor",
            "product_name",
            "bios_vendor",
            "bios_version",
            "chassis_asset_tag",
            "board_asset_tag",
        )
    }
    low = {k: v.lower() for k, v in f.items()}
    if (
        "amazon" in low["sys_vendor"]
        or "amazon" in low["bios_vendor"]
        or "amazon" in low["bios_version"]
        or f["board_asset_tag"].startswith("i-")
        or _read(hypervisor_uuid).lower().startswith("ec2")
    ):  # older Xen instances
        return "aws"
    if (
        "google" in low["sys_vendor"]
        or "google compute engine" in low["product_name"]
        or "google" in low["bios_vendor"]
    ):
        return "gcp"
    if f["chassis_asset_tag"] == AZURE_ASSET_TAG:
        return "azure"
    return None


#: Each provider's notice source, from the metadata service's base URL and poll period.
SOURCES: dict[Provider, Callable[[str, float], NoticeSource]] = {
    "aws": lambda base, poll_s: AwsSpotSource(base, interval_s=poll_s),
    "gcp": lambda base, _poll_s: GcpPreemptedSource(base),
    "azure": lambda base, poll_s: AzureScheduledEventsSource(base, interval_s=poll_s),
}


def make_source(provider: str, base: str = DEFAULT_BASE, poll_s: float = 1.0) -> NoticeSource:
    """The notice source of ``provider`` talking to the metadata service at ``base``."""
    make = SOURCES.get(cast(Provider, provider))
    if make is None:
        raise ValueError(f"unknown cloud provider {provider!r} (one of {', '.join(PROVIDERS)})")
    return make(base, poll_s)


def resolve_provider(cloud: str, metadata_url: str = "", dmi_dir: Path = DMI_DIR) -> str | None:
    """The provider to watch for ``preempt.cloud``, or None. Raises ConfigError when
    ``metadata_url`` is set but the provider would have to be guessed."""
    if cloud == "none":
        return None
    if cloud == "auto":
        if metadata_url:
            raise ConfigError(
                "preempt.metadata_url is set, so preempt.cloud must name the "
                f"provider it serves ({'|'.join(PROVIDERS)}), not 'auto'"
            )
        return detect_cloud(dmi_dir)
    if cloud not in PROVIDERS:
        raise ConfigError(f"preempt.cloud: unknown provider {cloud!r}")
    return cloud


def cloud_watcher(
    settings: PreemptSettings,
    flag: PreemptionFlag,
    emit: Emit | None = None,
    *,
    local_rank: int = 0,
    dmi_dir: Path = DMI_DIR,
) -> AbstractContextManager[object]:
    """A started-on-enter :class:`NoticeWatcher` for this machine, or a no-op.

    One watcher per node is enough: only local rank 0 polls. The training loop
    all-reduces the flag every step, so a notice seen by one rank stops all ranks
    after the same step (and a watcher on every rank would be just as correct).
    """
    provider = resolve_provider(settings.cloud, settings.metadata_url, dmi_dir)
    if provider is None or local_rank != 0:
        return contextlib.nullcontext()
    source = make_source(provider, settings.metadata_url or DEFAULT_BASE, settings.poll_s)
    return NoticeWatcher(source, flag, emit, hint=HOP_LIMIT_HINT if provider == "aws" else "")
