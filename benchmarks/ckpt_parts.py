"""What a checkpoint's blocking time is made of, on the device (gpu_check (d)).

The trainer's save blocks for ``state.capture`` (the optimizer's state dict, the RNG
states: references, no copies) and ``HostBuffers.stage`` (each tensor copied into its
reused pinned host buffer on a side stream, then a synchronize). At 0.86B with LoRA r16
on every linear that is 672 tensors (224 adapters, 448 AdamW moments), 111 MB. Measured
here on the same shapes, live on the device, each part alone (median of ``repeat``):

* ``capture_ms``: ``state.capture`` of the adapters + a stepped torch AdamW;
* ``stage_first_ms`` / ``stage_ms``: the first copy-out (allocates the pinned buffers),
  then the steady one, as the writer does it (one ``copy_`` per tensor);
* ``coalesced_ms``: the candidate fix, the same bytes in one copy: ``torch.cat`` of the
  flattened tensors per dtype on the device, one copy into one reused pinned buffer;
* ``h2d_floor_ms``: one device-to-host copy of that many bytes, already contiguous.

If ``stage_ms`` is far above ``coalesced_ms``, the blocking is per-tensor overhead (launch
and Python per copy), and the fix is the coalesced copy-out; if both sit near
``h2d_floor_ms``, it is the bus, and only an asynchronous copy (an event the background
thread waits on) hides it.

    python benchmarks/ckpt_parts.py [--device cpu] [--small]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from shoestring.checkpoint.writer import HostBuffers  # noqa: E402
from shoestring.train import state as S  # noqa: E402
from shoestring.train.learner import Learner  # noqa: E402

#: The 0.86B Llama of gpu_check (hidden 2048, 16 layers, GQA 16/4, FFN 5632), LoRA r16.
BIG = {"hidden": 2048, "layers": 16, "kv": 512, "ffn": 5632, "r": 16}
SMALL = {"hidden": 256, "layers": 2, "kv": 64, "ffn": 512, "r": 8}


def lora_params(shape: dict[str, int], device: torch.device) -> dict[str, torch.nn.Parameter]:
    h, kv, f, r = shape["hidden"], shape["kv"], shape["ffn"], shape["r"]
    linears = {"q": (h, h), "k": (h, kv), "v": (h, kv), "o": (h, h),
               "gate": (h, f), "up": (h, f), "down": (f, h)}  # fmt: skip
    out: dict[str, torch.nn.Parameter] = {}
    for layer in range(shape["layers"]):
        for name, (din, dout) in linears.items():
            for ab, shp in (("A", (r, din)), ("B", (dout, r))):
                t = torch.randn(shp, device=device) * 0.01
                out[f"{layer}.{name}.lora_{ab}"] = torch.nn.Parameter(t)
    return out


def timed(device: torch.device, fn: Callable[[], Any], repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def coalesced(device: torch.device) -> Callable[[dict[str, dict[str, torch.Tensor]]], None]:
    """The candidate copy-out: one device-side concatenation and one host copy per dtype."""
    bufs: dict[torch.dtype, torch.Tensor] = {}

    def copy_out(tensors: dict[str, dict[str, torch.Tensor]]) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for d in tensors.values():
            for t in d.values():
                if t.device == device:
                    by_dtype.setdefault(t.dtype, []).append(t.detach().reshape(-1))
        for dtype, parts in by_dtype.items():
            flat = torch.cat(parts)
            buf = bufs.get(dtype)
            if buf is None or buf.numel() != flat.numel():
                buf = bufs[dtype] = torch.empty(
                    flat.numel(), dtype=dtype, pin_memory=device.type == "cuda"
                )
            buf.copy_(flat, non_blocking=device.type == "cuda")
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    return copy_out


def measure(device: torch.device, small: bool, repeat: int = 7) -> dict[str, Any]:
    if device.type == "cpu":  # OpenMP's copy threads spin on a busy 2-core box
        torch.set_num_threads(1)
    params = lora_params(SMALL if small else BIG, device)
    opt = torch.optim.AdamW(list(params.values()), lr=1e-4)
    for p in params.values():
        p.grad = torch.randn_like(p)
    opt.step()  # moments exist, as after a training step
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    learner = Learner(None, torch.nn.Module(), params, opt, sched, None)

    def capture() -> Any:
        return S.capture(S.Progress(), learner, rank=0, config={}, meta={})

    snap = capture()
    on_device = {f: {k: t for k, t in d.items() if t.device == device}
                 for f, d in snap.tensors.items()}  # fmt: skip
    n = sum(len(d) for d in on_device.values())
    nbytes = sum(t.numel() * t.element_size() for d in on_device.values() for t in d.values())
    host = HostBuffers()
    first = timed(device, lambda: host.stage(snap.tensors), 1)[0]
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    floor_buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    fix = coalesced(device)
    fix(snap.tensors)  # its buffers, allocated once like the writer's
    med = statistics.median
    return {
        "device": str(device),
        "shape": SMALL if small else BIG,
        "tensors": n,
        "bytes": nbytes,
        "capture_ms": med(timed(device, capture, repeat)),
        "stage_first_ms": first,
        "stage_ms": med(timed(device, lambda: host.stage(snap.tensors), repeat)),
        "coalesced_ms": med(timed(device, lambda: fix(snap.tensors), repeat)),
        "h2d_floor_ms": med(
            timed(device, lambda: floor_buf.copy_(flat, non_blocking=True), repeat)
        ),
        "repeat": repeat,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true")
    a = p.parse_args(argv)
    print(json.dumps(measure(torch.device(a.device), a.small), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
