"""Process start → first training step on a large conversation set: cold vs cached.

Runs `shoestring finetune` (the built-in tiny model with a ChatML tokenizer, one step) on
a synthetic set of N multi-turn conversations twice with the same data cache: the first
start parses and tokenizes everything and writes the memory-mapped cache; the second
maps it. Prints the time to the first step of each, their ratio (target ≥ 20×), the
cache's bytes per token byte (target ≤ 1.2), and tokenization throughput of
`shoestring.data.tokenize.tokenize_records` vs `datasets.Dataset.map` with
`apply_chat_template(tokenize=True)` on the same tokenizer and number of processes (a
peer that computes no loss mask; target ours ≥ peer).

Usage: .venv/bin/python benchmarks/data_restart.py [--n 1000000] [--peer-n 50000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

WORDS = (
    "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud "
    "forest signal vector matrix kernel buffer packet socket thread memory shard bucket"
).split()


def conversation(rng: random.Random) -> dict[str, Any]:
    def sentence(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    msgs = [{"role": "system", "content": "You answer briefly."}]
    for _ in range(rng.randint(1, 2)):  # ~200 characters of content per conversation
        msgs.append({"role": "user", "content": sentence(rng.randint(4, 14)) + "?"})
        msgs.append({"role": "assistant", "content": sentence(rng.randint(3, 12)) + "."})
    return {"messages": msgs}


def write_dataset(path: Path, n: int) -> int:
    if path.exists():
        return path.stat().st_size
    rng = random.Random(0)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for _ in range(n):
            f.write(json.dumps(conversation(rng)) + "\n")
    tmp.rename(path)
    return path.stat().st_size


def chat_model(cache: Path) -> Path:
    from chat_fixtures import chatml_tokenizer, save_tokenizer
    from shoestring.train.builtin import materialize_tiny_model

    src = materialize_tiny_model(cache)
    dst = cache / "tiny-chatml"
    shutil.copytree(src, dst)
    for f in dst.glob("tokenizer*"):
        f.unlink()
    save_tokenizer(chatml_tokenizer(), dst)
    return dst


def first_step(model: Path, data: Path, cache: Path, out: Path) -> dict[str, Any]:
    """Seconds from process start to the first ``step`` event, and the ``data`` event."""
    env = {**os.environ, "SHOESTRING_CACHE": str(cache), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [
        sys.executable, "-m", "shoestring", "finetune", "--output_dir", str(out),
        "--model.path", str(model), "--data.train", str(data), "--data.eval", "",
        "--data.max_length", "256", "--data.packing", "--train.max_steps", "1",
        "--train.batch_size", "8", "--checkpoint.every_steps", "0",
    ]  # fmt: skip
    t0 = time.time()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            tail = err.read()[-3000:].decode(errors="replace")
            raise SystemExit(f"finetune failed ({proc.returncode}):\n{tail}")
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    step = next(e for e in events if e["event"] == "step")
    data = next(e for e in events if e["event"] == "data")
    peak = usage.ru_maxrss * 1024  # kilobytes on Linux
    return {"to_first_step_s": step["ts"] - t0, "data_event": data, "peak_rss_bytes": peak}


def cache_ratio(cache: Path, key: str) -> float:
    from shoestring.data.cache import TokenCache

    tc = TokenCache.open(cache / "data" / key)
    on_disk = sum(f.stat().st_size for f in tc.path.glob("*.npy"))
    return on_disk / (tc.n_tokens * tc.tokens.dtype.itemsize)


def throughput(model: Path, data: Path, n: int, procs: int) -> dict[str, float]:
    """Conversations per second: ours (with the loss mask) vs datasets.map (ids only)."""
    from datasets import Dataset

    from shoestring.data.formats import parse_record
    from shoestring.data.tokenize import TokenizeSpec, tokenize_records
    from shoestring.hf import load_tokenizer

    tok = load_tokenizer(model)
    rows = [json.loads(x) for _, x in zip(range(n), open(data))]
    records = [parse_record(r, f"row {i}", "messages") for i, r in enumerate(rows)]
    t0 = time.perf_counter()
    tokenize_records(records, tok, TokenizeSpec(256), workers=procs)
    ours = n / (time.perf_counter() - t0)
    ds = Dataset.from_list(rows)

    def encode(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        return {"input_ids": [tok.apply_chat_template(m, tokenize=True) for m in batch["messages"]]}

    t0 = time.perf_counter()
    ds.map(encode, batched=True, num_proc=procs if procs > 1 else None, load_from_cache_file=False)
    peer = n / (time.perf_counter() - t0)
    return {"ours_per_s": ours, "datasets_map_per_s": peer, "ratio": ours / peer}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000, help="conversations in the set")
    ap.add_argument("--peer-n", type=int, default=50_000, help="conversations for throughput")
    ap.add_argument("--procs", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    bench = Path(os.environ.get("SHOESTRING_BENCH_CACHE", Path.home() / ".cache" / "shoestring"))
    bench.mkdir(parents=True, exist_ok=True)
    data = bench / f"chats-{a.n}.jsonl"
    size = write_dataset(data, a.n)
    with tempfile.TemporaryDirectory() as d:
        cache = Path(d) / "cache"  # a fresh model and data cache
        model = chat_model(cache)
        cold = first_step(model, data, cache, Path(d) / "cold")
        warm = first_step(model, data, cache, Path(d) / "warm")
        ratio_bytes = cache_ratio(cache, cold["data_event"]["cache_key"])
        tp = throughput(model, data, a.peer_n, a.procs)
    res = {
        "conversations": a.n,
        "jsonl_bytes": size,
        "tokens": cold["data_event"]["tokens"],
        "cold_to_first_step_s": round(cold["to_first_step_s"], 2),
        "cached_to_first_step_s": round(warm["to_first_step_s"], 2),
        "speedup": round(cold["to_first_step_s"] / warm["to_first_step_s"], 1),
        "cache_bytes_per_token_byte": round(ratio_bytes, 3),
        "cold_peak_rss_gb": round(cold["peak_rss_bytes"] / 1e9, 2),
        "cached_peak_rss_gb": round(warm["peak_rss_bytes"] / 1e9, 2),
        "cache_states": [cold["data_event"]["cache"], warm["data_event"]["cache"]],
        **{k: round(v, 2) for k, v in tp.items()},
        "procs": a.procs,
    }
    print(json.dumps(res, indent=1))
    print(
        f"cold {res['cold_to_first_step_s']} s vs cached {res['cached_to_first_step_s']} s "
        f"-> {res['speedup']}x (target >= 20x); cache {res['cache_bytes_per_token_byte']}x "
        f"token bytes (target <= 1.2); tokenize {tp['ratio']:.2f}x datasets.map (target >= 1)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
