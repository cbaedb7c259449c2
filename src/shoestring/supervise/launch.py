"""The command line that starts one attempt of a job.

One process: the command itself. Several: torchrun (``python -m
torch.distributed.run``) with ``--no-python`` so COMMAND can be any executable
(``shoestring finetune ...``, ``python train.py``). torchrun does the
rendezvous and restarts nothing itself (``--max-restarts 0``): restarts are
the supervisor's, so a restart after a preemption, a crash or a hang follows
one policy. With several nodes (``--nnodes``, or a multi-node Slurm
allocation: the ``SLURM_*`` variables fill what the flags leave unset) every
node runs one ``shoestring run``; their torchrun agents meet in a c10d
rendezvous hosted by node 0.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from shoestring.config import ConfigError
from shoestring.supervise.config import RunConfig

RDZV_PORT = 29400


@dataclass(frozen=True)
class Nodes:
    """This node's place in the job; ``count == 1``: a single node."""

    count: int = 1
    rank: int = 0
    endpoint: str = ""  # HOST[:PORT] of the c10d rendezvous, on node 0
    rdzv_id: str = "shoestring"
    local_addr: str = ""  # torchrun --local-addr; "" = torchrun finds it from the hostname

    @classmethod
    def resolve(cls, cfg: RunConfig, env: Mapping[str, str]) -> Nodes:
        """The flags, else Slurm's variables, else one node; a ConfigError if they
        cannot describe a job (a rank out of range, no rendezvous endpoint)."""
        count = cfg.nnodes if cfg.nnodes is not None else int(env.get("SLURM_NNODES") or 1)
        rank = cfg.node_rank if cfg.node_rank is not None else int(env.get("SLURM_NODEID") or 0)
        if rank >= count:
            raise ConfigError(f"run: --node-rank {rank} is not below --nnodes {count}")
        endpoint = cfg.rdzv_endpoint
        if not endpoint and count > 1 and env.get("SLURM_JOB_NODELIST"):
            from shoestring.distributed import first_host  # (imports torch: only when needed)

            endpoint = f"{first_host(env['SLURM_JOB_NODELIST'])}:{RDZV_PORT}"
        if count > 1 and not endpoint:
            raise ConfigError(
                f"run: --nnodes {count} needs --rdzv-endpoint HOST[:PORT], node 0's address "
                "(the same on every node)"
            )
        rdzv_id = cfg.rdzv_id or env.get("SLURM_JOB_ID") or "shoestring"
        return cls(count, rank, endpoint, rdzv_id, cfg.local_addr)

    def torchrun_args(self) -> list[str]:
        """The node rank only decides who hosts the rendezvous store (``is_host``, node 0):
        torchrun's own guess compares the endpoint with the addresses the hostname
        resolves to, which misses in containers, network namespaces and on hosts whose
        name maps to 127.0.x.1. torchrun ignores ``--node-rank`` under c10d (the
        rendezvous orders the nodes by address) and warns if given one: not passed."""
        args = [
            "--nnodes",
            str(self.count),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            self.endpoint,
            "--rdzv-id",
            self.rdzv_id,
            "--rdzv-conf",
            f"is_host={int(self.rank == 0)}",
        ]
        return args + (["--local-addr", self.local_addr] if self.local_addr else [])


@dataclass(frozen=True)
class LaunchSpec:
    command: tuple[str, ...]
    nproc_per_node: int = 1
    nodes: Nodes = Nodes()


def launch_argv(spec: LaunchSpec) -> list[str]:
    if spec.nproc_per_node <= 1 and spec.nodes.count <= 1:
        return list(spec.command)
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(spec.nproc_per_node),
        "--max-restarts",
        "0",
    ]
    argv += spec.nodes.torchrun_args() if spec.nodes.count > 1 else ["--standalone"]
    return argv + ["--no-python", *spec.command]


def launch_env(nodes: Nodes, env: Mapping[str, str]) -> dict[str, str]:
    """The job's environment: with ``--local-addr``, gloo (training under gloo, and every
    job's checkpoint group) binds to the interface holding that address. Left alone, gloo
    binds to what the hostname resolves to, often a loopback address the other nodes
    cannot reach. An explicit ``GLOO_SOCKET_IFNAME`` wins."""
    out = dict(env)
    if nodes.local_addr and "GLOO_SOCKET_IFNAME" not in env:
        out["GLOO_SOCKET_IFNAME"] = interface_of(nodes.local_addr)
    return out


def interface_of(addr: str) -> str:
    """The network interface that holds ``addr``; a ConfigError naming them if none."""
    import psutil

    ifaces = psutil.net_if_addrs()
    for name, addrs in ifaces.items():
        if any(a.address.split("%")[0] == addr for a in addrs):
            return name
    held = ", ".join(
        f"{name} {a.address}"
        for name, addrs in sorted(ifaces.items())
        for a in addrs
        if a.family in (socket.AF_INET, socket.AF_INET6)
    )
    raise ConfigError(
        f"run: --local-addr {addr} is not an address of this machine ({held or 'none'})"
    )
