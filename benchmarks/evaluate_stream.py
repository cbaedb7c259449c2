"""lm-eval tasks on a streamed model (`shoestring evaluate`) vs lm-eval's own `hf` backend.

The same random-init Llama (hidden 1024, 16 layers, fp32 by default), the same two
custom tasks over local JSON files (multiple choice: loglikelihood; short answers:
generate_until, greedy), each side a whole process of its own:

* **ours** — `shoestring evaluate` under `--memory.budget` (default 1.1 GB, below what
  the process needs with every layer resident), the layers streamed from the shards;
* **hf** — `lm_eval.simple_evaluate(model="hf")`: the model loaded whole (batch 16).

Printed: wall seconds and peak RSS of each process, their ratios, the largest
per-document log-likelihood difference and whether the metrics are equal.

    .venv/bin/python benchmarks/evaluate_stream.py --json benchmarks/results/X.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from _common import WORDS, load_note, random_llama  # noqa: E402

TASK = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
"""

MC = """\
output_type: multiple_choice
doc_to_text: "{{question}}\\nAnswer:"
doc_to_target: label
doc_to_choice: choices
metric_list:
  - metric: acc
"""

GEN = """\
output_type: generate_until
doc_to_text: "{{{{question}}}}\\nA:"
doc_to_target: answer
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: {gen}
  do_sample: false
metric_list:
  - metric: exact_match
"""


def write_tasks(folder: Path, mc_docs: int, gen_docs: int, gen: int, seed: int = 0) -> None:
    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    mc = [{"question": words(20), "choices": [" " + words(3) for _ in range(4)],
           "label": rng.randrange(4)} for _ in range(mc_docs)]  # fmt: skip
    ga = [{"question": words(20), "answer": " " + words(1)} for _ in range(gen_docs)]
    for name, docs, body in (("bench_mc", mc, MC), ("bench_gen", ga, GEN.format(gen=gen))):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (folder / f"{name}.yaml").write_text(TASK.format(name=name, data=data) + body)


def side(which: str, model: Path, tasks: Path, work: Path, budget: str) -> dict[str, Any]:
    """One side, run in this process (the parent starts one process per side)."""
    t0 = time.perf_counter()
    names = ["bench_mc", "bench_gen"]
    if which == "ours":
        from shoestring.evaluate.cli import evaluate
        from shoestring.evaluate.config import EvaluateConfig
        from shoestring.infer.config import InferModelConfig, JobConfig, MemoryConfig

        cfg = EvaluateConfig(
            model=InferModelConfig(path=str(model), device="cpu"),
            tasks=names, include_path=str(tasks), work_dir=str(work), log_samples=True,
            memory=MemoryConfig(budget=budget), job=JobConfig(progress="off"),
        )  # fmt: skip
        assert evaluate(cfg) == 0
        results = json.loads((work / "results.json").read_text())
    else:
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import handle_non_serializable

        out = simple_evaluate(
            model="hf", model_args={"pretrained": str(model), "dtype": "float32", "device": "cpu"},
            tasks=names, task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
            batch_size=16, log_samples=True,
        )  # fmt: skip
        results = json.loads(json.dumps(out, default=handle_non_serializable))
    return {
        "wall_s": round(time.perf_counter() - t0, 2),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "metrics": {
            t: {k: v for k, v in r.items() if "," in k} for t, r in results["results"].items()
        },
        "loglikelihoods": [
            r[0][0]
            for s in sorted(results["samples"]["bench_mc"], key=lambda s: s["doc_id"])
            for r in s["resps"]
        ],  # fmt: skip
        "generations": [
            s["resps"] for s in sorted(results["samples"]["bench_gen"], key=lambda s: s["doc_id"])
        ],  # fmt: skip
    }


def run(which: str, model: Path, tasks: Path, tmp: Path, budget: str) -> dict[str, Any]:
    out = tmp / f"{which}.json"
    cmd = [sys.executable, __file__, "--side", which, "--model", str(model),
           "--tasks", str(tasks), "--work", str(tmp / f"work-{which}"), "--budget", budget,
           "--side-out", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{which} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    doc = json.loads(out.read_text())
    doc["process_s"] = round(time.perf_counter() - t0, 2)
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--budget", default="1.1GB")
    ap.add_argument("--mc-docs", type=int, default=30)
    ap.add_argument("--gen-docs", type=int, default=20)
    ap.add_argument("--gen-tokens", type=int, default=16)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--side", choices=("ours", "hf"))
    ap.add_argument("--model", type=Path)
    ap.add_argument("--tasks", type=Path)
    ap.add_argument("--work", type=Path)
    ap.add_argument("--side-out", type=Path)
    a = ap.parse_args()
    if a.side:
        a.side_out.write_text(json.dumps(side(a.side, a.model, a.tasks, a.work, a.budget)))
        return
    model = random_llama("eval", a.hidden, a.layers)
    model_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "tasks").mkdir()
        write_tasks(tmp / "tasks", a.mc_docs, a.gen_docs, a.gen_tokens)
        ours = run("ours", model, tmp / "tasks", tmp, a.budget)
        hf = run("hf", model, tmp / "tasks", tmp, a.budget)
    diff = max(abs(x - y) for x, y in zip(ours["loglikelihoods"], hf["loglikelihoods"]))
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs; {load_note()}",
        "model": {
            "hidden": a.hidden,
            "layers": a.layers,
            "dtype": "float32",
            "safetensors_bytes": model_bytes,
        },  # fmt: skip
        "tasks": {
            "bench_mc docs x 4 choices": a.mc_docs,
            "bench_gen docs": a.gen_docs,
            "max_gen_toks": a.gen_tokens,
        },  # fmt: skip
        "budget": a.budget,
        "ours": {k: ours[k] for k in ("process_s", "wall_s", "peak_rss_bytes", "metrics")},
        "hf": {k: hf[k] for k in ("process_s", "wall_s", "peak_rss_bytes", "metrics")},
        "ratios": {
            "process_s ours/hf": round(ours["process_s"] / hf["process_s"], 2),
            "peak_rss ours/hf": round(ours["peak_rss_bytes"] / hf["peak_rss_bytes"], 2),
        },
        "max_abs_loglikelihood_diff": diff,
        "metrics_equal": ours["metrics"] == hf["metrics"],
        "generations_equal": ours["generations"] == hf["generations"],
    }
    print(json.dumps(report, indent=2))
    if a.json:
        a.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
