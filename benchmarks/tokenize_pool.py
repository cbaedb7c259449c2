"""Where a tokenizer pool starts to pay: one process vs spawned workers, by dataset size.

``tokenize_records`` tokenizes in the trainer's process below
``MIN_PARALLEL_RECORDS`` and over ``workers`` spawned processes from there (each imports
the tokenizer's library before its first chunk). This times both ways on synthetic
prompt/completion pairs of ~1,300 tokens (the built-in byte-level tokenizer), the pool
forced on at every size, and prints the pool's speed-up per size: the threshold belongs
where it crosses 1.

Usage: .venv/bin/python benchmarks/tokenize_pool.py [--sizes 4000 16000] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

WORDS = ("alpha", "reverse", "token", "model", "budget", "quantize", "gpu", "shard")


def pairs(n: int, seed: int = 0) -> list:
    from shoestring.data.records import Record

    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = rng.randint(40, 300)
        prompt = " ".join(rng.choice(WORDS) for _ in range(words // 4))
        completion = " ".join(rng.choice(WORDS) for _ in range(words))
        out.append(Record(f"pairs:{i}", prompt=prompt, completion=completion))
    return out


def timed(records: list, workers: int) -> float:
    from shoestring.data import tokenize
    from shoestring.train.builtin import build_tokenizer

    tokenize.MIN_PARALLEL_RECORDS = 0  # the pool at every size, to find the crossing
    t0 = time.perf_counter()
    tokenize.tokenize_records(
        records, build_tokenizer(), tokenize.TokenizeSpec(2048), workers=workers
    )
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[4000, 16000])
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    a = ap.parse_args()
    rows = []
    for n in a.sizes:
        records = pairs(n)
        one, pool = timed(records, 1), timed(records, a.workers)
        rows.append(
            {
                "records": n,
                "in_process_s": round(one, 2),
                "pool_s": round(pool, 2),
                "workers": a.workers,
                "pool_speedup": round(one / pool, 2),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
