"""What watching costs, counted directly rather than inferred from noisy step times.

The A/B in ``watchdog.py`` compares median step times of separate runs; on a shared
2-core VM those medians move by +-15 % between identical runs, so a 1 % target cannot
be read from it. This script measures each cost the watch adds, in one process:

1. **Training thread**: the recorder calls one optimizer step makes under
   ``shoestring finetune`` with DDP (phases train_step/forward/backward/optimizer, two
   ``work`` records, one traced DDP all-reduce bucket, ``step_done``), timed over many
   iterations against the same calls on :class:`NullRecorder`.
2. **Recorder publish thread**: one ``publish()`` (snapshot + live.json replace) of a
   recorder filled like a long run's; it runs once per second.
3. **Supervisor**: one watchdog ``check_once()`` over N ranks' live.json (hang analysis,
   straggler check, degradation windows, metric sampling every 10th poll); it runs once
   per second, on a core the ranks share on a fully-subscribed machine.

4. **The DDP comm hook** (``--ddp``): the traced all-reduce hook (a Python callback and
   a ``Future.then`` per bucket) vs DDP's built-in C++ all-reduce, on a 1-process gloo
   group in this process: alternating blocks of forward+backward on two identical DDP
   models, median per-step difference.

Each is reported as a share of a reference step time (``--step-ms``, default: the
median step of ``watchdog.py``'s 2-process job on this machine) or of one core.

Usage: ``.venv/bin/python benchmarks/watch_cost.py [--ranks 2] [--step-ms 150] [--ddp]``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from _common import ROOT  # noqa: F401  (puts src/ on sys.path)
from shoestring.watch.degrade import DegradePolicy
from shoestring.watch.hang import HangPolicy
from shoestring.watch.metrics import MetricsSampler
from shoestring.watch.recorder import NullRecorder, Recorder
from shoestring.watch.watchdog import Watchdog


def one_step(rec, step: int) -> None:  # type: ignore[no-untyped-def]
    with rec.phase("train_step"):
        with rec.phase("data"):
            pass
        rec.work("data", 0.001, 256)
        with rec.phase("forward"):
            pass
        rec.work("forward", 0.05, 256)
        with rec.phase("backward"):
            if isinstance(rec, Recorder):  # what the DDP comm hook does per bucket
                seq = rec._begin("allreduce[ddp]", "default", [[123456]], "torch.float32")
                rec._end(seq)
        with rec.phase("optimizer"):
            pass
    rec.step_done(step)


def per_call_us(fn, n: int) -> float:  # type: ignore[no-untyped-def]
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        best.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(best)


def ddp_hook_us(blocks: int = 30, per_block: int = 20) -> tuple[float, float]:
    """(median step us without the hook, median extra us with it)."""
    import copy
    import os
    import socket

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        base = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
        plain, hooked = DDP(base), DDP(copy.deepcopy(base))
        with tempfile.TemporaryDirectory() as tmp, Recorder(Path(tmp), 0, interval_s=3600) as rec:
            hooked.register_comm_hook(None, rec.ddp_comm_hook)
            x = torch.randn(32, 256)

            def block(m) -> float:  # type: ignore[no-untyped-def]
                t0 = time.perf_counter()
                for _ in range(per_block):
                    m(x).sum().backward()
                return (time.perf_counter() - t0) / per_block * 1e6

            block(plain), block(hooked)
            pairs = [(block(plain), block(hooked)) for _ in range(blocks)]
            assert rec._seq > 0, "the comm hook never ran: nothing was measured"
    finally:
        dist.destroy_process_group()
    return statistics.median(p for p, _ in pairs), statistics.median(h - p for p, h in pairs)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--step-ms", type=float, default=150.0)
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--ddp", action="store_true", help="also time the DDP comm hook")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        recs = [Recorder(run, r, world_size=a.ranks, interval_s=3600) for r in range(a.ranks)]
        for r in recs:
            r.__enter__()
        try:
            null = NullRecorder()
            on = per_call_us(lambda i: one_step(recs[0], i), a.steps)
            off = per_call_us(lambda i: one_step(null, i), a.steps)
            for r in recs[1:]:
                for i in range(2000):
                    one_step(r, i)
            pub = per_call_us(lambda i: recs[0].publish(), 200)
            for r in recs:
                r.publish()
            wd = Watchdog(
                run,
                HangPolicy(),
                lambda v: None,
                degrade=DegradePolicy(),
                sampler=MetricsSampler(),
                metrics_interval_s=10.0,
            )
            wd._since = 0.0
            poll = per_call_us(lambda i: wd.check_once(), 200)
        finally:
            for r in recs:
                r.__exit__(None, None, None)
    step_us = a.step_ms * 1000
    train = on - off
    print(
        f"training thread: {on:.1f} us/step with the recorder vs {off:.1f} us on NullRecorder "
        f"-> +{train:.1f} us = {100 * train / step_us:.3f} % of a {a.step_ms:.0f} ms step"
    )
    print(f"recorder publish: {pub:.0f} us once per second = {pub / 1e4:.3f} % of one core")
    print(
        f"supervisor poll over {a.ranks} ranks: {poll:.0f} us once per second "
        f"= {poll / 1e4:.3f} % of one core"
    )
    hook = 0.0
    if a.ddp:
        base_us, hook = ddp_hook_us()
        print(
            f"DDP comm hook: +{hook:.1f} us per step over DDP's own all-reduce "
            f"(step without it {base_us:.0f} us) = {100 * hook / step_us:.3f} % of a "
            f"{a.step_ms:.0f} ms step"
        )
    total = 100 * (train + hook) / step_us + (pub * a.ranks + poll) / 1e4 / a.ranks
    print(
        f"upper bound on a fully-subscribed machine (every watch cycle taken from a rank): "
        f"{total:.3f} % per rank"
    )


if __name__ == "__main__":
    main()
