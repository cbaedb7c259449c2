"""A shared prompt prefix computed once per prefill vs every prompt in full, side by side.

The same job twice, each side a whole `shoestring infer` process on the same
random-init Llama: requests that repeat one long few-shot prefix before a short
question each (the offline batch shape vLLM users ask prefix caching for), greedy.

* **shared** — `memory.share_prefix auto` (the default): the prefix's one row runs
  each layer first, its keys and values are copied to the sharing rows, which
  compute their questions only.
* **full** — `memory.share_prefix off`: every prompt prefilled in full.

Printed: prefill seconds, whole-job wall time, generated tokens/s and prompts/h
(over the process's wall time), prefill tokens computed, peak RSS, the ratios,
and whether the two outputs are byte-identical.

    .venv/bin/python benchmarks/infer_shared_prefix.py --json benchmarks/results/X.json
    .venv/bin/python benchmarks/infer_shared_prefix.py --budget 0.3GB   # a streamed model
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from _common import WORDS, infer_job, random_llama  # noqa: E402


def text(rng: random.Random, chars: int) -> str:
    """Words up to ``chars`` characters (the byte tokenizer: one token per character)."""
    out = ""
    while len(out) < chars:
        out += rng.choice(WORDS) + " "
    return out[:chars]


def prompts(n: int, prefix: int, lo: int, hi: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    shots = text(rng, prefix - 1)  # the tokenizer's BOS makes it `prefix` tokens
    return [shots + "Q: " + text(rng, rng.randint(lo, hi) - 3) for _ in range(n)]


def run_side(name: str, model: Path, lines: list[str], extra: list[str], tmp: Path
             ) -> dict[str, Any]:  # fmt: skip
    wall, end, out = infer_job(name, model, [{"prompt": p} for p in lines], extra, tmp)
    return {"process_s": round(wall, 3), **end, "output_sha": _sha(out)}


def _sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--min-question", type=int, default=16)
    ap.add_argument("--max-question", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--budget", default="", help="--memory-budget for both (streams the model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="", help="write the raw result here")
    a = ap.parse_args()
    model = random_llama("prefix", a.hidden, a.layers, context=4096)
    lines = prompts(a.requests, a.prefix_tokens, a.min_question, a.max_question, a.seed)
    common = ["--batch-size", str(a.requests), "--threads", str(a.threads)]
    common += ["--max-new-tokens", str(a.new_tokens)]
    common += ["--memory-budget", a.budget] if a.budget else []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        full = run_side("full", model, lines, [*common, "--memory.share_prefix", "off"], tmp)
        shared = run_side("shared", model, lines, common, tmp)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "args": vars(a),
        "load_avg_before_after": [list(load_before), list(os.getloadavg())],
        "full": full,
        "shared": shared,
        "ratios": ratios(full, shared),
    }
    report(a, result)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")


def ratios(full: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    def per_s(s: dict[str, Any], key: str) -> float:
        return float(s[key]) / s["process_s"]

    return {
        "prefill_speedup": round(full["prefill_s"] / shared["prefill_s"], 3),
        "prefill_tokens_ratio": round(full["prefill_tokens"] / shared["prefill_tokens"], 3),
        "wall_speedup": round(full["process_s"] / shared["process_s"], 3),
        "tokens_per_s_ratio": round(per_s(shared, "tokens") / per_s(full, "tokens"), 3),
        "peak_rss_ratio": round(shared["peak_rss_bytes"] / full["peak_rss_bytes"], 3),
        "outputs_equal": full["output_sha"] == shared["output_sha"],
    }


def report(a: argparse.Namespace, r: dict[str, Any]) -> None:
    print(f"\n{a.requests} requests = a {a.prefix_tokens}-token shared prefix + "
          f"{a.min_question}-{a.max_question}-token questions, {a.new_tokens} new tokens, "
          f"greedy, {a.threads} thread(s), budget {a.budget or 'default'}")  # fmt: skip
    head = ("process s", "prefill s", "prefill tok", "tok/s", "prompts/h", "peak RSS GB")
    print(f"{'':8}" + "".join(f"{h:>13}" for h in head))
    for name in ("full", "shared"):
        s = r[name]
        row = (f"{s['process_s']:.1f}", f"{s['prefill_s']:.2f}", s["prefill_tokens"],
               f"{s['tokens'] / s['process_s']:.2f}",
               f"{s['prompts'] / s['process_s'] * 3600:,.0f}",
               f"{s['peak_rss_bytes'] / 1e9:.2f}")  # fmt: skip
        print(f"{name:8}" + "".join(f"{v:>13}" for v in row))
    q = r["ratios"]
    print(
        f"shared/full: prefill {q['prefill_speedup']:.2f}x faster "
        f"({q['prefill_tokens_ratio']:.1f}x fewer tokens), whole job {q['wall_speedup']:.2f}x, "
        f"tokens/s {q['tokens_per_s_ratio']:.2f}x, peak RSS {q['peak_rss_ratio']:.2f}x; "
        f"outputs byte-identical: {q['outputs_equal']}"
    )


if __name__ == "__main__":
    main()
