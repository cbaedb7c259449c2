"""The peer side of gpu_check's comparison: Hugging Face Trainer + PEFT (+ bitsandbytes).

Given one spec (the dict ``gpu_check.peer_spec`` writes, which also becomes our finetune
config), trains the same model on the same tokenized examples in the same order, with the
same batch, micro-batch, precision, sequence length, LoRA rank/alpha/dropout/targets,
quantization, optimizer, learning-rate peak, warm-up and cosine floor, gradient clipping
and gradient checkpointing, and reports tokens/s, peak CUDA memory and the loss curve.

* Same examples: the records are tokenized by shoestring's own ``tokenize_records`` (the
  function our finetune uses for ``data.format text``), every one longer than the
  sequence, so every row is exactly ``seq`` tokens on both sides (no padding).
* Same order: ``SampleOrder(len, seed)`` (our data cursor) laid out in a list that the
  Trainer reads sequentially.
* The recipe is the one HF users write: ``BitsAndBytesConfig`` nf4 + double quant with
  ``prepare_model_for_kbit_training`` for QLoRA, ``optim`` by name (``adamw_torch``,
  ``adamw_bnb_8bit``, ``paged_adamw_8bit``). The schedule is ours (linear warm-up from
  1/warmup, cosine to the floor) as a ``LambdaLR``: HF's ``cosine_with_min_lr`` starts
  its warm-up at 0, which shifts every later step's learning rate by one. One known
  difference, kept because it is what users run: ``prepare_model_for_kbit_training``
  upcasts the non-quantized weights to fp32 (memory the HF side pays and ours does not).
* LoRA's A matrices are drawn from different generators (B starts at zero on both), so
  the first step's loss is the base model's on both sides; later steps agree within
  the tolerance gpu_check states, not bit for bit.

Timing: ``on_step_begin``/``on_step_end`` around each optimizer step (CUDA synchronized),
the median over the steps after the first 2, tokens = batch x seq per step.

Usage (gpu_check runs it in a child process)::

    python benchmarks/hf_baseline.py --spec SPEC.json --out RESULT.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HF_OPTIM = {
    "adamw": "adamw_torch",
    "adamw8bit": "adamw_bnb_8bit",
    "paged_adamw8bit": "paged_adamw_8bit",
}
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


#: Loss-curve agreement between the two sides (and between our speed variants): the
#: first step (LoRA B = 0 on both: the base model's loss on the same batch) within
#: ``first``; the mean over all steps of |ours - theirs| / theirs within ``mean``.
#: bf16/fp16 round differently per kernel, hence the wider first-step bound there.
TOLERANCE = {"fp32": {"first": 1e-3, "mean": 0.05}, "half": {"first": 0.02, "mean": 0.05}}


def write_data(path: Path, records: int, seq: int, seed: int) -> Path:
    """``records`` text records of random words, each far longer than ``seq`` tokens
    (6 characters per token), so every sample is cut to exactly ``seq`` on both sides."""
    import random

    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(2000)]  # fmt: skip
    with open(path, "w") as f:
        for _ in range(records):
            text = ""
            while len(text) < 6 * seq:
                text += rng.choice(words) + " "
            f.write(json.dumps({"text": text}) + "\n")
    return path


def peer_spec(**kw: Any) -> dict[str, Any]:
    """One side-by-side workload; both sides read exactly these values."""
    spec: dict[str, Any] = {
        "steps": 20,
        "batch": 8,
        "micro_batch": 1,
        "seq": 1024,
        "lr": 2e-4,
        "warmup": 2,
        "min_lr_ratio": 0.1,
        "lora_r": 16,
        "lora_alpha": 32.0,
        "lora_dropout": 0.05,
        "targets": "all-linear",
        "quantize": "nf4",
        "optimizer": "paged_adamw8bit",
        "precision": "bf16",
        "gradient_checkpointing": True,
        "seed": 0,
        "device": "cuda",
        "threads": 0,
    }
    spec.update(kw)
    spec["model_dtype"] = DTYPES[spec["precision"]]
    return spec


def our_config(spec: dict[str, Any], **train: Any) -> dict[str, Any]:
    """The same workload as a ``shoestring finetune`` config (plus ``train`` overrides)."""
    t: dict[str, Any] = {
        "max_steps": spec["steps"],
        "batch_size": spec["batch"],
        "micro_batch_size": spec["micro_batch"],
        "lr": spec["lr"],
        "warmup_steps": spec["warmup"],
        "min_lr_ratio": spec["min_lr_ratio"],
        "max_grad_norm": 1.0,
        "optimizer": spec["optimizer"],
        "precision": spec["precision"],
        "device": spec["device"],
        "seed": spec["seed"],
        **({"num_threads": spec["threads"]} if spec["threads"] else {}),
        **train,
    }
    return {
        "model": {
            "path": spec["model"],
            "dtype": spec["model_dtype"],
            "gradient_checkpointing": spec["gradient_checkpointing"],
        },
        "data": {
            "train": spec["data"],
            "format": "text",
            "max_length": spec["seq"],
            "truncate": "right",
            "packing": False,
            "eval": "",
        },  # fmt: skip
        "train": t,
        "eval": {"every_steps": 0},
        "lora": {
            "r": spec["lora_r"],
            "alpha": spec["lora_alpha"],
            "dropout": spec["lora_dropout"],
            "target_modules": [spec["targets"]],
            "quantize": spec["quantize"],
            "cache_quantized": False,
        },
        "checkpoint": {"every_steps": 0},
        "preempt": {"cloud": "none"},
        "plan": {"enforce": False},
    }


def curves_agree(ours: list[float], theirs: list[float], precision: str) -> dict[str, Any]:
    """Do two loss curves agree within :data:`TOLERANCE`? The numbers and the verdict."""
    tol = TOLERANCE["fp32" if precision == "fp32" else "half"]
    n = min(len(ours), len(theirs))
    if n == 0:
        return {"agree": False, "reason": "no loss values"}
    rel = [abs(a - b) / abs(b) for a, b in zip(ours[:n], theirs[:n])]
    first, mean = rel[0], sum(rel) / n
    return {
        "steps_compared": n,
        "first_step_rel_diff": first,
        "mean_rel_diff": mean,
        "max_rel_diff": max(rel),
        "tolerance": tol,
        "agree": first <= tol["first"] and mean <= tol["mean"],
    }


def ordered_examples(spec: dict[str, Any], tok: Any) -> list[dict[str, list[int]]]:
    """The records of ``spec['data']`` tokenized as our finetune does, in our order."""
    from shoestring.data.tokenize import TokenizeSpec, tokenize_records
    from shoestring.train.data import SampleOrder, from_dicts

    rows = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines() if line]
    examples, _ = tokenize_records(from_dicts(rows, "data"), tok, TokenizeSpec(spec["seq"]))
    short = [i for i, e in enumerate(examples) if len(e.input_ids) != spec["seq"]]
    if short:
        raise SystemExit(f"hf_baseline: {len(short)} example(s) shorter than seq {spec['seq']}")
    order = SampleOrder(len(examples), spec["seed"]).indices(0, spec["steps"] * spec["batch"])
    return [{"input_ids": examples[i].input_ids, "labels": examples[i].labels} for i in order]


def load_model(spec: dict[str, Any]) -> Any:
    """The base (4-bit through bitsandbytes for nf4) with PEFT's LoRA, HF's recipe."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype = getattr(torch, spec["model_dtype"])
    kw: dict[str, Any] = {"dtype": dtype}
    if spec["quantize"] == "nf4":
        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )
    if spec["device"] == "cuda":
        kw["device_map"] = {"": 0}
    model = AutoModelForCausalLM.from_pretrained(spec["model"], **kw)
    model.config.use_cache = False
    if spec["quantize"] == "nf4":
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=spec["gradient_checkpointing"]
        )
    elif spec["gradient_checkpointing"]:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    lora = LoraConfig(
        r=spec["lora_r"],
        lora_alpha=spec["lora_alpha"],
        lora_dropout=spec["lora_dropout"],
        target_modules=spec["targets"],
        task_type="CAUSAL_LM",
        bias="none",
    )
    torch.manual_seed(spec["seed"])  # LoRA's A init: the same draw on every run
    return get_peft_model(model, lora)


