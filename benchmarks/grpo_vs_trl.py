"""GRPO on CPU: shoestring's ``train.objective grpo`` vs TRL's ``GRPOTrainer`` (transformers
generation, no vLLM), same model, prompts, reward and settings, one process per side.

Both sides train a LoRA adapter (r 16, alpha 32, dropout 0, all linear layers) on the
same random-init fp32 Llama (built once, outside any timing, by ``_common.model_dir``:
the built-in byte tokenizer beside it) with the same 32 synthetic prompt records, the
same reward function (``letters`` in one ``rewards.py``: the share of a completion's
characters that are lowercase ASCII letters; TRL gets the imported callable, ours
``rewards.py:letters``), 4 prompts x 8 completions per optimizer step (TRL:
``per_device_train_batch_size`` 32 completions, ``gradient_accumulation_steps`` 1,
``generation_batch_size`` 32), up to 32 sampled tokens at temperature 1, top_p 1,
top_k 0, ``beta`` 0, ``loss_type`` dapo, ``num_iterations`` 1, ``scale_rewards`` group,
no warm-up then cosine to 10 % of the learning rate, torch AdamW (TRL: ``optim adamw_torch``, not its fused
default), grad clip 1.0, fp32 (TRL: ``bf16 False``), no gradient checkpointing (TRL's
default is on: turned off), no eval, no checkpoint during the steps (TRL: ``save_strategy
no``; ours: ``checkpoint.every_steps`` past the end, but ours still saves once after the
last step, outside the step times), the same torch threads (``--threads``, also
``OMP_NUM_THREADS``).

What differs by design: ours samples each prompt's group in its own ``generate`` call
(8 rows sharing the prompt, no padding) from a seed keyed by (seed, step, prompt), for
exact resume and world-size invariance; TRL samples the step's 32 rows in one call
(prompts left-padded). Sampled tokens differ (different random draws), so throughput
is also reported per sampled completion token.

Measured per side: each optimizer step's wall time (ours: ``step_ms`` of the step
events, from the start of the rollout to the optimizer step; TRL: a callback's
``on_step_begin`` -> ``on_step_end``, which covers its ``_prepare_inputs``: generation,
scoring, loss, backward, optimizer), the median over steps 2..N (step 1 warms up) and
the fastest of them; the sampled completion tokens per step (ours:
``completions/mean_length`` x completions; TRL: the lengths ``_generate`` returns),
over the step's time and over its rollout time (medians of the per-step rates); the
rollout part of each step (ours: the
``rollout`` work time the rank recorder publishes in ``ranks/rank0/live.json`` —
sampling, scoring, counting; TRL: ``_generate_and_score_completions``, timed by a
subclass — sampling, scoring, advantages); the process's peak RSS (``os.wait4``'s
``ru_maxrss`` of the child, which includes model load and, for ours, the final save)
and its CPU seconds (user + system, start-up included). With more than one round the
table shows the median over the rounds of each side's value.

On a shared 2-core machine, 2 torch threads per process stall whenever another process
is busy (a step can take 10-20x longer); ``--threads 1`` is the steadier comparison.

Usage (from the repo root)::

    .venv/bin/python benchmarks/grpo_vs_trl.py
    .venv/bin/python benchmarks/grpo_vs_trl.py --rounds 2 --threads 1 --json out.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import DEFAULT_CACHE, ROOT, load_note, median, model_dir

REWARD = '''
def letters(completions, completion_ids, **_):
    """The share of a completion's tokens that are lowercase ASCII letters."""
    return [sum(ch.islower() and ch.isascii() for ch in t) / max(len(ids), 1)
            for t, ids in zip(completions, completion_ids)]
