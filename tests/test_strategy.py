"""Strategy objects in 2 gloo processes: the per-step agreement, broadcasts, no-sync."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from shoestring.checkpoint import NO_FAULTS
from shoestring.distributed import DistEnv, ProcessGroups
from shoestring.preempt import PreemptionFlag
from shoestring.train.strategy import DDPStrategy, FSDPStrategy, SingleDevice


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    env = DistEnv(rank=rank, world_size=2, source="torchrun")
    results: dict[str, object] = {}
    with ProcessGroups(env, "gloo", 60) as groups:
        ddp = DDPStrategy(torch.device("cpu"), groups)
        flag = PreemptionFlag()
        results["loss"] = ddp.agree(torch.tensor(1.5 + rank, dtype=torch.float64), flag, NO_FAULTS)
        results["stop_before"] = ddp.stop_requested(flag)
        if rank == 1:
            flag.set("test")  # only rank 1 is told to stop
        ddp.agree(torch.tensor(0.0, dtype=torch.float64), flag, NO_FAULTS)
        results["stop_after"] = ddp.stop_requested(flag)
        results["flag_reason"] = flag.reason
        results["shared"] = ddp.share(f"from rank {rank}")
        results["evaluates"] = ddp.evaluates_here()
        results["grads"] = _ddp_grads(ddp, rank)
        results["fsdp_evaluates"] = FSDPStrategy(torch.device("cpu"), groups).evaluates_here()
    torch.save(results, Path(out) / f"rank{rank}.pt")


def _ddp_grads(ddp: DDPStrategy, rank: int) -> list[float]:
    """Gradient of one weight after a no-sync backward and after a synced one."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1, bias=False)
    wrapped = ddp.wrap(model, None)
    x = torch.tensor([[float(rank + 1)]])
    with ddp.grad_sync(wrapped, last=False):
        wrapped(x).sum().backward()
    local = float(model.weight.grad)  # not averaged: each rank its own
    model.weight.grad = None
    with ddp.grad_sync(wrapped, last=True):
        wrapped(x).sum().backward()
    return [local, float(model.weight.grad)]  # averaged over ranks


@pytest.mark.e2e
def test_strategies_agree_share_and_sync_across_two_gloo_ranks(tmp_path: Path) -> None:
    mp.start_processes(
        _worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn"
    )
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["loss"] == r1["loss"] == 1.5 + 2.5  # the global loss: a sum over ranks
    assert not r0["stop_before"] and not r1["stop_before"]
    # Rank 1's flag reached rank 0 through the agreement: both stop after the same step.
    assert r0["stop_after"] and r1["stop_after"]
    assert r0["flag_reason"] == "peer" and r1["flag_reason"] == "test"
    assert r0["shared"] == r1["shared"] == "from rank 0"
    assert (r0["evaluates"], r1["evaluates"]) == (True, False)  # DDP: rank 0 alone
    assert r0["fsdp_evaluates"] and r1["fsdp_evaluates"]  # FSDP2: every rank in lockstep
    assert (r0["grads"][0], r1["grads"][0]) == (1.0, 2.0)  # no_sync kept local gradients
    assert r0["grads"][1] == r1["grads"][1] == 1.5  # the last micro-batch averages


def test_single_device_needs_no_collectives() -> None:
    s = SingleDevice(torch.device("cpu"))
    flag = PreemptionFlag()
    assert s.agree(torch.tensor(2.5, dtype=torch.float64), flag, NO_FAULTS) == 2.5
    assert s.share({"x": 1}) == {"x": 1} and s.evaluates_here() and s.world_size == 1
    assert not s.stop_requested(flag)
    flag.set("test")
    assert s.stop_requested(flag)  # one process reads its live flag
