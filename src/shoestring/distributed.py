"""Who am I in a multi-process job, and the process group that connects us.

Launchers describe the job in environment variables: torchrun sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; ``srun``
without torchrun sets ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID`` and
``SLURM_JOB_NODELIST``. :meth:`DistEnv.from_environ` reads them once, at the CLI
edge; everything below receives the resulting object. Rendezvous and
collectives are torch.distributed's own (``env://`` or ``tcp://`` init), never
ours.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job. ``world_size == 1`` means a plain single process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    init_method: str = "env://"
    source: str = "single"  # single | torchrun | slurm

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> DistEnv:
        if "RANK" in env and "WORLD_SIZE" in env:
            return cls(
                rank=int(env["RANK"]),
                world_size=int(env["WORLD_SIZE"]),
                local_rank=int(env.get("LOCAL_RANK", "0")),
                source="torchrun",
            )
        ntasks = int(env.get("SLURM_NTASKS", "1") or 1)
        if ntasks > 1 and "SLURM_PROCID" in env:
            host = first_host(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", ""))
            port = int(env.get("MASTER_PORT") or 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
            addr = env.get("MASTER_ADDR") or host or "127.0.0.1"
            return cls(
                rank=int(env["SLURM_PROCID"]),
                world_size=ntasks,
                local_rank=int(env.get("SLURM_LOCALID", "0")),
                init_method=f"tcp://{addr}:{port}",
                source="slurm",
            )
        return cls()


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``node[03-05,9],gpu1`` → ``node03``."""
    nodelist = nodelist.strip()
    if not nodelist:
        return ""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        return nodelist
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def pick_backend(requested: str) -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


class ProcessGroups:
    """The training process group plus a separate gloo group for checkpoint traffic.

    DCP's async save runs collectives from a background thread; giving it its own
    group keeps them from interleaving with the training thread's collectives.
    Use as a context manager: the groups are destroyed on exit.
    """

    def __init__(self, env: DistEnv, backend: str, timeout_s: float) -> None:
        self.env = env
        self.backend = pick_backend(backend)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.checkpoint_group: Any = None

    def __enter__(self) -> ProcessGroups:
        import torch.distributed as dist

        if self.backend == "nccl":  # pragma: no cover - GPU only
            torch.cuda.set_device(self.env.local_rank)
        # A process no launcher started (one rank sharding alone) meets no one: an
        # in-memory store instead of env:// (no MASTER_ADDR, no port, no file).
        alone = self.env.source == "single"
        where: dict[str, Any] = {"init_method": self.env.init_method}
        if alone:  # HashStore: torch.distributed's own, missing from its __all__
            where = {"store": dist.HashStore()}  # type: ignore[attr-defined]
        dist.init_process_group(
            self.backend,
            rank=self.env.rank,
            world_size=self.env.world_size,
            timeout=self.timeout,
            **where,
        )
        self.checkpoint_group = dist.new_group(backend="gloo", timeout=self.timeout)
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