'''
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()


def write_inputs(work: Path, n: int) -> tuple[Path, Path]:
    """``n`` prompt records ``{"prompt", "answer"}`` and the reward file."""
    rng = random.Random(7)
    rows = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 4))]
        rows.append({"prompt": f"reverse: {' '.join(words)} =", "answer": " ".join(words[::-1])})
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = work / "rewards.py"
    reward.write_text(REWARD)
    return data, reward


# --------------------------------------------------------------------------- ours


def ours_cmd(a: argparse.Namespace, mdir: Path, data: Path, reward: Path, out: Path) -> list[str]:
    opts = {
        "model.path": mdir,
        "data.train": data,
        "data.eval": "",
        "data.max_length": 256,
        "train.objective": "grpo",
        "train.max_steps": a.steps,
        "train.seed": 0,
        "train.batch_size": a.prompts,
        "train.micro_batch_size": a.prompts,
        "train.lr": a.lr,
        "train.warmup_steps": 0,
        "train.min_lr_ratio": 0.1,
        "train.weight_decay": 0.0,
        "train.max_grad_norm": 1.0,
        "train.num_threads": a.threads,
        "train.precision": "fp32",
        "lora.r": 16,
        "lora.alpha": 32,
        "lora.dropout": 0.0,
        "lora.target_modules": '["all-linear"]',
        "grpo.rewards": json.dumps([f"{reward}:letters"]),
        "grpo.generations": a.generations,
        "grpo.max_completion_tokens": a.max_tokens,
        "grpo.temperature": 1.0,
        "grpo.top_p": 1.0,
        "grpo.top_k": 0,
        "grpo.beta": 0.0,
        "grpo.loss_type": "dapo",
        "grpo.sample_prompts": a.sample_prompts,
        "checkpoint.every_steps": 100_000,
    }
    args = [x for k, v in opts.items() for x in (f"--{k}", str(v))]
    return [sys.executable, "-m", "shoestring", "finetune", "--output_dir", str(out), *args]


def ours_result(out: Path, steps: int, completions: int) -> dict[str, Any]:
    events = [json.loads(x) for x in (out / "events.jsonl").open()]
    by_step = {e["step"]: e for e in events if e["event"] == "step"}
    live = json.loads((out / "ranks" / "rank0" / "live.json").read_text())
    rollout = {step: sec for sec, _, step in live["work"].get("rollout", [])}
    rows = [by_step[s] for s in range(1, steps + 1)]
    return {
        "step_s": [e["step_ms"] / 1e3 for e in rows],
        "rollout_s": [rollout.get(s) for s in range(1, steps + 1)],
        "completion_tokens": [round(e["completions/mean_length"] * completions) for e in rows],
        "tokens": [e["tokens"] for e in rows],
        "reward": [e["reward"] for e in rows],
        "loss": [e["loss"] for e in rows],
    }


# --------------------------------------------------------------------------- TRL


def trl_trainer(a: argparse.Namespace, mdir: Path, data: Path, reward: Path, out: Path) -> Any:
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(a.threads)
    spec = importlib.util.spec_from_file_location("rewards", reward)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tok = AutoTokenizer.from_pretrained(str(mdir), padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(str(mdir), dtype=torch.float32)
    batch = a.prompts * a.generations
    args = GRPOConfig(
        output_dir=str(out), max_steps=a.steps, seed=0, use_cpu=True, bf16=False,
        per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        generation_batch_size=batch, num_generations=a.generations,
        max_completion_length=a.max_tokens, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, loss_type="dapo", num_iterations=1, scale_rewards="group",
        learning_rate=a.lr, lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1}, warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, optim="adamw_torch", gradient_checkpointing=False,
        save_strategy="no", eval_strategy="no", logging_steps=10_000, report_to="none",
        disable_tqdm=True, dataloader_num_workers=0, dataloader_pin_memory=False,
    )  # fmt: skip
    lora = LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    dataset = load_dataset("json", data_files=str(data), split="train")
    cls = timed_trainer_class(GRPOTrainer)
    return cls(
        model=model, reward_funcs=module.letters, args=args, train_dataset=dataset,
        processing_class=tok, peft_config=lora,
    )  # fmt: skip


def timed_trainer_class(base: type) -> type:
    """``base`` (GRPOTrainer) with its rollout and generation timed, and the sampled
    completion tokens counted, per optimizer step."""

    class Timed(base):  # type: ignore[misc, valid-type]
        marks: dict[str, list[float]] = {"rollout_s": [], "generate_s": [], "tokens": []}

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self.marks["rollout_s"].append(time.perf_counter() - t0)
            return out

        def _generate(self, prompts: list[Any]) -> Any:
            t0 = time.perf_counter()
            out = super()._generate(prompts)
            self.marks["generate_s"].append(time.perf_counter() - t0)
            self.marks["tokens"].append(sum(len(ids) for ids in out[1]))
            return out

    return Timed


def run_trl(a: argparse.Namespace) -> int:
    from transformers import TrainerCallback

    work = Path(a.work)
    trainer = trl_trainer(a, Path(a.model), work / "prompts.jsonl", work / "rewards.py", work)
    begin: dict[int, float] = {}
    step_s: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001
            begin[state.global_step] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
            step_s.append(time.perf_counter() - begin[state.global_step - 1])

    trainer.add_callback(StepTimer())
    trainer.train()
    m = trainer.marks
    rewards = [x["reward"] for x in trainer.state.log_history if "reward" in x]
    res = {
        "step_s": step_s,
        "rollout_s": m["rollout_s"],
        "generate_s": m["generate_s"],
        "completion_tokens": m["tokens"],
        "reward_logged_mean": rewards,
    }
    Path(a.result).write_text(json.dumps(res))
    return 0


# --------------------------------------------------------------------------- driver


def child(cmd: list[str], env: dict[str, str], log: Path) -> dict[str, float]:
    """Run ``cmd`` to its end: its wall and CPU seconds (start-up included) and peak RSS
    in MiB, or stop with its log."""
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        print(log.read_text()[-5000:], file=sys.stderr)
        raise SystemExit(f"{cmd[:4]} failed ({proc.returncode})")
    return {
        "process_s": time.perf_counter() - t0,
        "process_cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mib": usage.ru_maxrss / 1024,
    }


def summarize(side: str, raw: dict[str, Any], skip: int) -> dict[str, Any]:
    """Medians over the steps after the first ``skip`` (per step, so one step stalled
    by another process does not drag the rest); the fastest step too (on a shared
    machine, contention only ever adds time)."""
    steps = raw["step_s"][skip:]
    tokens = raw["completion_tokens"][skip:]
    rollout = raw["rollout_s"][skip:]
    split = all(x is not None for x in rollout)
    return {
        "side": side,
        **raw,
        "median_step_s": median(steps),
        "min_step_s": min(steps),
        "completion_tokens_per_s": median([n / s for n, s in zip(tokens, steps)]),
        "sampling_tokens_per_s": median([n / r for n, r in zip(tokens, rollout)])
        if split
        else None,
        "median_rollout_s": median(rollout) if split else None,
        "median_train_s": median([s - r for s, r in zip(steps, rollout)]) if split else None,
    }


def one_round(a: argparse.Namespace, mdir: Path, work: Path, env: dict[str, str]) -> list[Any]:
    data, reward = work / "prompts.jsonl", work / "rewards.py"
    out = work / f"ours-{time.time_ns()}"
    usage = child(ours_cmd(a, mdir, data, reward, out), env, work / "ours.log")
    ours = {**summarize("ours", ours_result(out, a.steps, a.prompts * a.generations), 1), **usage}
    result = work / "trl.json"
    keys = ("steps", "prompts", "generations", "max_tokens", "lr", "threads")
    argv = [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in keys]
    cmd = [sys.executable, __file__, *argv,
           "--worker", "trl", "--model", str(mdir), "--work", str(work), "--result", str(result)]  # fmt: skip
    usage = child(cmd, env, work / "trl.log")
    trl = {**summarize("trl", json.loads(result.read_text()), 1), **usage}
    return [ours, trl]


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def report(runs: list[dict[str, Any]], a: argparse.Namespace, note: str) -> dict[str, Any]:
    keys = [
        ("median_step_s", "s / step (median, steps 2..N)", ".3f"),
        ("min_step_s", "s / step (fastest of steps 2..N)", ".3f"),
        ("completion_tokens_per_s", "sampled completion tokens / step s", ".1f"),
        ("median_rollout_s", "  rollout s / step (sample+score)", ".3f"),
        ("sampling_tokens_per_s", "  completion tokens / rollout s", ".1f"),
        ("median_train_s", "  rest s / step (loss, backward, optim)", ".3f"),
        ("peak_rss_mib", "peak RSS MiB (whole process)", ".0f"),
        ("process_cpu_s", "CPU s of the whole process (incl. start)", ".0f"),
    ]
    ratios: dict[str, float | None] = {}
    print(f"\n== GRPO on CPU: shoestring vs TRL {_trl_version()} GRPOTrainer ==")
    print(f"{'':42s} {'ours':>10s} {'TRL':>10s} {'ours/TRL':>9s}")
    for key, label, spec in keys:
        o = median([r[key] for r in runs if r["side"] == "ours" and r[key] is not None])
        t = median([r[key] for r in runs if r["side"] == "trl" and r[key] is not None])
        ratios[key] = o / t if t == t and t else None
        print(f"{label:42s} {fmt(o, spec):>10s} {fmt(t, spec):>10s} {fmt(ratios[key], '.2f'):>9s}")
    print(
        f"(median over {a.rounds} round(s); {a.steps} steps, {a.prompts} prompts x "
        f"{a.generations} completions <= {a.max_tokens} tokens; threads {a.threads}; {note})"
    )
    return ratios


def _trl_version() -> str:
    from importlib.metadata import version

    return version("trl")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=1, help="ours, TRL pairs, alternating")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per optimizer step")
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-tokens", dest="max_tokens", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--sample-prompts",
        dest="sample_prompts",
        type=int,
        default=1,
        help="ours: grpo.sample_prompts (prompts whose groups one generate call samples)",
    )
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--json", type=Path, help="also write the raw results here")
    for hidden in ("--worker", "--model", "--work", "--result"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker == "trl":
        return run_trl(a)
    note = load_note()
    mdir = model_dir(a.cache, a.hidden, a.layers)  # built once, outside any timing
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), TOKENIZERS_PARALLELISM="false",
               TRANSFORMERS_VERBOSITY="error", PYTHONPATH=str(ROOT / "src"))  # fmt: skip
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="grpo-vs-trl-") as tmp:
        write_inputs(Path(tmp), 32)
        for rnd in range(a.rounds):
            for r in one_round(a, mdir, Path(tmp), env):
                r["round"] = rnd + 1
                runs.append(r)
                print(
                    f"round {rnd + 1} {r['side']:4s}: {r['median_step_s']:.3f} s/step, "
                    f"{r['completion_tokens_per_s']:.1f} completion tokens/s, "
                    f"peak RSS {r['peak_rss_mib']:.0f} MiB, process {r['process_s']:.0f} s "
                    f"({r['process_cpu_s']:.0f} CPU s)",
                    flush=True,
                )
    note = f"start: {note}; end: {load_note()}"
    ratios = report(runs, a, note)
    if a.json:
        meta = {"machine": note, "model": str(mdir.name), "trl": _trl_version(), "args": vars(a)}
        doc = {"runs": runs, "ratios_ours_over_trl": ratios, **meta}
        a.json.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
