"""The real-size runs of ``scale.py`` planned again by today's planner, beside what they
measured: after a change to the memory model, how far each plan now is from its run.

    .venv/bin/python benchmarks/replan.py > benchmarks/results/replan-<date>.txt

Each shape's config (no weights: the planner reads config.json only) is written by
``realshape.py``, planned with the run's own finetune flags (``scale.plan``), and set
against the steps' peak anonymous RSS its raw file recorded. Nothing is run again.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import realshape
import scale

ROOT = Path(__file__).resolve().parents[1]
PACKED = "--model.dtype bfloat16 --data.packing true"
#: shape -> (raw result, the run's --finetune-args, its --steps)
RUNS = {
    "gemma3-1b": ("scale-gemma3-1b-2026-12-07.json", PACKED, 3),
    "phi4-mini": ("scale-phi4-mini-2026-12-07.json", PACKED, 3),
    "gemma3-4b": ("scale-gemma3-4b-2026-12-07.json", PACKED, 3),
    "qwen3-30b-a3b": (
        "scale-qwen3-30b-a3b-load1mb-2026-12-07.json",
        f"{PACKED} --model.gradient_checkpointing true "
        "--lora.target_modules [q_proj,k_proj,v_proj,o_proj] --lora.cache_quantized false",
        2,
    ),
}


def main() -> int:
    _, ids = realshape._tokenizer_ids()
    work = Path(tempfile.mkdtemp(prefix="replan-"))
    for name, (raw, flags, steps) in RUNS.items():
        model = work / name
        realshape.SHAPES[name].config(ids).save_pretrained(model)
        a = argparse.Namespace(seq=512, steps=steps, finetune_args=flags)
        planned = scale.plan(scale.finetune_args(model, work / "out", a), work, name)
        run = json.loads((ROOT / "benchmarks" / "results" / raw).read_text())
        qlora = run["shapes"][name]["qlora"]
        then, now = qlora["plan"]["peak_bytes"], planned["peak_bytes"]
        measured = qlora["peak_rss_anon_steps_bytes"]
        print(
            f"{name}: measured {measured / 1e9:.2f} GB; plan then {then / 1e9:.2f} GB "
            f"({measured / then:.3f}x), now {now / 1e9:.2f} GB ({measured / now:.3f}x)  [{raw}]"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
