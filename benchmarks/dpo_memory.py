"""Peak memory of DPO: the reference as the adapter-disabled base (shoestring) vs a
separate reference model (a second copy of the base, what TRL does without PEFT or
with ``ref_model`` given, and what users report doubling their memory: trl #624,
LLaMA-Factory #4810). Same config, same batches, same loss code; each arm runs in a
fresh process and reports its peak RSS (``ru_maxrss``) and its RSS after loading.

    .venv/bin/python benchmarks/dpo_memory.py [--layers 8 --hidden 1024 --steps 3]

Raw result: ``benchmarks/results/dpo-memory-<date>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VOCAB = 32000
SEQ = 64
PAIRS = 2


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_model(path: Path, layers: int, hidden: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        head_dim=64,
        max_position_embeddings=256,
    )
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)


def _batch() -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2 * PAIRS, SEQ), generator=g)
    labels = ids.clone()
    labels[:, : SEQ // 2] = -100  # the prompt half takes no loss
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def run_arm(model_dir: Path, arm: str, steps: int) -> dict[str, Any]:
    """One arm in this process: load, LoRA, ``steps`` DPO steps; memory in MB."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from shoestring.train.objective import DPO, model_inputs, sequence_logps

    torch.set_num_threads(2)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = None
    if arm == "separate_reference":
        ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        ref.requires_grad_(False)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear")
    torch.manual_seed(0)  # the same adapter and dropout masks in both arms: the same losses
    model = get_peft_model(base, lora)
    model.train()
    loaded = _rss_mb()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    dpo, batch = DPO(beta=0.1), _batch()
    norm = torch.tensor(float(PAIRS), dtype=torch.float64)
    t0 = time.perf_counter()
    losses: list[float] = []
    for _ in range(steps):
        if ref is None:  # shoestring: the same model, adapter disabled
            out = dpo.loss(model, model, batch, norm)
        else:
            logps = sequence_logps(model(**model_inputs(batch)).logits, batch["labels"])
            with torch.no_grad():
                ref_logps = sequence_logps(ref(**model_inputs(batch)).logits, batch["labels"])
            out = dpo.from_logps(logps, ref_logps, norm)
        losses.append(float(out.loss))
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {
        "arm": arm,
        "rss_after_load_mb": round(loaded, 1),
        "peak_rss_mb": round(_peak_mb(), 1),
        "step_s": round((time.perf_counter() - t0) / steps, 2),
        "losses": losses,
        "params": sum(p.numel() for p in base.parameters()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if args.arm:
        print(json.dumps(run_arm(Path(args.model_dir), args.arm, args.steps)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        write_model(model_dir, args.layers, args.hidden)
        results = [_arm(model_dir, arm, args.steps) for arm in ARMS]
    ours, peer = results
    same = ours["losses"] == peer["losses"]
    ratio = peer["peak_rss_mb"] / ours["peak_rss_mb"]
    doc = {
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
        "config": {
            "layers": args.layers,
            "hidden": args.hidden,
            "vocab": VOCAB,
            "seq": SEQ,
            "pairs_per_step": PAIRS,
            "dtype": "float32",
            "device": "cpu",
            "lora_r": 16,
            "steps": args.steps,
        },
        "arms": results,
        "peak_ratio_separate_over_disabled_adapter": round(ratio, 3),
        "losses_identical": same,
    }
    for r in results:
        print(
            f"{r['arm']:>26}: peak RSS {r['peak_rss_mb']:8.1f} MB, after load "
            f"{r['rss_after_load_mb']:8.1f} MB, step {r['step_s']} s"
        )
    print(f"separate reference / adapter-disabled reference: peak {ratio:.2f}x")
    print(f"losses of the two arms identical: {same}")
    out = Path(args.out) / f"dpo-memory-{doc['date']}.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"raw result: {out}")


ARMS = ("adapter_disabled", "separate_reference")


def _arm(model_dir: Path, arm: str, steps: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--arm", arm, "--model-dir", str(model_dir)]
    cmd += ["--steps", str(steps)]
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


if __name__ == "__main__":
    main()
