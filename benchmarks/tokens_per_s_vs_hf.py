"""Fine-tuning tokens/s: shoestring vs Hugging Face Trainer + peft, checkpointing ON in both.

Same model dir (the built-in tiny Llama, or a random Llama via --hidden/--layers),
same records (``builtin:reverse`` train split, prompt/completion, loss on the
completion + EOS only), same max_length, batch size, grad accumulation, lr,
warm-up + cosine to 10 % of lr, AdamW (weight decay 0), grad clip 1.0, LoRA
r/alpha/dropout on "all-linear", same number of steps, same torch threads,
dataloader workers 0, and a checkpoint every K steps in both (ours:
``checkpoint.every_steps=K``; HF: ``save_strategy="steps", save_steps=K``,
``save_total_limit=2`` like ours ``checkpoint.keep=2``).

Tokens are counted identically: the non-pad tokens actually fed to the model
(the attention-mask sum of every micro-batch); ours from the "step" events,
HF from an overridden ``training_step``.

Timed window (identical for both, training loop only, no model load, no eval):
from the end of optimizer step 1 (ours: the step-1 event; HF: ``on_step_end``
at global_step 1) to the end of step N *including the step-N checkpoint being
committed* (ours: the later of the step-N event and the step-N "checkpoint"
event, which the background writer emits after the commit; HF: ``on_save`` at
step N, which fires after the synchronous save). Step 1 is excluded on both
sides (one-off warm-up of kernels and allocator); tokens are those of steps 2..N.
Everything in between counts: data collation, forward/backward/optimizer,
logging, and all checkpoints (ours: blocking snapshot + background writer
competing for the CPU; HF: synchronous save).

Each side runs in a fresh subprocess, alternating ours, HF, ours, HF, ...

Usage (from the repo root)::

    .venv/bin/python benchmarks/tokens_per_s_vs_hf.py
    .venv/bin/python benchmarks/tokens_per_s_vs_hf.py --rounds 3 --steps 150
    .venv/bin/python benchmarks/tokens_per_s_vs_hf.py --hf-optim adamw_torch  # HF without fused AdamW
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import DEFAULT_CACHE, load_note, median, model_dir

IGNORE_INDEX = -100


# --------------------------------------------------------------------------- ours


def run_ours(a: argparse.Namespace, mdir: Path, out: Path) -> dict[str, Any]:
    import torch

    from shoestring.config import load
    from shoestring.events import read_events
    from shoestring.train.config import FinetuneConfig
    from shoestring.train.loop import RunOptions, finetune

    torch.set_num_threads(a.threads)
    overrides = [
        "--output_dir",
        str(out),
        "--model.path",
        str(mdir),
        "--data.max_length",
        str(a.max_length),
        "--train.max_steps",
        str(a.steps),
        "--train.seed",
        "0",
        "--train.batch_size",
        str(a.batch_size * a.grad_accum),
        "--train.micro_batch_size",
        str(a.batch_size),
        "--train.lr",
        str(a.lr),
        "--train.weight_decay",
        "0",
        "--train.warmup_steps",
        str(a.warmup),
        "--train.min_lr_ratio",
        "0.1",
        "--train.max_grad_norm",
        "1.0",
        "--train.num_threads",
        str(a.threads),
        "--train.log_every_steps",
        "10",
        "--lora.r",
        str(a.lora_r),
        "--lora.alpha",
        str(a.lora_alpha),
        "--lora.dropout",
        str(a.lora_dropout),
        "--lora.target_modules",
        "all-linear",
        "--checkpoint.every_steps",
        str(a.every),
        "--checkpoint.keep",
        "2",
        "--checkpoint.async_mode",
        a.async_mode,
        # eval happens before step 1 and after step N, outside the timed window; keep it short
        "--eval.max_samples",
        "16",
        "--eval.exact_match",
        "false",
    ]
    cfg = load(FinetuneConfig, None, overrides)
    rc = finetune(cfg, RunOptions(resume="never", cache_dir=a.cache, tty=False))
    if rc != 0:
        raise SystemExit(f"shoestring finetune exited {rc}")
    ev = list(read_events(out / "events.jsonl"))
    steps = {e["step"]: e for e in ev if e["event"] == "step"}
    ckpt = {e["step"]: e for e in ev if e["event"] == "checkpoint"}
    n = a.steps
    start = steps[1]["ts"]
    end = max(steps[n]["ts"], ckpt[n]["ts"] if n in ckpt else 0.0)
    tokens = sum(steps[s]["tokens"] for s in range(2, n + 1))
    return {
        "side": "ours",
        "tokens": tokens,
        "seconds": end - start,
        "checkpoints": sorted(ckpt),
        "step1_ms": steps[1]["step_ms"],
        "tokens_all": sum(e["tokens"] for e in steps.values()),
        "seconds_all": end - (start - steps[1]["step_ms"] / 1e3),
        "final_loss": steps[n]["loss"],
        "threads_seen": [torch.get_num_threads()],
        "step_ms": [steps[s]["step_ms"] for s in range(1, n + 1)],
    }


# --------------------------------------------------------------------------- HF


def tokenize(
    records: list[dict[str, str]], tok: Any, max_length: int
) -> list[dict[str, list[int]]]:
    """prompt/completion → input_ids, labels (-100 on BOS+prompt), EOS appended, truncated."""
    out = []
    for r in records:
        p = [tok.bos_token_id] + tok.encode(r["prompt"], add_special_tokens=False)
        c = tok.encode(r["completion"], add_special_tokens=False) + [tok.eos_token_id]
        ids, labels = (p + c)[:max_length], ([IGNORE_INDEX] * len(p) + c)[:max_length]
        out.append({"input_ids": ids, "labels": labels})
    return out


def collate(batch: list[dict[str, list[int]]], pad_id: int) -> dict[str, Any]:
    """Right-pad to the longest; pad masked out of attention (0) and loss (-100)."""
    import torch

    width = max(len(ex["input_ids"]) for ex in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ex in enumerate(batch):
        n = len(ex["input_ids"])
        ids[row, :n] = torch.tensor(ex["input_ids"])
        labels[row, :n] = torch.tensor(ex["labels"])
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def run_hf(a: argparse.Namespace, mdir: Path, out: Path) -> dict[str, Any]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from shoestring.data.tokenize import TokenizeSpec, tokenize_records
    from shoestring.train import data as D
    from shoestring.train.builtin import builtin_records

    torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(str(mdir))
    records = builtin_records("train")
    examples = tokenize(records, tok, a.max_length)
    # same examples as shoestring's own tokenizer (sanity check, outside any timing)
    ref = tokenize_records(D.from_dicts(records, "train"), tok, TokenizeSpec(a.max_length))[0]
    assert all(
        e["input_ids"] == r.input_ids and e["labels"] == r.labels for e, r in zip(examples, ref)
    ), "tokenization differs from shoestring's"

    class ListDataset(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(examples)

        def __getitem__(self, i: int) -> dict[str, list[int]]:
            return examples[i]

    model = AutoModelForCausalLM.from_pretrained(str(mdir), dtype=torch.float32)
    model.config.use_cache = False
    lcfg = LoraConfig(
        r=a.lora_r,
        lora_alpha=a.lora_alpha,
        lora_dropout=a.lora_dropout,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
        bias="none",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = get_peft_model(model, lcfg)

    marks: dict[str, dict[int, float]] = {"step_end": {}, "save": {}}
    tokens: dict[int, int] = {}
    threads_seen: set[int] = set()

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
            marks["step_end"][state.global_step] = time.time()

        def on_save(self, args, state, control, **kw):  # noqa: ANN001
            marks["save"][state.global_step] = time.time()

    class CountingTrainer(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):  # noqa: ANN001
            step = self.state.global_step + 1
            threads_seen.add(torch.get_num_threads())
            tokens[step] = tokens.get(step, 0) + int(inputs["attention_mask"].sum())
            return super().training_step(model, inputs, num_items_in_batch)

    args = TrainingArguments(
        output_dir=str(out),
        max_steps=a.steps,
        per_device_train_batch_size=a.batch_size,
        gradient_accumulation_steps=a.grad_accum,
        learning_rate=a.lr,
        weight_decay=0.0,
        warmup_steps=a.warmup,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1},
        max_grad_norm=1.0,
        optim=a.hf_optim,
        logging_steps=10,
        save_strategy="steps",
        save_steps=a.every,
        save_total_limit=2,
        report_to="none",
        use_cpu=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        disable_tqdm=True,
        seed=0,
        remove_unused_columns=False,
    )
    trainer = CountingTrainer(
        model=model,
        args=args,
        train_dataset=ListDataset(),
        data_collator=lambda b: collate(b, tok.pad_token_id),
        callbacks=[Timer()],
    )
    trainer.train()
    n = a.steps
    start = marks["step_end"][1]
    end = max(marks["step_end"][n], marks["save"].get(n, 0.0))
    step1_ms = None
    return {
        "side": "hf",
        "tokens": sum(tokens[s] for s in range(2, n + 1)),
        "seconds": end - start,
        "checkpoints": sorted(marks["save"]),
        "step1_ms": step1_ms,
        "tokens_all": sum(tokens.values()),
        "seconds_all": None,
        "optim": a.hf_optim,
        "threads_seen": sorted(threads_seen),
        "step_gap_ms": [
            1e3 * (marks["step_end"][s] - marks["step_end"][s - 1]) for s in range(2, n + 1)
        ],
    }


# --------------------------------------------------------------------------- driver


def worker(a: argparse.Namespace) -> int:
    mdir = model_dir(a.cache, a.hidden, a.layers, a.intermediate)
    out = Path(tempfile.mkdtemp(prefix=f"bench-tps-{a.worker}-"))
    try:
        res = (run_ours if a.worker == "ours" else run_hf)(a, mdir, out)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    res["tokens_per_s"] = res["tokens"] / res["seconds"]
    Path(a.result).write_text(json.dumps(res))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--every", type=int, default=25, help="checkpoint every K steps (both sides)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating (ours, HF) pairs")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--lora-alpha", type=float, default=32.0)
    ap.add_argument("--lora-dropout", type=float, default=0.05)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads, same for both sides (default 1: on a shared "
        "2-core box, 2 OpenMP threads per process collapse 5-20x whenever "
        "another process is busy; 1 thread is stable to a few %%)",
    )
    ap.add_argument(
        "--async-mode",
        default="thread",
        choices=("thread", "process", "off"),
        help="ours: checkpoint.async_mode",
    )
    ap.add_argument(
        "--hf-optim",
        default="adamw_torch_fused",
        help="HF TrainingArguments.optim (HF's default is adamw_torch_fused; "
        "adamw_torch is the exact implementation ours uses)",
    )
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--intermediate", type=int)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--worker", choices=("ours", "hf"), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a)
    if a.steps % a.every:
        ap.error("--steps must be a multiple of --every (both sides then save at the last step)")

    note = load_note()
    model_dir(a.cache, a.hidden, a.layers, a.intermediate)  # build once, outside any timing
    raw = list(argv if argv is not None else sys.argv[1:])
    passthrough: list[str] = []
    skip = False
    for x in raw:  # forward every option to the workers except --json
        if skip:
            skip = False
        elif x == "--json":
            skip = True
        elif not x.startswith("--json="):
            passthrough.append(x)
    runs: list[dict[str, Any]] = []
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
    for rnd in range(a.rounds):
        for side in ("ours", "hf"):
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                result = f.name
            cmd = [sys.executable, __file__, *passthrough, "--worker", side, "--result", result]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stdout[-3000:], proc.stderr[-5000:], file=sys.stderr)
                raise SystemExit(f"{side} worker failed ({proc.returncode})")
            res = json.loads(Path(result).read_text())
            os.unlink(result)
            res["round"], res["process_s"] = rnd + 1, time.perf_counter() - t0
            runs.append(res)
            print(
                f"round {rnd + 1} {side:4s}: {res['tokens_per_s']:9.1f} tokens/s  "
                f"({res['tokens']} tokens in {res['seconds']:.2f} s, steps 2..{a.steps}; "
                f"checkpoints at {res['checkpoints']}; process {res['process_s']:.0f} s)",
                flush=True,
            )

    ours = [r["tokens_per_s"] for r in runs if r["side"] == "ours"]
    hf = [r["tokens_per_s"] for r in runs if r["side"] == "hf"]
    ratio = median(ours) / median(hf)
    per_round = [o / h for o, h in zip(ours, hf)]
    model = f"random Llama h{a.hidden} l{a.layers}" if a.hidden or a.layers else "builtin:tiny"
    print()
    print("== fine-tuning tokens/s: shoestring vs HF Trainer + peft (CPU) ==")
    print(
        f"model {model}; batch {a.batch_size} x accum {a.grad_accum}, max_length {a.max_length}, "
        f"LoRA r={a.lora_r} alpha={a.lora_alpha:g} dropout={a.lora_dropout:g} all-linear; "
        f"{a.steps} steps, checkpoint every {a.every}; threads {a.threads}; "
        f"ours async_mode={a.async_mode}, HF optim={a.hf_optim}"
    )
    print(f"machine before start: {note}")
    print(
        "window: end of step 1 -> step N done incl. its checkpoint committed; tokens = "
        "attention-mask sum of steps 2..N; no model load, no eval"
    )
    print(f"ours tokens/s: {', '.join(f'{x:.1f}' for x in ours)}  (median {median(ours):.1f})")
    print(f"HF   tokens/s: {', '.join(f'{x:.1f}' for x in hf)}  (median {median(hf):.1f})")
    print(
        f"ratio ours/HF (median/median): {ratio:.3f}   per round: "
        f"{', '.join(f'{r:.3f}' for r in per_round)}   target >= 1.0: "
        f"{'PASS' if ratio >= 1.0 else 'FAIL'}"
    )
    if a.json:
        a.json.write_text(
            json.dumps(
                {
                    "runs": runs,
                    "ratio": ratio,
                    "per_round": per_round,
                    "machine": note,
                    "args": {k: str(v) for k, v in vars(a).items()},
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
