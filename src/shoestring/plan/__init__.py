"""Memory, time and cost planning for fine-tuning, before anything heavy is loaded.

``Workload`` describes what is trained (shapes only); :func:`make_plan` turns it
and a catalog :class:`GPU` into a :class:`Plan`: a byte-level memory breakdown,
a fit verdict, the largest micro-batch / sequence that fit, advice, and time and
cost estimates. ``shoestring plan`` prints it; ``shoestring finetune`` checks it.
"""

from shoestring.gpus import CATALOG, GPU, find_gpu
from shoestring.plan.arch import PRESETS, Arch, load_arch
from shoestring.plan.estimate import Plan, Schedule, make_plan
from shoestring.plan.memory import Workload, activation_bytes

__all__ = [
    "Arch",
    "CATALOG",
    "GPU",
    "PRESETS",
    "Plan",
    "Schedule",
    "Workload",
    "activation_bytes",
    "find_gpu",
    "load_arch",
    "make_plan",
]
