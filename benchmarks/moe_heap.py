"""A QLoRA step of an MoE on a CPU under three host-heap policies: anon RSS at load
(sampled peak), after one forward and backward, and after glibc's ``malloc_trim``.

``default``: glibc's own (what finetune runs with; it trims once after the load);
``mmap``: glibc's mmap threshold fixed at 4 MB (blocks from that size unmapped when
freed); ``steady``: that plus oneDNN's primitive caches cut to 8 entries (what
``shoestring infer`` runs with, ``shoestring.heap.steady_memory``); ``primitives``:
only oneDNN's own primitive cache cut to 8; ``ideep``: only ideep's (torch's oneDNN
wrapper) cut to 8; ``trim``: glibc's defaults, the heap trimmed between the two steps.

    python benchmarks/moe_heap.py ~/.cache/shoestring/realshape-olmoe-1b-7b-s0-v1 --policy default
    python benchmarks/moe_heap.py MODEL_DIR --cached QBASE_DIR --policy ideep --seq 512
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import threading
import time
from pathlib import Path

import torch

from shoestring.heap import MMAP_THRESHOLD, steady_memory, trim_heap
from shoestring.train.config import LoraSection, ModelConfig
from shoestring.train.model import apply_lora, load_base_model, load_prequantized


def anon() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument(
        "--policy",
        default="default",
        choices=["default", "mmap", "steady", "primitives", "ideep", "trim"],
    )
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--cached", type=Path, help="a quantized-base cache entry to load instead")
    args = ap.parse_args()
    peak = [0]

    def sample() -> None:
        while True:
            peak[0] = max(peak[0], anon())
            time.sleep(0.05)

    threading.Thread(target=sample, daemon=True).start()
    torch.set_num_threads(2)
    if args.policy == "steady":
        steady_memory()
    elif args.policy == "mmap":
        ctypes.CDLL("libc.so.6").mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD
    elif args.policy in ("primitives", "ideep"):  # read when oneDNN first runs
        name = (
            "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
            if args.policy == "primitives"
            else "LRU_CACHE_CAPACITY"
        )
        os.environ[name] = "8"
    out: dict[str, object] = {"policy": args.policy}
    t0 = time.time()
    cfg = ModelConfig(path=str(args.model_dir), dtype="bfloat16")
    if args.cached:
        model = load_prequantized(args.cached, args.model_dir, cfg, "cpu")
    else:
        model = load_base_model(args.model_dir, cfg, "nf4")
    out.update(load_s=round(time.time() - t0, 1), anon_after_load=anon(), peak_load=peak[0])
    trim_heap()
    out["anon_after_load_trim"] = anon()
    lora = LoraSection(r=16, dropout=0.0, target_modules=["all-linear"])
    pm = apply_lora(model, lora, 0, False)
    pm.train()
    ids = torch.randint(3, 50000, (1, args.seq), generator=torch.Generator().manual_seed(0))
    peak[0] = 0
    t0 = time.time()
    loss = pm(input_ids=ids, labels=ids).loss
    out.update(fwd_s=round(time.time() - t0, 1), anon_after_fwd=anon(), peak_fwd=peak[0])
    loss.backward()
    out.update(step_s=round(time.time() - t0, 1), anon_after_bwd=anon(), peak_step=peak[0])
    if args.policy == "trim":  # finetune's CPU steps: the heap trimmed after each
        trim_heap()
    out["anon_before_step2"] = anon()
    peak[0] = 0
    t0 = time.time()  # a second step: the caches warm, shapes seen once
    ids = torch.randint(3, 50000, (1, args.seq), generator=torch.Generator().manual_seed(1))
    pm(input_ids=ids, labels=ids).loss.backward()
    out.update(step2_s=round(time.time() - t0, 1), anon_after_step2=anon(), peak_step2=peak[0])
    trim_heap()
    out["anon_after_trim"] = anon()
    out["grad_bytes"] = sum(
        p.grad.numel() * p.grad.element_size() for p in pm.parameters() if p.grad is not None
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
