"""The command line that starts one attempt of a job.

One process: the command itself. Several: torchrun (``python -m
torch.distributed.run``) with ``--no-python`` so COMMAND can be any executable
(``shoestring finetune ...``, ``python train.py``). torchrun does the
rendezvous and restarts nothing itself (``--max-restarts 0``): restarts are
the supervisor's, so a restart after a preemption, a crash or a hang follows
one policy. Under Slurm with several nodes, the rendezvous endpoint, node
count and rank come from the ``SLURM_*`` variables.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchSpec:
    command: tuple[str, ...]
    nproc_per_node: int = 1
    rdzv_port: int = 29400


def launch_argv(spec: LaunchSpec, env: Mapping[str, str]) -> list[str]:
    if spec.nproc_per_node <= 1 and int(env.get("SLURM_NNODES", "1") or 1) <= 1:
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
    nnodes = int(env.get("SLURM_NNODES", "1") or 1)
    if nnodes > 1:
        from shoestring.distributed import first_host  # (imports torch: only when needed)

        host = first_host(env.get("SLURM_JOB_NODELIST", ""))
        argv += [
            "--nnodes",
            str(nnodes),
            "--node-rank",
            env.get("SLURM_NODEID", "0"),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{host}:{spec.rdzv_port}",
            "--rdzv-id",
            env.get("SLURM_JOB_ID", "shoestring"),
        ]
    else:
        argv += ["--standalone"]
    return argv + ["--no-python", *spec.command]
