"""Mixed-length batch requests: the new schedule vs the fixed-length one, side by side.

The same prompts, greedy, in one invocation, each side a whole `shoestring infer`
process on the same random-init Llama:

* **fixed** — what the job could do before OpenAI batch files: `{"prompt"}` lines,
  one `--max-new-tokens` for all (the largest any request wants), every request
  decoded to it; a user then truncates each answer to its own length.
* **mixed** — an OpenAI batch file with each request's own `max_tokens` (uniform in
  [min, max]): chunks formed by length limit, ended sequences leave the batch.

Printed: wall time, passes (what a layer-streamed model pays per pass: every
weight read once), generated tokens, *useful* tokens (each request's own length;
the fixed side's extra tokens are thrown away) and useful tokens/s, with ratios.

    .venv/bin/python benchmarks/infer_mixed.py                       # 128 requests, 8..256
    .venv/bin/python benchmarks/infer_mixed.py --budget 0.5GB        # a streamed model
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from _common import WORDS, infer_job, random_llama  # noqa: E402


def requests(n: int, lo: int, hi: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [
        (" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))), rng.randint(lo, hi))
        for _ in range(n)
    ]


def run_side(name: str, model: Path, lines: list[dict[str, Any]], extra: list[str], tmp: Path
             ) -> dict[str, Any]:  # fmt: skip
    wall, end, out = infer_job(name, model, lines, extra, tmp)
    return {"wall_s": wall, **end, "output": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--min-tokens", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--budget", default="", help="--memory-budget for both (streams the model)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    model = random_llama("mixed", a.hidden, a.layers)
    reqs = requests(a.requests, a.min_tokens, a.max_tokens, a.seed)
    common = ["--batch-size", str(a.batch), "--threads", str(a.threads)]
    common += ["--memory-budget", a.budget] if a.budget else []
    most = max(n for _, n in reqs)
    fixed_lines = [{"prompt": p} for p, _ in reqs]
    mixed_lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": p, "max_tokens": n, "temperature": 0}}
        for i, (p, n) in enumerate(reqs)
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        fixed = run_side("fixed", model, fixed_lines, [*common, "--max-new-tokens", str(most)], tmp)
        mixed = run_side("mixed", model, mixed_lines, common, tmp)
        fixed["useful"] = sum(min(n, got) for (_, n), got in zip(reqs, _lengths(fixed)))
        mixed["useful"] = mixed["tokens"]
        same = _same_text(fixed["output"], mixed["output"])
    report(a, fixed, mixed, same)


def _lengths(side: dict[str, Any]) -> list[int]:
    return [json.loads(x)["tokens"] for x in Path(side["output"]).open()]


def _same_text(fixed: Path, mixed: Path) -> float:
    """Share of requests whose answer is a prefix of the fixed side's (greedy: the
    first n tokens of a longer run are the same tokens; a character cut at the end
    decodes as U+FFFD)."""
    f = [json.loads(x) for x in fixed.open()]
    m = [json.loads(x) for x in mixed.open()]
    ok = sum(
        a["completion"].startswith(b["response"]["body"]["choices"][0]["text"].rstrip("\ufffd"))
        for a, b in zip(f, m)
    )
    return ok / len(m)


def report(a: argparse.Namespace, fixed: dict[str, Any], mixed: dict[str, Any], same: float
           ) -> None:  # fmt: skip
    print(f"\n{a.requests} requests, max_tokens uniform in [{a.min_tokens}, {a.max_tokens}], "
          f"batch {a.batch}, {a.threads} thread(s), budget {a.budget or 'default'}")  # fmt: skip
    head = ("wall s", "passes s", "passes", "generated", "useful", "useful tok/s")
    print(f"{'':8}" + "".join(f"{h:>14}" for h in head))
    for name, s in (("fixed", fixed), ("mixed", mixed)):
        row = (f"{s['wall_s']:.1f}", f"{s['pass_s']:.1f}", s["passes"], s["tokens"],
               s["useful"], f"{s['useful'] / s['wall_s']:.1f}")  # fmt: skip
        print(f"{name:8}" + "".join(f"{v:>14}" for v in row))
    print(
        f"mixed/fixed: wall {mixed['wall_s'] / fixed['wall_s']:.3f}, time in passes "
        f"{mixed['pass_s'] / fixed['pass_s']:.3f}, passes "
        f"{mixed['passes'] / fixed['passes']:.3f}, useful tok/s "
        f"{(mixed['useful'] / mixed['wall_s']) / (fixed['useful'] / fixed['wall_s']):.2f}x; "
        f"answers equal to the fixed side's prefix: {same:.0%}"
    )


if __name__ == "__main__":
    main()
