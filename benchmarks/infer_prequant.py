"""Streaming a model's stored-quantized saves (bnb-4bit, FP8) against its 16-bit
safetensors, and transformers' in-memory generate on each save as the peer.

Builds a random-init Llama (hidden 1024, 8 layers, ffn 2816, GQA 16/4, bf16: the
16-bit checkpoint as the Hub has it), its bitsandbytes 4-bit save (nf4, double
quantization, what ``*-bnb-4bit`` repos hold) and its FP8 save (128 x 128 block scales,
what ``*-FP8`` repos hold), then runs, each as its own process, on the same prompts:

- ours on the bf16 safetensors, nothing resident (every pass reads every unit);
- ours on each save, nothing resident;
- transformers ``generate`` on each save loaded in memory (the peer; its FP8 loader
  dequantizes on a machine without an FP8 GPU).

Everything computes in float32 (ours: ``--dtype float32``): this CPU has no bf16 GEMM
(see benchmarks/README.md); the bnb save's compute dtype is float32 for the same reason,
and its 16-bit-able tensors (embeddings, norms, head) are saved float32, since
transformers computes those in the dtype they are stored in.
Prints one JSON object (bytes read per pass, tokens/s, peak RSS, the ratios, whether
the completions agree); ``--out`` writes it too.

    .venv/bin/python benchmarks/infer_prequant.py --out benchmarks/results/infer-prequant-2026-12-06.json
    .venv/bin/python benchmarks/infer_prequant.py --formats fp8 --out benchmarks/results/infer-prequant-fp8-2026-12-07.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden=1024, layers=8, ffn=2816, heads=16, kv_heads=4)
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex".split()


def build(root: Path, formats: list[str]) -> dict[str, Path]:
    """The bf16 model and its saves in ``formats`` (each built once under ``root``)."""
    import torch

    from shoestring.infer.fixtures import build_random_model, save_fp8

    bf16 = root / "bf16"
    if not (bf16 / "config.json").is_file():
        build_random_model(bf16, dtype=torch.bfloat16, shard="100MB", init_std=0.05, **SHAPE)
    models = {"bf16": bf16, "bnb4": root / "bnb-4bit", "fp8": root / "fp8"}
    if "bnb4" in formats and not (models["bnb4"] / "config.json").is_file():
        save_bnb4(bf16, models["bnb4"])
    if "fp8" in formats and not (models["fp8"] / "config.json").is_file():
        save_fp8(bf16, models["fp8"], (128, 128))
    return {k: m for k, m in models.items() if k == "bf16" or k in formats}


def save_bnb4(bf16: Path, bnb: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    # float32 beside the 4-bit linears (embeddings, norms, head): transformers keeps
    # those in the dtype they are stored in whatever ``dtype`` it is given, and the
    # peer should compute in float32 as ours does.
    model = AutoModelForCausalLM.from_pretrained(
        str(bf16), quantization_config=q, dtype=torch.float32
    )
    model.save_pretrained(str(bnb))
    for f in bf16.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (bnb / f.name).write_bytes(f.read_bytes())


def prompts(path: Path, n: int) -> Path:
    path.write_text(
        "".join(
            json.dumps({"prompt": " ".join(WORDS[(i + k) % 14] for k in range(4 + i % 5))}) + "\n"
            for i in range(n)
        )
    )
    return path


def ours(model: Path, inp: Path, out: Path, new: int, threads: int) -> dict[str, Any]:
    args = [sys.executable, "-m", "shoestring", "infer", "--model", str(model)]
    args += ["--input", str(inp), "--output", str(out), "--max-new-tokens", str(new)]
    args += ["--threads", str(threads), "--dtype", "float32", "--memory.resident", "0"]
    args += ["--memory-budget", "8GB", "--job.progress", "off"]
    t0 = time.perf_counter()
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    lines = (Path(f"{out}.run") / "events.jsonl").read_text().splitlines()
    events = [json.loads(x) for x in lines if x]
    end = next(e for e in events if e["event"] == "infer_end")
    keep = ("tokens", "passes", "pass_s", "prefill_s", "decode_s_per_pass", "tokens_per_s")
    keep += ("bytes_per_pass", "read_bytes_per_s", "io_wait_s", "peak_rss_bytes")
    start = next(e for e in events if e["event"] == "infer_start")
    completions = [json.loads(x)["completion"] for x in out.read_text().splitlines()]
    return {
        "process_s": round(wall, 2),
        **{k: end[k] for k in keep},
        "prepare_at": start["plan"]["prepare_at"],
        "batch_size": start["plan"]["batch_size"],
        "completions": completions,
    }


PEER = """
import json, sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model_dir, inp, new, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
t0 = time.perf_counter()
tok = AutoTokenizer.from_pretrained(model_dir)
tok.padding_side = "left"
if tok.pad_token_id is None:
    tok.pad_token = tok.eos_token
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
texts = [json.loads(x)["prompt"] for x in open(inp)]
batch = tok(texts, return_tensors="pt", padding=True)
t1 = time.perf_counter()
with torch.no_grad():
    out = model.generate(**batch, max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id)
