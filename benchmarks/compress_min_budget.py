"""The least ``--memory-budget`` exact, int8 and nf4 streaming accept, before and after
prepare-on-compute (issue 31), on one model.

Builds tests/test_infer_budget.py's tied model (hidden 512, 8 layers, ffn 2048: 122 MB
fp32), extracts the code before the change (``--before``, a commit) with ``git archive``,
and in a child process per code tree bisects, to the byte, the smallest budget that
tree's planner accepts (``make_plan`` for 64 prompts of 12 tokens + 8 new, and writing
the compressed copy, ``check_setup``) with the runtime fixed at 400 MB, on the weights'
predicted needs (the plan that refuses first). fp32 compute, depth 1 and 2. Prints one
JSON object; ``--out`` writes it too. What it does not measure: a process's RSS at
those budgets (tests/test_infer_budget.py's slow test_a_budget_too_small_for_exact_runs
_compressed runs int8 and nf4 just under exact's least and checks their peak RSS).

    .venv/bin/python benchmarks/compress_min_budget.py --out benchmarks/results/compress-min-budget-2026-12-06.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

RUNTIME = 400_000_000
ROOT = Path(__file__).resolve().parents[1]


def least(model: Path) -> dict[str, Any]:
    """In the child: the least budget per depth and scheme, with where it prepares."""
    import torch

    from shoestring.config import ConfigError
    from shoestring.infer.config import MemoryConfig
    from shoestring.infer.engine import (
        StreamingCausalLM,
        kv_bytes_per_token,
        kv_scratch_per_token,
    )
    from shoestring.infer.plan import Budget, Lengths, ModelShape, check_setup, make_plan
    from shoestring.infer.weights import weight_needs

    out: dict[str, Any] = {}
    for depth in (1, 2):
        for scheme in (None, "int8", "nf4"):
            eng = StreamingCausalLM(model, device=torch.device("cpu"), dtype=torch.float32)
            needs = weight_needs(eng, scheme, None)
            f32, c = torch.float32, eng.config
            shape = ModelShape(c, 4, kv_bytes_per_token(c, f32), kv_scratch_per_token(c, f32))
            lengths, memory = Lengths([12] * 64, 8), MemoryConfig(prefetch_depth=depth)
            lo, hi = RUNTIME, RUNTIME + 10**9
            while hi - lo > 1:
                mid = (lo + hi) // 2
                try:
                    make_plan(Budget(mid, RUNTIME), needs, shape, lengths, memory)
                    check_setup(Budget(mid, RUNTIME), needs.build)
                    hi = mid
                except ConfigError:
                    lo = mid
            plan = make_plan(Budget(hi, RUNTIME), needs, shape, lengths, memory)
            out[f"depth{depth}/{scheme or 'exact'}"] = {
                "least_budget": hi,
                "over_runtime": hi - RUNTIME,
                "prepare_at": getattr(plan, "prepare_at", "ahead"),
                "build": needs.build,
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default="d69be46")
    ap.add_argument("--out")
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(least(Path(args.child))))
        return
    from shoestring.infer.fixtures import build_random_model

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        model = build_random_model(
            d / "m", hidden=512, layers=8, ffn=2048, heads=8, kv_heads=2, tie=True, shard="50MB"
        )
        (d / "before").mkdir()
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", args.before, "src"], check=True, capture_output=True
        )
        subprocess.run(["tar", "-x", "-C", str(d / "before")], input=archive.stdout, check=True)
        res: dict[str, Any] = {"model": "tied llama, hidden 512, 8 layers, ffn 2048, fp32"}
        res["runtime"], res["before_commit"] = RUNTIME, args.before
        for name, src in (("before", d / "before" / "src"), ("after", ROOT / "src")):
            env = {**os.environ, "PYTHONPATH": str(src)}
            cmd = [sys.executable, __file__, "--child", str(model)]
            p = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            res[name] = json.loads(p.stdout.strip().splitlines()[-1])
    res["ratio_to_exact_over_runtime"] = {
        f"{name}/{key}": round(
            v["over_runtime"] / res[name][key.split("/")[0] + "/exact"]["over_runtime"], 3
        )
        for name in ("before", "after")
        for key, v in res[name].items()
    }
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
