"""Settings search for the built-in LoRA demo (builtin:tiny + builtin:reverse).

A stand-alone mimic of the shoestring trainer: peft LoRA on "all-linear",
AdamW, linear warm-up then cosine decay to 0.1x peak, grad-norm clip 1.0, loss on
completion tokens + EOS only, right padding, batches from a seeded permutation.
BOS is prepended to every prompt, as the trainer does. Eval is greedy exact match
on the held-out split: before/after with ``model.generate`` on prompts grouped
by length (batch 32, max_new_tokens 32, as the trainer's defaults), periodic
evals with a cache-free greedy loop.

Recorded run (2 CPU cores, torch 2.13 CPU):

    .venv/bin/python benchmarks/builtin_task_search.py --lr 2e-3 --bs 16 \
        --warmup 30 --steps 1000 --max_length 64 --r 16 --alpha 32 --eval_every 250

Model knobs (--hidden, --layers, --head_std, ...) patch the builtin module's
generating parameters before the model is materialized into --cache.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from shoestring.train import builtin as B  # noqa: E402

p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
)
p.add_argument("--hidden", type=int, default=None)
p.add_argument("--inter", type=int, default=None)
p.add_argument("--layers", type=int, default=None)
p.add_argument("--heads", type=int, default=None)
p.add_argument("--init", type=float, default=None, help="initializer_range")
p.add_argument("--head_std", type=float, default=None, help="std of the re-drawn lm_head")
p.add_argument("--letters", default=None)
p.add_argument("--minlen", type=int, default=None)
p.add_argument("--maxlen", type=int, default=None)
p.add_argument("--r", type=int, default=16)
p.add_argument("--alpha", type=float, default=32)
p.add_argument("--lr", type=float, default=2e-3)
p.add_argument("--bs", type=int, default=16)
p.add_argument("--accum", type=int, default=1)
p.add_argument("--warmup", type=int, default=30)
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--max_length", type=int, default=64)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--eval_every", type=int, default=0)
p.add_argument("--log", type=int, default=50)
p.add_argument(
    "--full",
    type=int,
    default=0,
    help="1: full fine-tune instead of LoRA; 2: full but embeddings/head frozen",
)
p.add_argument("--cache", default="/tmp/builtin_cache")
a = p.parse_args()

for k, name in [
    ("hidden", "hidden_size"),
    ("inter", "intermediate_size"),
    ("layers", "num_hidden_layers"),
    ("heads", "num_attention_heads"),
    ("init", "initializer_range"),
]:
    v = getattr(a, k)
    if v is not None:
        B.MODEL_PARAMS[name] = v
        if k == "heads":
            B.MODEL_PARAMS["num_key_value_heads"] = v
if a.head_std is not None:
    B._LM_HEAD_STD = a.head_std
if a.letters:
    B._LETTERS = a.letters
if a.minlen:
    B._MIN_LEN = a.minlen
if a.maxlen:
    B._MAX_LEN = a.maxlen
torch.set_num_threads(a.threads)

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

t = time.time()
mdir = B.materialize_tiny_model(Path(a.cache))
print(f"model dir {mdir} ({time.time() - t:.1f}s)", flush=True)
tok = AutoTokenizer.from_pretrained(mdir)
model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32)
torch.manual_seed(a.seed)
if a.full:
    if a.full == 2:
        model.model.embed_tokens.weight.requires_grad_(False)
        model.lm_head.weight.requires_grad_(False)
else:
    model = get_peft_model(
        model,
        LoraConfig(
            r=a.r,
            lora_alpha=a.alpha,
            lora_dropout=0.05,
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        ),
    )
eos, pad = tok.eos_token_id, tok.pad_token_id
train = B.builtin_records("train")
evalr = B.builtin_records("eval")


BOS = [tok.bos_token_id]  # the trainer prepends BOS to every prompt


def encode(r: dict[str, str]) -> tuple[list[int], list[int]]:
    pi = BOS + tok(r["prompt"], add_special_tokens=False)["input_ids"]
    ci = tok(r["completion"], add_special_tokens=False)["input_ids"] + [eos]
    return (pi + ci)[: a.max_length], ([-100] * len(pi) + ci)[: a.max_length]


enc = [encode(r) for r in train]


def batch(idx: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = max(len(enc[i][0]) for i in idx)
    ids = torch.full((len(idx), n), pad)
    lab = torch.full((len(idx), n), -100)
    att = torch.zeros((len(idx), n), dtype=torch.long)
    for j, i in enumerate(idx):
        x, y = enc[i]
        ids[j, : len(x)], lab[j, : len(y)], att[j, : len(x)] = torch.tensor(x), torch.tensor(y), 1
    return ids, lab, att


@torch.no_grad()
def em_loop(recs: list[dict[str, str]]) -> float:
    """Greedy decode without KV cache, grouped by prompt length (no padding)."""
    model.eval()
    groups: dict[int, list] = {}
    for r in recs:
        pi = BOS + tok(r["prompt"], add_special_tokens=False)["input_ids"]
        groups.setdefault(len(pi), []).append((pi, r["completion"]))
    hits = 0
    for items in groups.values():
        x = torch.tensor([pi for pi, _ in items])
        out, done = [], torch.zeros(len(items), dtype=torch.bool)
        for _ in range(max(len(c) for _, c in items) + 2):
            nxt = model(input_ids=x).logits[:, -1].argmax(-1)
            out.append(nxt)
            done |= nxt == eos
            x = torch.cat([x, nxt[:, None]], 1)
            if done.all():
                break
        for g, (_, c) in zip(torch.stack(out, 1).tolist(), items):
            hits += eos in g and tok.decode(g[: g.index(eos)]) == c
    model.train()
    return hits / len(recs)


@torch.no_grad()
def em_generate(recs: list[dict[str, str]], bs: int = 32, max_new: int = 32) -> float:
    """Trainer-like: prompts grouped by length (no padding), model.generate, greedy."""
    model.eval()
    groups: dict[int, list] = {}
    for r in recs:
        pi = BOS + tok(r["prompt"], add_special_tokens=False)["input_ids"]
        groups.setdefault(len(pi), []).append((pi, r["completion"]))
    hits = 0
    for _, items in sorted(groups.items()):
        for s in range(0, len(items), bs):
            chunk = items[s : s + bs]
            ids = torch.tensor([pi for pi, _ in chunk])
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                do_sample=False,
                use_cache=True,
                pad_token_id=pad,
                eos_token_id=eos,
            )
            for o, (_, want) in zip(out[:, ids.size(1) :].tolist(), chunk):
                o = o[: o.index(eos)] if eos in o else o
                hits += tok.decode(o, skip_special_tokens=True) == want
    model.train()
    return hits / len(recs)


t = time.time()
em0 = em_generate(evalr)
eval0_s = time.time() - t
print(f"before: exact_match={em0:.3f} (generate eval {eval0_s:.2f}s)", flush=True)
params = [q for q in model.parameters() if q.requires_grad]
opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0)


def lr_at(step: int) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    prog = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog)))


g = torch.Generator().manual_seed(a.seed)
perm: list[int] = []
model.train()
hist: list[float] = []
accs: list[float] = []
curve: dict[int, float] = {}
t0, c0 = time.time(), time.process_time()
for step in range(a.steps):
    for group in opt.param_groups:
        group["lr"] = lr_at(step)
    tot = 0.0
    for _ in range(a.accum):
        if len(perm) < a.bs:
            perm += torch.randperm(len(enc), generator=g).tolist()
        idx, perm = perm[: a.bs], perm[a.bs :]
        ids, lab, att = batch(idx)
        out = model(input_ids=ids, attention_mask=att, labels=lab)
        (out.loss / a.accum).backward()
        tot += out.loss.item() / a.accum
        with torch.no_grad():  # teacher-forced accuracy on completion letters
            pr, lb = out.logits[:, :-1].argmax(-1), lab[:, 1:]
            m = (lb >= 0) & (lb != eos)
            accs.append(((pr == lb) & m).sum().item() / max(1, m.sum().item()))
    gn = torch.nn.utils.clip_grad_norm_(params, 1.0).item()
    opt.step()
    opt.zero_grad(set_to_none=True)
    hist.append(tot)
    if (step + 1) % a.log == 0:
        print(
            f"step {step + 1} loss {sum(hist[-a.log :]) / a.log:.3f} "
            f"tokacc {sum(accs[-a.log :]) / len(accs[-a.log :]):.3f} gn {gn:.2f} "
            f"t={time.time() - t0:.1f}",
            flush=True,
        )
    if a.eval_every and (step + 1) % a.eval_every == 0 and step + 1 < a.steps:
        te = time.time()
        curve[step + 1] = em_loop(evalr)
        print(
            f"  exact_match@{step + 1} = {curve[step + 1]:.3f} ({time.time() - te:.1f}s)",
            flush=True,
        )
        t0 += time.time() - te  # eval time is not train time
train_s, cpu_s = time.time() - t0, time.process_time() - c0
t = time.time()
em1 = em_generate(evalr)
eval1_s = time.time() - t
curve[a.steps] = em1
res = dict(
    vars(a),
    em_before=em0,
    em_after=em1,
    curve=curve,
    train_s=round(train_s, 1),
    train_cpu_s=round(cpu_s, 1),
    eval_before_s=round(eval0_s, 2),
    eval_after_s=round(eval1_s, 2),
    final_loss=round(sum(hist[-50:]) / 50, 4),
    train_em_200=em_generate(train[:200]),
)
print("RESULT", json.dumps(res), flush=True)