t2 = time.perf_counter()
new_ids = out[:, batch["input_ids"].shape[1]:]
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(json.dumps({"load_s": round(t1 - t0, 2), "generate_s": round(t2 - t1, 2),
    "tokens": int(new_ids.numel()), "tokens_per_s": new_ids.numel() / (t2 - t1),
    "peak_rss_bytes": int(hwm) * 1024,
    "completions": [tok.decode(r, skip_special_tokens=True) for r in new_ids]}))
"""


def peer(model: Path, inp: Path, new: int, threads: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", PEER, str(model), str(inp), str(new), str(threads)],
        check=True,
        capture_output=True,
        text=True,
    )
    res: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return {"process_s": round(time.perf_counter() - t0, 2), **res}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    ap.add_argument("--out")
    args = ap.parse_args()
    cache = Path(os.environ.get("SHOESTRING_BENCH_CACHE", Path.home() / ".cache" / "shoestring"))
    models = build(cache / "bench-infer-prequant", args.formats)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        work = Path(tmp)
        inp = prompts(work / "in.jsonl", args.prompts)
        run = (args.new_tokens, args.threads)
        runs = {"ours_bf16": ours(models["bf16"], inp, work / "bf16.jsonl", *run)}
        for f in args.formats:
            runs[f"ours_{f}"] = ours(models[f], inp, work / f"{f}.jsonl", *run)
            runs[f"transformers_{f}"] = peer(models[f], inp, *run)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "command": "benchmarks/infer_prequant.py " + " ".join(sys.argv[1:]),
        "model": {**SHAPE, "safetensors_bytes": {k: _bytes(m) for k, m in models.items()}},
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "runs": runs,
        "ratios": {f: _ratios(runs, f) for f in args.formats},
        "load_avg_1min_at_end": os.getloadavg()[0],
        "completions_equal_ours_vs_transformers": {
            f: sum(x == y for x, y in zip(*(runs[f"{who}_{f}"]["completions"] for who in WHO)))
            for f in args.formats
        },
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


FORMATS = ("bnb4", "fp8")
WHO = ("ours", "transformers")


def _bytes(model: Path) -> int:
    return sum(f.stat().st_size for f in model.glob("*.safetensors"))


def _ratios(runs: dict[str, Any], f: str) -> dict[str, float]:
    a, b, p = runs["ours_bf16"], runs[f"ours_{f}"], runs[f"transformers_{f}"]
    return {
        f"bytes_per_pass_bf16_over_{f}": a["bytes_per_pass"] / b["bytes_per_pass"],
        f"tokens_per_s_{f}_over_bf16": b["tokens_per_s"] / a["tokens_per_s"],
        f"peak_rss_{f}_over_bf16": b["peak_rss_bytes"] / a["peak_rss_bytes"],
        f"tokens_per_s_ours_{f}_over_transformers": b["tokens_per_s"] / p["tokens_per_s"],
        f"peak_rss_ours_{f}_over_transformers": b["peak_rss_bytes"] / p["peak_rss_bytes"],
    }


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    main()
