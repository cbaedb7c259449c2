"""Planner prediction vs what CUDA actually allocates, per config (for a GPU session).

For each case it builds a random-init Llama of a preset's shape (fewer layers by
default, so loading is quick; memory does not depend on weight values), loads it
through shoestring's own path (``load_base_model`` + ``apply_lora``, so nf4/int8
go through bitsandbytes), runs two optimizer steps and reports, for the second:

* ``torch.cuda.max_memory_allocated`` vs the planner's peak without the CUDA
  context (the allocator cannot see the context), and ``max_memory_reserved``
  (the fragmentation the planner's allowance is meant to cover);
* the bytes autograd saved for backward vs the planner's activation term (checks the
  CUDA-only assumptions: bool dropout masks, repeated KV heads under a mask).

Usage (GPU box):  .venv/bin/python benchmarks/plan_vs_cuda.py --out $OUT/plan_vs_cuda.json
Smoke test (CPU): .venv/bin/python benchmarks/plan_vs_cuda.py --device cpu --cases tiny
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from shoestring.plan.arch import LINEARS, PRESETS, Arch  # noqa: E402
from shoestring.plan.estimate import breakdown  # noqa: E402
from shoestring.plan.measure import saved_activation_bytes  # noqa: E402
from shoestring.plan.memory import Workload, activation_bytes  # noqa: E402
from shoestring.plan.workload import builtin_arch  # noqa: E402
from shoestring.train.config import LoraSection, ModelConfig  # noqa: E402

#: name -> (arch, method, seq, micro-batch, gradient checkpointing, optimizer, dropout)
CASES = {
    "tiny": (builtin_arch(), "qlora", 256, 4, False, "adamw8bit", 0.05),
    "l3-8b-4L-qlora-gc": (
        replace(PRESETS["llama-3-8b"], layers=4),
        "qlora",
        2048,
        1,
        True,
        "adamw",
        0.05,
    ),
    "l3-8b-4L-qlora": (
        replace(PRESETS["llama-3-8b"], layers=4),
        "qlora",
        1024,
        2,
        False,
        "paged_adamw8bit",
        0.0,
    ),
    "l2-7b-4L-lora-gc": (
        replace(PRESETS["llama-2-7b"], layers=4),
        "lora",
        4096,
        2,
        True,
        "adamw",
        0.05,
    ),
    "l2-7b-4L-lora": (
        replace(PRESETS["llama-2-7b"], layers=4),
        "lora",
        1024,
        4,
        False,
        "adamw",
        0.05,
    ),
    "mistral-7b-4L-int8": (
        replace(PRESETS["mistral-7b"], layers=4),
        "qlora-int8",
        1024,
        2,
        True,
        "adamw8bit",
        0.05,
    ),
}


def write_model(arch: Arch, dtype: torch.dtype, target: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=arch.vocab,
        hidden_size=arch.hidden,
        intermediate_size=arch.intermediate,
        num_hidden_layers=arch.layers,
        num_attention_heads=arch.heads,
        num_key_value_heads=arch.kv_heads,
        head_dim=arch.head_dim,
        tie_word_embeddings=arch.tie_embeddings,
        max_position_embeddings=8192,
    )
    with torch.device("cpu"):
        LlamaForCausalLM(cfg).to(dtype).save_pretrained(target)


def peak_error(breakdown: dict[str, int], max_allocated: int) -> dict[str, float]:
    """The planner's allocated peak (every term but ``overhead``: the CUDA context and
    fragmentation, which ``max_memory_allocated`` cannot see) vs the measured
    ``max_memory_allocated``: signed error in % of the measurement."""
    allocated = sum(v for k, v in breakdown.items() if k != "overhead")
    return {
        "peak_predicted_allocated": allocated,
        "peak_err_pct": 100 * (allocated - max_allocated) / max_allocated,
    }


def run_case(name: str, device: str, dtype: str) -> dict[str, object]:
    from shoestring.train.model import (
        apply_lora,
        build_optimizer,
        load_base_model,
        trainable_parameters,
    )

    arch, method, seq, mb, gc, opt_name, dropout = CASES[name]
    quantize = {"qlora": "nf4", "qlora-int8": "int8"}.get(method, "none")
    method = "qlora" if quantize != "none" else method
    w = Workload(
        arch=arch,
        method=method,
        quantize=quantize,
        dtype=dtype,
        seq_len=seq,
        micro_batch=mb,
        gradient_checkpointing=gc,
        optimizer=opt_name,
        lora_dropout=dropout,
        lora_targets=LINEARS,
        padded=True,
        device="cuda" if device.startswith("cuda") else "cpu",
    )
    parts, act_parts = breakdown(w)
    with tempfile.TemporaryDirectory() as d:
        write_model(arch, getattr(torch, dtype), Path(d))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            base = load_base_model(Path(d), ModelConfig(path=d, dtype=dtype), quantize, device)
            if quantize == "none":
                base.to(device)
            model = apply_lora(
                base,
                LoraSection(r=w.lora_r, alpha=32, dropout=dropout, target_modules=["all-linear"]),
                0,
                gc,
            )
    model.train()
    opt = build_optimizer(list(trainable_parameters(model).values()), opt_name, 1e-4, 0.0)
    ids = torch.randint(0, arch.vocab, (mb, seq), device=device)
    mask = torch.ones_like(ids)
    mask[0, -seq // 4 :] = 0  # padded batch, as the trainer's collate produces
    result: dict[str, object] = {"case": name, "predicted": parts, "activation_parts": act_parts}
    for step in range(2):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        if step == 1:
            forward = functools.partial(model, input_ids=ids, attention_mask=mask, labels=ids)
            saved = saved_activation_bytes(model, forward)
            result["saved_measured"] = saved
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        del out
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            result["max_allocated"] = torch.cuda.max_memory_allocated()
            result["max_reserved"] = torch.cuda.max_memory_reserved()
        result["step_s"] = time.perf_counter() - t0
    pred_saved = activation_bytes(w).saved  # without closure-held tensors (hooks miss them)
    result["saved_predicted"] = pred_saved
    result["saved_err_pct"] = (
        100 * (pred_saved - result["saved_measured"]) / result["saved_measured"]
    )  # type: ignore[operator]
    if "max_allocated" in result:
        result.update(peak_error(parts, int(result["max_allocated"])))  # type: ignore[call-overload]
    del model, opt
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu for a smoke test", file=sys.stderr)
        return 2
    results = []
    for name in args.cases.split(","):
        r = run_case(name, args.device, args.dtype)
        results.append(r)
        line = (
            f"{name:22s} saved: pred {r['saved_predicted'] / 2**20:9.1f} MiB, "
            f"meas {r['saved_measured'] / 2**20:9.1f} MiB ({r['saved_err_pct']:+.2f}%)"
        )  # type: ignore[operator]
        if "max_allocated" in r:
            line += (
                f" | peak: pred {r['peak_predicted_no_context'] / 2**30:.2f} GiB, "  # type: ignore[operator]
                f"allocated {r['max_allocated'] / 2**30:.2f} GiB ({r['peak_err_pct']:+.1f}%), "  # type: ignore[operator]
                f"reserved {r['max_reserved'] / 2**30:.2f} GiB"
            )  # type: ignore[operator]
        print(line, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
