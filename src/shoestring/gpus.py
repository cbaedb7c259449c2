"""Built-in GPU catalog: memory, peak dense tensor FLOP/s, hourly prices with sources.

Prices move 3-4x between venues and month to month; every entry says where its
number came from and when, and ``price_note`` says when it is an estimate. The
planner prints the date so a stale table is visible. Memory is what
``nvidia-smi`` reports as total (the allocator can use a little less).
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int
    bf16_flops: float  # dense tensor-core peak, FLOP/s (0: no bf16)
    fp16_flops: float
    on_demand_usd_h: float
    spot_usd_h: float
    price_source: str
    price_date: str
    price_note: str = ""
    #: Expected spot interruptions per hour (assumption; providers do not publish rates).
    preemptions_per_hour: float = 0.05

    def peak_flops(self, dtype: str) -> float:
        if dtype == "bfloat16":
            return self.bf16_flops
        if dtype == "float16":
            return self.fp16_flops
        return self.fp16_flops / 4  # fp32 through TF32-less paths: a rough quarter


_GM = "GPU Markets daily spot fixing (median across venues)"
CATALOG: dict[str, GPU] = {
    g.name: g
    for g in (
        GPU(
            "T4",
            15360 * MiB,
            0.0,
            65e12,
            0.35,
            0.12,
            "computeprices.com (GCP on-demand); spot: estimate",
            "2026-03-31",
            "spot assumed ~35% of on-demand: no published 2026 T4 spot figure found",
        ),
        GPU(
            "L4",
            23034 * MiB,
            121e12,
            121e12,
            0.75,
            0.268,
            f"costnimbus (GCP g2-standard-4 ~$0.70-0.80 on-demand); {_GM}",
            "2026-04-18",
        ),
        GPU(
            "A10G",
            23028 * MiB,
            70e12,
            70e12,
            1.01,
            0.40,
            "AWS g5.xlarge list price (unverified recollection); spot: estimate",
            "2026-03",
            "no clean 2026 A10G cloud source found; spot assumed ~40% of on-demand",
        ),
        GPU(
            "A100-40GB",
            40960 * MiB,
            312e12,
            312e12,
            1.29,
            0.25,
            "on-demand: specialty-cloud estimate; spot: pulsebenchmarks export (one provider)",
            "2026-04",
            "on-demand is an estimate (Mercatus gives $1.10-1.50 for the 80 GB part)",
        ),
        GPU(
            "A100-80GB",
            81920 * MiB,
            312e12,
            312e12,
            1.50,
            1.128,
            f"Mercatus (on-demand, specialty $1.10-1.50, hyperscaler $1.50-3.00); {_GM}",
            "2026-05",
        ),
        GPU(
            "H100",
            81559 * MiB,
            989e12,
            989e12,
            3.00,
            2.05,
            f"costnimbus (GCP A3 on-demand); {_GM} range $1.49-2.61, midpoint",
            "2026-04-18",
        ),
        GPU(
            "H200",
            143771 * MiB,
            989e12,
            989e12,
            3.80,
            2.50,
            "estimate (no price in the research notes)",
            "2026-12",
            "prices are placeholders; listed for benchmarks/plan_vs_cuda.py runs",
        ),
        GPU(
            "RTX3090",
            24576 * MiB,
            71e12,
            71e12,
            0.22,
            0.15,
            "marketplace estimate (not in the research notes)",
            "2026-12",
            "community-cloud figure, unverified",
        ),
        GPU(
            "RTX4090",
            24564 * MiB,
            165e12,
            165e12,
            0.34,
            0.25,
            "marketplace estimate (not in the research notes)",
            "2026-12",
            "community-cloud figure, unverified",
        ),
    )
}

_ALIASES = {
    "a100": "A100-80GB",
    "a100-80": "A100-80GB",
    "a100-40": "A100-40GB",
    "3090": "RTX3090",
    "4090": "RTX4090",
    "rtx-3090": "RTX3090",
    "rtx-4090": "RTX4090",
    "h100-80gb": "H100",
}


def find_gpu(name: str) -> GPU:
    """Look up a GPU by name (case-insensitive, a few aliases)."""
    key = name.strip().lower()
    for g in CATALOG.values():
        if g.name.lower() == key:
            return g
    if key in _ALIASES:
        return CATALOG[_ALIASES[key]]
    raise KeyError(f"unknown GPU {name!r}; known: {', '.join(CATALOG)}")


def detect_gpu_name(device_name: str) -> str | None:
    """Map ``torch.cuda.get_device_name()`` text to a catalog entry, if any."""
    d = device_name.upper().replace(" ", "")
    if "L40" in d:  # L40/L40S: 48 GB parts not in the catalog (and not an L4)
        return None
    if "A100" in d:
        return "A100-80GB" if "80" in d else "A100-40GB"
    for key, name in (
        ("H200", "H200"),
        ("H100", "H100"),
        ("L4", "L4"),
        ("A10G", "A10G"),
        ("T4", "T4"),
        ("3090", "RTX3090"),
        ("4090", "RTX4090"),
    ):
        if key in d:
            return name
    return None
