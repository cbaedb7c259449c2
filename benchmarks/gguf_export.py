"""GGUF export (export.gguf / shoestring export) vs the HF merged export, at a ~1B shape.

A random-init Llama-3.2-1B-shaped model (hidden 2048, 16 layers, GQA 32/8, ffn 8192,
vocabulary 128,256, untied head; bf16 shards, written with ``realshape``'s streamed
writer) with a byte-level BPE tokenizer trained on the spot (tests/gguf_fixtures.py),
loaded in float32 as a CPU finetune loads it, LoRA r=16 on every linear with non-zero B.
Each export runs in its own process (psutil samples its RSS every 50 ms): the time of
the export call and the peak RSS above the RSS before it. Then one process computes the
merged model's logits on a probe and compares each GGUF read back by transformers' own
GGUF loader (max/mean |diff|, top-1 agreement).

    .venv/bin/python benchmarks/gguf_export.py [--out benchmarks/results/gguf-DATE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT / "src", ROOT / "tests", ROOT / "benchmarks"):
    sys.path.insert(0, str(p))

import torch  # noqa: E402

MODES = ["merged", "f16", "bf16", "q8_0"]
PROBE = (
    "The quick brown fox jumps over the lazy dog. Hello world! How are you today? "
    "Fine-tuning on a shoestring: 4-bit base, 16-bit export, 1234 5678."
)
CACHE = Path(os.environ.get("SHOESTRING_BENCH_CACHE", Path.home() / ".cache" / "shoestring"))


def model_dir() -> Path:
    from transformers import GenerationConfig

    from gguf_fixtures import LLAMA3_SPLIT, LLAMA3_TEMPLATE, bpe_tokenizer
    from realshape import Shape, model_tensors, row_blocks
    from shoestring.stwriter import TensorSpec, write_sharded

    target = CACHE / "gguf-bench-llama1b-v1"
    if (target / ".complete").is_file():
        return target
    specials = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ]
    tok = bpe_tokenizer(LLAMA3_SPLIT, specials, specials[0], specials[-1], LLAMA3_TEMPLATE)
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    config = Shape(2048, 16, 32, 8, 8192, 128256, 8192, 500000.0).config(ids)
    specs = [TensorSpec(n, s, torch.bfloat16) for n, s in model_tensors(config)]
    write_sharded(target, specs, lambda s: row_blocks(s.name, s.shape, 0, s.dtype), 2 << 30)
    config.save_pretrained(target)
    GenerationConfig(**ids).save_pretrained(target)
    tok.save_pretrained(target)
    (target / ".complete").write_text("ok\n")
    return target


def adapted(d: Path) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    torch.manual_seed(0)  # lora_A's init: the same adapter in every process
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
    return model.eval()


class PeakRss:
    def __init__(self) -> None:
        import psutil

        self.proc, self.peak, self.stop = psutil.Process(), 0, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.05)


def one(mode: str, out: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from shoestring.train.export import export_merged
    from shoestring.train.ggufexport import export_gguf

    d = model_dir()
    model, tok = adapted(d), AutoTokenizer.from_pretrained(d)
    sampler = PeakRss()
    before = sampler.proc.memory_info().rss
    sampler.thread.start()
    t0 = time.perf_counter()
    if mode == "merged":
        path = export_merged(model, tok, out)
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    else:
        path = export_gguf(model, tok, out / "gguf", mode, d.name)  # type: ignore[arg-type]
        size = path.stat().st_size
    seconds = time.perf_counter() - t0
    sampler.stop.set()
    sampler.thread.join()
    return {
        "mode": mode,
        "seconds": round(seconds, 2),
        "rss_before_gb": round(before / 1e9, 3),
        "rss_peak_gb": round(sampler.peak / 1e9, 3),
        "rss_extra_gb": round((sampler.peak - before) / 1e9, 3),
        "output_gb": round(size / 1e9, 3),
        "path": str(path),
    }


def agree(out: Path) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = model_dir()
    tok = AutoTokenizer.from_pretrained(d)
    ids = torch.tensor([tok(PROBE)["input_ids"]])
    model = adapted(d)
    with torch.no_grad():
        ref = model(input_ids=ids).logits.float()
    del model
    rows = []
    for kind in MODES[1:]:
        name = f"{d.name}-{kind}.gguf"
        g = AutoModelForCausalLM.from_pretrained(out / "gguf", gguf_file=name, dtype=torch.float32)
        with torch.no_grad():
            got = g.eval()(input_ids=ids).logits.float()
        del g
        diff = (got - ref).abs()
        rows.append(
            {
                "type": kind,
                "max_abs": float(diff.max()),
                "mean_abs": float(diff.mean()),
                "ref_max_abs": float(ref.abs().max()),
                "ref_std": float(ref.std()),
                "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
                "probe_tokens": int(ids.shape[1]),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/gguf-2026-12-06.json"))
    ap.add_argument("--work", default=str(CACHE / "gguf-bench-out"))
    ap.add_argument("--one", choices=MODES)
    ap.add_argument("--agree", action="store_true")
    a = ap.parse_args()
    work = Path(a.work)
    if a.one or a.agree:
        torch.set_num_threads(2)
        print(json.dumps(one(a.one, work) if a.one else agree(work)))
        return
    t0 = time.perf_counter()
    print(f"load average at start: {os.getloadavg()}", flush=True)
    d = model_dir()
    print(f"model {d} ready in {time.perf_counter() - t0:.0f} s", flush=True)
    result: dict[str, Any] = {
        "model": "llama-3.2-1b shape, random init, float32 base, LoRA r=16 all-linear",
        "exports": [],
    }
    for mode in MODES:
        r = subprocess.run(
            [sys.executable, __file__, "--one", mode, "--work", str(work)],
            capture_output=True,
            text=True,
            check=True,
        )
        result["exports"].append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(result["exports"][-1], flush=True)
    r = subprocess.run(
        [sys.executable, __file__, "--agree", "--work", str(work)],
        capture_output=True,
        text=True,
        check=True,
    )
    result["agreement"] = json.loads(r.stdout.strip().splitlines()[-1])
    print(result["agreement"], flush=True)
    result["loadavg_at_end"] = os.getloadavg()
    result["total_seconds"] = round(time.perf_counter() - t0, 1)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