def training_args(spec: dict[str, Any], out: Path) -> Any:
    from transformers import TrainingArguments

    accum = spec["batch"] // spec["micro_batch"]
    return TrainingArguments(
        output_dir=str(out),
        max_steps=spec["steps"],
        per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=accum,
        learning_rate=spec["lr"],
        weight_decay=0.0,
        warmup_steps=spec["warmup"],
        max_grad_norm=1.0,
        optim=HF_OPTIM[spec["optimizer"]],
        bf16=spec["precision"] == "bf16",
        fp16=spec["precision"] == "fp16",
        gradient_checkpointing=False,  # set on the model above, as ours
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=spec["device"] != "cuda",
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        disable_tqdm=True,
        seed=spec["seed"],
        remove_unused_columns=False,
    )


def run(spec: dict[str, Any], out: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer, Trainer, TrainerCallback

    from shoestring.train.learner import lr_lambda

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    cuda = spec["device"] == "cuda"
    if cuda and spec.get("memory_fraction"):
        torch.cuda.set_per_process_memory_fraction(spec["memory_fraction"])
    tok = AutoTokenizer.from_pretrained(spec["model"])
    rows = ordered_examples(spec, tok)
    model = load_model(spec)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times: list[float] = []
    losses: dict[int, float] = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001, ANN201
            if cuda:
                torch.cuda.synchronize()
            times.append(-time.perf_counter())

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ANN201
            if cuda:
                torch.cuda.synchronize()
            times[-1] += time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):  # noqa: ANN001, ANN201
            if logs and "loss" in logs:
                losses[state.global_step] = float(logs["loss"])

    class InOrder(Trainer):  # our order, laid out already: read it front to back
        def _get_train_sampler(self, train_dataset=None):  # noqa: ANN001, ANN202
            return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)

        def create_scheduler(self, num_training_steps, optimizer=None):  # noqa: ANN001, ANN202
            if self.lr_scheduler is None:
                shape = lr_lambda(spec["warmup"], spec["steps"], spec["min_lr_ratio"])
                opt = optimizer or self.optimizer
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(opt, shape)
            return self.lr_scheduler

    trainer = InOrder(
        model=model,
        args=training_args(spec, out),
        train_dataset=rows,
        data_collator=lambda b: {
            k: torch.tensor([r[k] for r in b]) for k in ("input_ids", "labels")
        },
        callbacks=[Clock()],
    )
    trainer.train()
    steady = times[2:] or times
    step_s = statistics.median(steady)
    res: dict[str, Any] = {
        "side": "hf_trainer_peft",
        "steps": len(times),
        "steps_measured": len(steady),
        "step_ms": step_s * 1e3,
        "tokens_per_s": spec["batch"] * spec["seq"] / step_s,
        "losses": [losses[s] for s in sorted(losses)],
        "recipe": "BitsAndBytesConfig nf4 + prepare_model_for_kbit_training"
        if spec["quantize"] == "nf4"
        else "from_pretrained in model_dtype",
        "optim": HF_OPTIM[spec["optimizer"]],
    }
    if cuda:
        res["cuda_peak_bytes"] = int(torch.cuda.max_memory_allocated())
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    spec = json.loads(a.spec.read_text())
    res = run(spec, a.out.parent / "hf-trainer-out")
    a.out.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
