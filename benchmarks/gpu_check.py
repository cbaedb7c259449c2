"""The one-call GPU device check: every claim that only a GPU can settle, in one short run.

Checks (each isolated: a check that raises is recorded as ``fail`` with the error and the
next one runs; every subprocess has a timeout; each check has a time budget and the whole
run a global one, after which the remaining checks are ``not_run``):

In priority order (issue #26, v2), within 8 minutes on one H100/H200:

* ``promise_16gb`` (a): QLoRA at Llama-3-8B and Llama-2-7B shapes (random init streamed
  to safetensors shards here by ``realshape.py``, no download), seq 2048, micro-batch 1,
  nf4, paged AdamW 8-bit, gradient checkpointing, the finetune process capped to a T4's
  usable 15 GiB (``torch.cuda.set_per_process_memory_fraction``): fits (no OOM) and trains;
  tokens/s; ``max_memory_allocated`` vs ``shoestring plan`` for that config (out of sample);
  the 8B once in bf16 and once in fp16 with the gradient scaler (the T4 path). On CPU the
  same code path trains the tiny model in nf4; the real shapes are ``not_run``.
* ``peer_hf`` (b): ours vs Hugging Face Trainer + PEFT (+ bitsandbytes) through
  ``hf_baseline.py`` on the same model (the 0.86B Llama in QLoRA on CUDA, the tiny one on
  CPU), the same tokenized examples in the same order, batch, precision, sequence, LoRA,
  optimizer and schedule: tokens/s and peak-memory ratios (ours / theirs), and the loss
  curves within ``hf_baseline.TOLERANCE``; then ours with ``train.kernels liger``
  (liger-kernel installed from ``--wheelhouse`` if need be, else ``not_run``) and with
  ``train.compile true`` (its ``compile`` seconds apart), against ours without them.
* ``infer`` (c): ``infer_cuda.py``'s checks (exactness vs transformers, streaming rate vs a
  pinned host-to-device copy, int8/nf4, answers held to a JSON Schema on the device, a
  bitsandbytes 4-bit checkpoint streamed as stored), run
  by calling its ``run()`` in a child process.
* ``checkpoint_blocking`` (d): periodic saves' ``blocking_ms`` vs the median ``step_ms``
  of a 0.86B LoRA run saving every 5 steps (CUDA), or of the runs so far (CPU); and what
  the blocking is made of (``ckpt_parts.py``: capture, the per-tensor copy-out, the
  coalesced copy that would replace it, the bus floor).
* ``sigkill_resume``: with ``train.deterministic``, N steps straight vs a SIGKILL right
  after the first checkpoint is committed, while the training thread is on a later step
  (``SHOESTRING_FAULTS=ckpt.after_rename@1:kill``: a kill at a step's end could land
  before a slow save committed, and the rerun would start over) and a rerun that
  resumes: the final adapters' sha256 must be equal; records the ``resume`` event's
  ``steps_lost``.
* ``nvml``: a finetune under ``shoestring run --metrics-interval 1``: a ``metrics`` event
  must carry per-GPU fields (NVML).
* ``distributed``: 2-process DDP and FSDP2 through ``shoestring run --nproc-per-node 2``
  (needs 2 GPUs).
* ``fsdp_qlora`` (e), last (it runs only if time is left): ``distributed.strategy fsdp``
  in one process (FSDP2 over a mesh of one) on the 0.86B Llama in nf4 (the tiny model on
  CPU), deterministic, AdamW: without and with ``distributed.cpu_offload`` (refused on
  CPU: ``not_run``), tokens/s and ``max_memory_allocated`` against ``shoestring plan
  --strategy fsdp --world-size 1 [--cpu-offload]`` (the prediction is recorded on CPU
  too); the losses against the same config in one plain process (``FSDP_LOSS_RTOL``);
  and the FSDP run SIGKILLed at ``ckpt.after_rename@1`` and rerun: resumed, final adapter
  byte-identical (not with ``--small``: CI time).

A status is ``pass`` (ran, and its functional assertions held: exit codes, equal hashes,
identical greedy tokens), ``fail`` (with ``reason``), ``skipped`` (not applicable here,
with ``reason``) or ``not_run`` (with ``reason``). Performance targets from
benchmarks/README.md are reported as ``target`` / ``target_met`` next to the numbers,
not as statuses. A number that was not measured is left out, never filled in.
On CPU (``--device cpu``) bf16 runs become fp32 (the JSON says so) and there is no
``max_memory_allocated``, so the memory comparisons are ``not_run``.

Writes benchmarks/results/gpu-check-<date>.json (or ``--out FILE``) and prints it.
Exit code 0 if no check failed, 1 otherwise.

Usage (GPU box, one call, at most 8 minutes; benchmarks/README.md "GPU check" has the
exact device command, with the liger-kernel wheel carried):
  python benchmarks/gpu_check.py --wheelhouse wheelhouse --out $OUT/gpu-check.json
Smoke test (CPU, CI; about 2 minutes on 2 busy cores, as v1):
  .venv/bin/python benchmarks/gpu_check.py --device cpu --small
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PY = sys.executable
#: Planner accuracy target (benchmarks/README.md, plan_vs_cuda row): within 5 %, never
#: under the measurement by more than 3 %.
PLAN_TARGET = (-3.0, 5.0)
#: Checkpoint blocking target (benchmarks/README.md, ckpt_blocking row): < 5 % of a step.
BLOCKING_TARGET = 0.05
#: name -> per-check time budget in seconds (CUDA, CPU). The CPU ones are caps for a
#: busy 2-core CI box; the smoke run itself takes well under a minute on a quiet one.
#: In priority order (the most valuable first): what the global budget cuts is the tail.
BUDGETS: dict[str, tuple[float, float]] = {
    "promise_16gb": (210, 90),
    "peer_hf": (130, 150),
    "infer": (60, 90),
    "checkpoint_blocking": (45, 30),
    "sigkill_resume": (40, 120),
    "nvml": (20, 10),
    "distributed": (10, 10),
    "fsdp_qlora": (90, 90),
}
#: A T4's usable memory: the (a) runs are capped to it with set_per_process_memory_fraction.
T4_USABLE_BYTES = 15 * 2**30


class CheckError(Exception):
    """A check could not measure what it is for (its message becomes the reason)."""


@dataclass
class Ctx:
    """What every check needs: device, shapes, a scratch dir, the child environment."""

    device: str
    small: bool
    work: Path
    probe: dict[str, Any]
    global_deadline: float
    deadline: float = 0.0  # the running check's
    runs: dict[str, Path] = field(default_factory=dict)  # finished finetune output dirs
    big_model: Path | None = None
    big_model_error: str = ""  # a failed build is not retried by the next check
    wheelhouse: Path | None = None  # local wheels (liger-kernel) for a machine offline

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def remaining(self) -> float:
        left = min(self.deadline, self.global_deadline) - time.monotonic()
        if left <= 1:
            raise CheckError("time budget spent")
        return left

    def cut_status(self, e: CheckError) -> str:
        """``not_run`` when the budget stopped it (a timeout at the budget's end), else
        ``fail``: a run that was still going when the time ran out did not fail."""
        left = min(self.deadline, self.global_deadline) - time.monotonic()
        return "not_run" if "budget" in str(e) or left <= 2 else "fail"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SHOESTRING_")}
        env.update(
            SHOESTRING_CACHE=str(self.work / "cache"),
            TOKENIZERS_PARALLELISM="false",
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")])),
        )
        if not self.cuda:  # bitsandbytes' CPU ops would load inductor in every process
            env.setdefault("TORCHDYNAMO_DISABLE", "1")
        env.update(extra)
        return env


# --------------------------------------------------------------------------- processes


#: Children still running: their process groups are killed if this script stops early.
LIVE: set[subprocess.Popen[bytes]] = set()


def start_proc(
    ctx: Ctx, cmd: list[str], log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in its own session (so a timeout can kill its children too)."""
    with open(log, "ab") as f:
        p = subprocess.Popen(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env or ctx.env(),
            start_new_session=True,
        )
    LIVE.add(p)
    return p


def kill_group(p: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()
    LIVE.discard(p)


def wait_proc(ctx: Ctx, p: subprocess.Popen[bytes], log: Path, cap: float) -> int:
    """Its exit code; past ``cap`` or the check's budget the whole group is killed."""
    try:
        timeout = min(cap, ctx.remaining())
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(p)
        raise CheckError(
            f"timed out after {timeout:.0f} s: {str(p.args)[:300]}; log tail: {tail(log)}"
        ) from None
    except CheckError:  # no budget left to wait at all
        kill_group(p)
        raise
    LIVE.discard(p)
    return rc


def run_proc(
    ctx: Ctx, cmd: list[str], log: Path, cap: float, env: dict[str, str] | None = None
) -> int:
    return wait_proc(ctx, start_proc(ctx, cmd, log, env), log, cap)


def tail(log: Path, n: int = 1500) -> str:
    try:
        return log.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def run_python(ctx: Ctx, code: str, log: Path, cap: float) -> None:
    """Run a snippet with benchmarks/ and src/ importable; raise if it fails."""
    pre = f"import sys; sys.path[:0] = [{str(BENCH)!r}, {str(ROOT / 'src')!r}]\n"
    rc = run_proc(ctx, [PY, "-c", pre + code], log, cap)
    if rc != 0:
        raise CheckError(f"python snippet exited {rc}: {tail(log)}")


def probe(device: str) -> dict[str, Any]:
    """torch / CUDA / NVML facts from a child process (this one never touches CUDA)."""
    code = (
        "import json, torch\n"
        "d = {'torch': torch.__version__, 'cuda': torch.version.cuda,\n"
        "     'cuda_available': torch.cuda.is_available(),\n"
        "     'device_count': torch.cuda.device_count() if torch.cuda.is_available() else 0}\n"
        f"if {device == 'cuda'} and d['cuda_available']:\n"
        "    d['device_name'] = torch.cuda.get_device_name(0)\n"
        "    d['total_memory'] = torch.cuda.get_device_properties(0).total_memory\n"
        "try:\n    import pynvml; d['pynvml'] = True\n"
        "except ImportError:\n    d['pynvml'] = False\n"
        "print(json.dumps(d))\n"
    )
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise SystemExit(f"gpu_check: cannot import torch: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def git_facts() -> dict[str, Any]:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return {"git_commit": None}
    if head.returncode != 0:
        return {"git_commit": None}
    return {"git_commit": head.stdout.strip(), "git_dirty": bool(dirty.stdout.strip())}


# --------------------------------------------------------------------------- events


def read_events(out: Path) -> list[dict[str, Any]]:
    p = out / "events.jsonl"
    recs: list[dict[str, Any]] = []
    if p.exists():
        for line in p.read_text(errors="replace").splitlines():
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut by SIGKILL
    return recs


def of_kind(events: list[dict[str, Any]], kind: str, rank: int | None = 0) -> list[dict[str, Any]]:
    return [
        e for e in events if e.get("event") == kind and (rank is None or e.get("rank", 0) == rank)
    ]


def steady_steps(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rank 0's ``step`` events less the first 2 of each attempt (warm-up, lazy init)."""
    out: list[dict[str, Any]] = []
    seen = 0
    for e in events:
        if e.get("event") == "run_start" and e.get("rank", 0) == 0:
            seen = 0
        elif e.get("event") == "step" and e.get("rank", 0) == 0:
            seen += 1
            if seen > 2:
                out.append(e)
    return out


def step_figures(events: list[dict[str, Any]]) -> dict[str, Any]:
    """tokens/s and step_ms medians over the steps after the first 2; CUDA peak if emitted."""
    steps = of_kind(events, "step")
    later = steady_steps(events)
    if not later:
        raise CheckError(f"only {len(steps)} step events: nothing to measure after the first 2")
    res: dict[str, Any] = {
        "steps": len(steps),
        "steps_measured": len(later),
        "tokens_per_s": statistics.median(e["tokens_per_s"] for e in later),
        "step_ms": statistics.median(e["step_ms"] for e in later),
    }
    peaks = [e["cuda_peak_bytes"] for e in steps if e.get("cuda_peak_bytes") is not None]
    if peaks:
        res["cuda_peak_bytes"] = max(peaks)
    return res


def as_run(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What the trainer says it ran with (first ``run_start``): device, precision, dtype."""
    starts = of_kind(events, "run_start")
    keys = (
        "device",
        "train_device",
        "precision",
        "dtype",
        "deterministic",
        "attn_implementation",
        "world_size",
        "strategy",
    )
    return {k: starts[0][k] for k in keys if starts and k in starts[0]}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------- finetune runs


@dataclass(frozen=True)
class Shape:
    """One finetune workload: model and batch geometry."""

    model: str
    steps: int
    batch: int
    seq: int
    every: int
    packing: bool = False


def tiny_shape(ctx: Ctx) -> Shape:
    if ctx.small:
        return Shape("builtin:tiny", steps=8, batch=4, seq=32, every=3)
    return Shape("builtin:tiny", steps=30, batch=16, seq=64, every=10)


def big_shape(ctx: Ctx, model: Path) -> Shape:
    if ctx.cuda:
        return Shape(str(model), steps=20, batch=8, seq=1024, every=10, packing=True)
    return Shape(str(model), steps=5, batch=2, seq=128, every=4, packing=True)


def precision(ctx: Ctx) -> dict[str, str]:
    if ctx.cuda:
        return {"requested": "bf16", "used": "bf16", "model_dtype": "bfloat16"}
    return {
        "requested": "bf16",
        "used": "fp32",
        "model_dtype": "float32",
        "note": "no CUDA: bf16 runs become fp32 on CPU",
    }


def finetune_config(
    ctx: Ctx,
    shape: Shape,
    quantize: str = "none",
    optimizer: str = "adamw",
    deterministic: bool = False,
) -> dict[str, Any]:
    """The YAML both ``shoestring finetune`` and ``shoestring plan`` read."""
    prec = precision(ctx)
    train: dict[str, Any] = {
        "max_steps": shape.steps,
        "batch_size": shape.batch,
        "warmup_steps": 2,
        "optimizer": optimizer,
        "device": ctx.device,
        "precision": "bf16" if prec["used"] == "bf16" else "fp32",
        "deterministic": deterministic,
    }
    if not ctx.cuda:  # OpenMP collapses with 2 threads on 2 busy cores (benchmarks/README.md)
        train["num_threads"] = 1
    return {
        "model": {"path": shape.model, "dtype": prec["model_dtype"]},
        "data": {"max_length": shape.seq, "eval": "", "packing": shape.packing},
        "train": train,
        "eval": {"every_steps": 0},
        "lora": {"quantize": quantize},
        "checkpoint": {"every_steps": shape.every, "keep": 2},
        "preempt": {"cloud": "none"},
    }


def write_config(ctx: Ctx, name: str, cfg: dict[str, Any]) -> Path:
    import yaml

    path = ctx.work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def finetune_cmd(cfg_path: Path, out: Path) -> list[str]:
    return [PY, "-m", "shoestring", "finetune", "--config", str(cfg_path), "--output_dir", str(out)]


def finetune(
    ctx: Ctx,
    name: str,
    cfg_path: Path,
    cap: float,
    out: Path | None = None,
    env: dict[str, str] | None = None,
) -> tuple[int, Path]:
    """``python -m shoestring finetune --config CFG --output_dir OUT``: (exit code, OUT)."""
    out = out or ctx.work / name
    return run_proc(ctx, finetune_cmd(cfg_path, out), ctx.work / f"{name}.log", cap, env), out


Job = tuple[list[str], Path, dict[str, str]]


def run_jobs(ctx: Ctx, jobs: list[Job], parallel: bool, cap: float = 120) -> list[int]:
    """Commands side by side or one after the other: their exit codes. When one cannot
    be waited for (its timeout, the budget), the others still running are killed."""
    if not parallel:
        return [run_proc(ctx, *job[:2], cap, job[2]) for job in jobs]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs += [start_proc(ctx, *job) for job in jobs]
        return [wait_proc(ctx, p, job[1], cap) for p, job in zip(procs, jobs, strict=True)]
    finally:
        for p in procs:
            if p in LIVE:
                kill_group(p)


def run_pair(ctx: Ctx, a: Job, b: Job, parallel: bool, cap: float = 120) -> tuple[int, int]:
    """Two commands, side by side or one after the other: their exit codes."""
    ra, rb = run_jobs(ctx, [a, b], parallel, cap)
    return ra, rb


def plan_job(ctx: Ctx, name: str, cfg_path: Path, *flags: str) -> Job:
    """``shoestring plan --config CFG --json [FLAGS]`` for an H200, its log ``NAME-plan.json``."""
    cmd = [PY, "-m", "shoestring", "plan", "--config", str(cfg_path), "--json", "--gpu", "H200"]
    return [*cmd, *flags], ctx.work / f"{name}-plan.json", ctx.env()


def read_plan(log: Path, rc: int) -> dict[str, Any]:
    """A plan job's peak, breakdown and host bytes (``plan`` exits 1 on no fit)."""
    if rc not in (0, 1):
        raise CheckError(f"shoestring plan exited {rc}: {tail(log)}")
    text = log.read_text()
    plan = json.loads(text[text.index("{") :])
    return {
        "peak_bytes": plan["peak_bytes"],
        "breakdown": plan["breakdown"],
        "host_bytes": plan.get("host_bytes") or {},
        "workload_device": plan["workload"].get("device"),
    }


def plan_peak(ctx: Ctx, name: str, cfg_path: Path) -> dict[str, Any]:
    """``shoestring plan --config CFG --json``: its peak and breakdown."""
    cmd, log, env = plan_job(ctx, name, cfg_path)
    return read_plan(log, run_proc(ctx, cmd, log, 120, env))


#: A CUDA run whose step events have no ``max_memory_allocated``.
NO_PEAK = {
    "status": "fail",
    "reason": "step events carry no cuda_peak_bytes "
    "(the trainer must emit torch.cuda.max_memory_allocated on CUDA)",
}


def memory_vs_plan(ctx: Ctx, name: str, cfg_path: Path, figures: dict[str, Any]) -> dict[str, Any]:
    """Measured ``cuda_peak_bytes`` vs the planner's allocated peak (no context, no fragmentation)."""
    if not ctx.cuda:
        return {"status": "not_run", "reason": "no CUDA"}
    if "cuda_peak_bytes" not in figures:
        return dict(NO_PEAK)
    return measured_vs_plan(plan_peak(ctx, name, cfg_path), figures["cuda_peak_bytes"])


def measured_vs_plan(plan: dict[str, Any], measured: int) -> dict[str, Any]:
    """``max_memory_allocated`` vs a plan's allocated terms: error, ratio, target."""
    from plan_vs_cuda import peak_error

    if plan["workload_device"] != "cuda":
        return {
            "status": "fail",
            "reason": f"the planner planned for device {plan['workload_device']!r}, not cuda",
            "plan_peak_bytes": plan["peak_bytes"],
        }
    res: dict[str, Any] = {
        "status": "pass",
        "measured_max_allocated": measured,
        "plan_peak_bytes": plan["peak_bytes"],
        "plan_breakdown": plan["breakdown"],
    }
    res.update(peak_error(plan["breakdown"], measured))
    res["measured_over_predicted"] = measured / res["peak_predicted_allocated"]
    res["target"] = f"error in [{PLAN_TARGET[0]:+.0f} %, {PLAN_TARGET[1]:+.0f} %]"
    res["target_met"] = PLAN_TARGET[0] <= res["peak_err_pct"] <= PLAN_TARGET[1]
    return res


def train_run(ctx: Ctx, name: str, shape: Shape, cap: float, **cfg_kw: Any) -> dict[str, Any]:
    """One finetune run and its figures; ``status`` fail on a non-zero exit."""
    cfg_path = write_config(ctx, name, finetune_config(ctx, shape, **cfg_kw))
    rc, out = finetune(ctx, name, cfg_path, cap)
    res: dict[str, Any] = {
        "model": shape.model if shape.model.startswith("builtin:") else "llama-1b-random",
        "exit_code": rc,
        "batch": shape.batch,
        "seq": shape.seq,
        "packing": shape.packing,
    }
    if rc != 0:
        return {
            **res,
            "status": "fail",
            "reason": f"finetune exited {rc}: {tail(ctx.work / f'{name}.log')}",
        }
    ctx.runs[name] = out
    events = read_events(out)
    res["as_run"] = as_run(events)
    res.update(step_figures(events))
    res["memory"] = memory_vs_plan(ctx, name, cfg_path, res)
    want = precision(ctx)["used"]
    if res["as_run"].get("precision", want) != want:
        return {
            **res,
            "status": "fail",
            "reason": f"asked for {want}, the trainer ran {res['as_run']['precision']}",
        }
    failed = res["memory"]["status"] == "fail"
    return {
        **res,
        "status": "fail" if failed else "pass",
        **({"reason": "memory: " + res["memory"]["reason"]} if failed else {}),
    }


# --------------------------------------------------------------------------- the ~1B model


def build_llama(target: Path, device: str, dtype: str) -> None:
    """A random-init ~0.86B Llama (GQA 16/4 heads, widths multiples of 64, vocab 32000) with
    the built-in byte tokenizer, saved like a real checkpoint. Run in a child process."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shoestring.train.builtin import SPECIAL_TOKENS, build_tokenizer

    tok = build_tokenizer()
    pad, bos, eos = tok.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        pad_token_id=pad,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(target, safe_serialization=True)
    tok.save_pretrained(target)


def ensure_big_model(ctx: Ctx) -> Path:
    if ctx.big_model_error:
        raise CheckError(f"~1B model build failed earlier: {ctx.big_model_error[:500]}")
    if ctx.big_model is None:
        target = ctx.work / "llama-1b"
        dtype = precision(ctx)["model_dtype"]
        try:
            run_python(
                ctx,
                f"import gpu_check; from pathlib import Path\n"
                f"gpu_check.build_llama(Path({str(target)!r}), {ctx.device!r}, "
                f"{dtype!r})",
                ctx.work / "build-llama.log",
                180,
            )
        except CheckError as e:
            ctx.big_model_error = str(e)
            raise
        ctx.big_model = target
    return ctx.big_model


# --------------------------------------------------------------------------- checks


def resume_plan(ctx: Ctx) -> Shape:
    """The deterministic run (SIGKILLed once its first checkpoint is committed)."""
    if ctx.small:
        return Shape("builtin:tiny", steps=8, batch=4, seq=32, every=3)
    return Shape("builtin:tiny", steps=20, batch=16, seq=64, every=5)


#: Where the SIGKILL lands: right after the first checkpoint is committed, while the
#: training thread is on a later step (a kill at a step's end could land before a slow
#: async save committed, and the rerun would start over: commit bb58d85).
KILL_FAULT = "ckpt.after_rename@1:kill"


def deterministic_env(ctx: Ctx) -> dict[str, str]:
    """What ``train.deterministic`` needs from the environment (cuBLAS, on CUDA)."""
    return {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"} if ctx.cuda else {}


def killed_job(ctx: Ctx, name: str, cfg: Path) -> Job:
    """``cfg`` run into work/NAME, SIGKILLed at :data:`KILL_FAULT`."""
    env = ctx.env(SHOESTRING_FAULTS=KILL_FAULT, **deterministic_env(ctx))
    return finetune_cmd(cfg, ctx.work / name), ctx.work / f"{name}.log", env


def resume_killed(ctx: Ctx, name: str, cfg: Path, rc_kill: int, ref: Path) -> dict[str, Any]:
    """Rerun the :func:`killed_job` NAME: it must resume and end on ``ref``'s final
    adapter, byte for byte; records the ``resume`` event's ``steps_lost``."""
    out = ctx.work / name
    rc_resume, _ = finetune(ctx, name, cfg, 120, out=out, env=ctx.env(**deterministic_env(ctx)))
    ctx.runs[name] = out
    resumes = of_kind(read_events(out), "resume")
    res: dict[str, Any] = {
        "fault": KILL_FAULT,
        "killed_exit_code": rc_kill,
        "resume_exit_code": rc_resume,
        "resumed": bool(resumes),
    }
    if resumes:
        res.update(from_step=resumes[-1].get("from_step"), steps_lost=resumes[-1].get("steps_lost"))
    res.update(compare_adapters(ref, out))
    return {**res, **verdict_resume(res, rc_kill, rc_resume)}


def check_sigkill_resume(ctx: Ctx) -> dict[str, Any]:
    shape = resume_plan(ctx)
    cfg = write_config(ctx, "resume", finetune_config(ctx, shape, deterministic=True))
    ref = ctx.work / "resume-ref"
    # On CPU the uninterrupted and the faulted run share the cores (1 thread each); on a
    # GPU they run one after the other, so their checkpoint timings stay clean.
    rc_ref, rc_kill = run_pair(
        ctx,
        (finetune_cmd(cfg, ref), ctx.work / "resume-ref.log", ctx.env(**deterministic_env(ctx))),
        killed_job(ctx, "resume-kill", cfg),
        parallel=not ctx.cuda,
    )
    if rc_ref != 0:
        raise CheckError(f"uninterrupted run exited {rc_ref}: {tail(ctx.work / 'resume-ref.log')}")
    ctx.runs["resume-ref"] = ref
    res: dict[str, Any] = {
        "steps": shape.steps,
        "checkpoint_every": shape.every,
        "as_run": as_run(read_events(ref)),
        **resume_killed(ctx, "resume-kill", cfg, rc_kill, ref),
    }
    try:  # the cost of train.deterministic: compare with lora_bf16's builtin run (same batch)
        res["uninterrupted_figures"] = step_figures(read_events(ref))
    except CheckError as e:
        res["uninterrupted_figures"] = {"not_measured": str(e)}
    return res


def compare_adapters(ref: Path, out: Path) -> dict[str, Any]:
    name = "final/adapter_model.safetensors"
    if not (ref / name).is_file() or not (out / name).is_file():
        return {"sha256_equal": False}
    a, b = sha256(ref / name), sha256(out / name)
    return {"sha256_uninterrupted": a, "sha256_resumed": b, "sha256_equal": a == b}


def verdict_resume(res: dict[str, Any], rc_kill: int, rc_resume: int) -> dict[str, Any]:
    problems = []
    if rc_kill != -signal.SIGKILL:
        problems.append(f"faulted run exited {rc_kill}, not by SIGKILL")
    if rc_resume != 0:
        problems.append(f"rerun exited {rc_resume}")
    if not res["resumed"]:
        problems.append("no resume event in events.jsonl")
    if not res.get("sha256_equal"):
        problems.append("final adapters differ (or are missing)")
    return {"status": "fail", "reason": "; ".join(problems)} if problems else {"status": "pass"}


def blocking_of(out: Path) -> dict[str, Any] | None:
    """Periodic saves' ``blocking_ms`` vs the median steady ``step_ms`` (final save apart)."""
    events = read_events(out)
    ck = [e for e in of_kind(events, "checkpoint") if e.get("blocking_ms") is not None]
    periodic = [
        float(e["blocking_ms"]) for e in ck if e.get("reason") not in ("final", "emergency")
    ]
    steps = [e["step_ms"] for e in steady_steps(events) if e.get("step_ms") is not None]
    if not periodic or not steps:
        return None
    step_ms = statistics.median(steps)
    ratio = statistics.median(periodic) / step_ms
    res: dict[str, Any] = {
        "periodic_checkpoints": len(periodic),
        "blocking_ms_median": statistics.median(periodic),
        "blocking_ms_max": max(periodic),
        "step_ms_median": step_ms,
        "ratio_median": ratio,
        "ratio_max": max(periodic) / step_ms,
        "target_met": ratio < BLOCKING_TARGET,
        # the first save also allocates the pinned host buffers the later ones reuse
        "blocking_ms_first": periodic[0],
    }
    if len(periodic) > 1:
        res["blocking_ms_after_first_median"] = statistics.median(periodic[1:])
    final = [float(e["blocking_ms"]) for e in ck if e.get("reason") == "final"]
    if final:
        res["final_blocking_ms"] = final[-1]
    return res


def check_distributed(ctx: Ctx) -> dict[str, Any]:
    if not ctx.cuda:
        return {"status": "skipped", "reason": "no CUDA"}
    if ctx.probe.get("device_count", 0) < 2:
        return {"status": "skipped", "reason": "1 GPU"}
    cfg = write_config(ctx, "dist", finetune_config(ctx, tiny_shape(ctx)))
    res: dict[str, Any] = {}
    for strategy in ("ddp", "fsdp"):
        res[strategy] = distributed_run(ctx, strategy, cfg)
    bad = [s for s in res if res[s]["exit_code"] != 0]
    verdict = (
        {"status": "fail", "reason": f"{', '.join(bad)} exited non-zero"}
        if bad
        else {"status": "pass"}
    )
    return {**verdict, "nproc": 2, **res}


def distributed_run(ctx: Ctx, strategy: str, cfg: Path) -> dict[str, Any]:
    out = ctx.work / f"dist-{strategy}"
    log = ctx.work / f"dist-{strategy}.log"
    rc = run_proc(
        ctx,
        [
            PY,
            "-m",
            "shoestring",
            "run",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "0",
            "--run-dir",
            str(out),
            "--",
            PY,
            "-m",
            "shoestring",
            "finetune",
            "--config",
            str(cfg),
            "--output_dir",
            str(out),
            "--distributed.strategy",
            strategy,
        ],
        log,
        150,
    )
    res: dict[str, Any] = {"exit_code": rc}
    if rc == 0:
        ctx.runs[f"dist-{strategy}"] = out
        events = read_events(out)
        res["as_run"] = as_run(events)
        res.update(step_figures(events))
        res["tokens_per_s_note"] = "global batch tokens / step time, rank 0's step events"
    else:
        res["log_tail"] = tail(log, 800)
    return res


def check_infer(ctx: Ctx) -> dict[str, Any]:
    out = ctx.work / "infer.json"
    run_python(
        ctx,
        "import json, torch, infer_cuda\n"
        f"r = infer_cuda.run(torch.device({ctx.device!r}), {ctx.small})\n"
        f"open({str(out)!r}, 'w').write(json.dumps(r))",
        ctx.work / "infer.log",
        200,
    )
    res: dict[str, Any] = json.loads(out.read_text())
    if not res.get("h2d_bytes_per_s"):  # infer_cuda returns 0.0 off CUDA: not a measurement
        res.pop("h2d_bytes_per_s", None)
        res["note"] = "no CUDA: CPU smoke path, pinned host-to-device copy not measured"
    ex = res["exactness"]
    if ex["greedy_identical"] != ex["prompts"]:
        return {
            **res,
            "status": "fail",
            "reason": f"streaming greedy tokens differ from "
            f"transformers on {ex['prompts'] - ex['greedy_identical']} of {ex['prompts']} "
            "prompts",
        }
    stored = res.get("prequant", {})
    if "prompts" in stored and stored["greedy_identical"] != stored["prompts"]:
        bad = stored["prompts"] - stored["greedy_identical"]
        return {**res, "status": "fail", "reason": f"4-bit stored: {bad} prompts differ"}
    held = res.get("structured", {})
    if "answers" in held and held["complete_and_valid"] != held["answers"]:
        bad = held["answers"] - held["complete_and_valid"]
        return {**res, "status": "fail", "reason": f"{bad} held answers not complete and valid"}
    return {**res, "status": "pass"}


def check_nvml(ctx: Ctx) -> dict[str, Any]:
    if not ctx.cuda:
        return {"status": "skipped", "reason": "no CUDA/NVML"}
    if not ctx.probe.get("pynvml"):
        return {
            "status": "fail",
            "reason": "pynvml not importable (pip install nvidia-ml-py, "
            "the 'watch' extra): shoestring run samples no GPU metrics",
        }
    cfg = write_config(ctx, "nvml", finetune_config(ctx, tiny_shape(ctx)))
    out, log = ctx.work / "nvml", ctx.work / "nvml.log"
    rc = run_proc(
        ctx,
        [
            PY,
            "-m",
            "shoestring",
            "run",
            "--max-restarts",
            "0",
            "--run-dir",
            str(out),
            "--metrics-interval",
            "1",
            "--",
            PY,
            "-m",
            "shoestring",
            "finetune",
            "--config",
            str(cfg),
            "--output_dir",
            str(out),
        ],
        log,
        90,
    )
    metrics = of_kind(read_events(out), "metrics", rank=None)
    gpus = [g for m in metrics for g in m.get("gpus") or []]
    res: dict[str, Any] = {
        "exit_code": rc,
        "metrics_events": len(metrics),
        "gpu_records": len(gpus),
        "gpu_fields": sorted({k for g in gpus for k in g}),
    }
    for key in ("util_pct", "mem_used_bytes", "power_w", "sm_clock_mhz"):
        vals = [g[key] for g in gpus if isinstance(g.get(key), (int, float))]
        if vals:
            res[f"max_{key}"] = max(vals)
    if rc != 0 or not any("mem_used_bytes" in g or "util_pct" in g for g in gpus):
        why = f"run exited {rc}" if rc != 0 else "no metrics event with GPU fields"
        return {**res, "status": "fail", "reason": why}
    return {**res, "status": "pass"}


# --------------------------------------------------------------------------- (a) the 16 GB promise

#: The (a) runs, most valuable first: (label, realshape name, precision).
PROMISE_RUNS = (
    ("llama3-8b-bf16", "llama3-8b", "bf16"),
    ("llama3-8b-fp16", "llama3-8b", "fp16"),  # the T4 path: fp16 autocast + gradient scaler
    ("llama2-7b-bf16", "llama2-7b", "bf16"),
)
#: ``python -c CAPPED finetune ...``: the finetune process capped to a T4's usable memory.
CAPPED = (
    "import sys, torch\n"
    "torch.cuda.set_per_process_memory_fraction(float(sys.argv[1]))\n"
    "from shoestring.cli import main\n"
    "sys.exit(main(sys.argv[2:]))\n"
)


def promise_config(ctx: Ctx, model: Path, prec: str) -> dict[str, Any]:
    """QLoRA at Llama-3 shapes as the README promises it: seq 2048, micro-batch 1, nf4,
    paged AdamW 8-bit, gradient checkpointing."""
    dtype = {"bf16": "bfloat16", "fp16": "float16"}[prec]
    return {
        "model": {"path": str(model), "dtype": dtype, "gradient_checkpointing": True},
        "data": {"max_length": 2048, "eval": "", "packing": True},
        "train": {
            "max_steps": 6,
            "batch_size": 2,
            "micro_batch_size": 1,
            "warmup_steps": 2,
            "optimizer": "paged_adamw8bit",
            "device": "cuda",
            "precision": prec,
        },
        "eval": {"every_steps": 0},
        "lora": {"quantize": "nf4", "cache_quantized": False},
        "checkpoint": {"every_steps": 0},
        "preempt": {"cloud": "none"},
        "plan": {"enforce": False},
    }


def build_realshape(ctx: Ctx, name: str) -> Path:
    """A random-init real-shape model streamed to safetensors shards here (no download)."""
    out = ctx.work / f"{name}.path"
    run_python(
        ctx,
        "import realshape; from pathlib import Path\n"
        f"p = realshape.materialize({name!r}, Path({str(ctx.work / 'models')!r}))\n"
        f"open({str(out)!r}, 'w').write(str(p))",
        ctx.work / f"build-{name}.log",
        240,
    )
    return Path(out.read_text().strip())


def capped_run(ctx: Ctx, label: str, name: str, prec: str) -> dict[str, Any]:
    t0 = time.monotonic()
    model = build_realshape(ctx, name)
    built_s = round(time.monotonic() - t0, 1)
    cfg_path = write_config(ctx, label, promise_config(ctx, model, prec))
    fraction = T4_USABLE_BYTES / ctx.probe["total_memory"]
    out = ctx.work / label
    cmd = [PY, "-c", CAPPED, f"{fraction:.6f}", *finetune_cmd(cfg_path, out)[3:]]
    rc = run_proc(ctx, cmd, ctx.work / f"{label}.log", ctx.remaining())
    res: dict[str, Any] = {"model": name, "precision": prec, "build_s": built_s,
                           "cap_bytes": T4_USABLE_BYTES, "memory_fraction": fraction,
                           "exit_code": rc}  # fmt: skip
    if rc != 0:
        log = tail(ctx.work / f"{label}.log")
        oom = "OutOfMemoryError" in log or "out of memory" in log
        return {**res, "status": "fail", "fits": not oom, "reason": f"exited {rc}: {log}"}
    events = read_events(out)
    res.update(fits=True, as_run=as_run(events), **step_figures(events))
    res["memory"] = memory_vs_plan(ctx, label, cfg_path, res)
    return {**res, "status": "pass"}


def check_promise_16gb(ctx: Ctx) -> dict[str, Any]:
    """(a) 8B/7B-shape QLoRA under a T4's 15 GiB, bf16 and fp16; on CPU the same code
    path on the tiny model (the cap and the real shapes: not run)."""
    runs: dict[str, Any] = {}
    if not ctx.cuda or ctx.small:
        why = "no CUDA" if not ctx.cuda else "--small"
        runs = {label: {"status": "not_run", "reason": why} for label, _, _ in PROMISE_RUNS}
        runs["tiny-nf4"] = train_run(
            ctx, "promise-tiny", tiny_shape(ctx), ctx.remaining(),
            quantize="nf4", optimizer="paged_adamw8bit",
        )  # fmt: skip
    for label, name, prec in PROMISE_RUNS if ctx.cuda and not ctx.small else ():
        try:
            runs[label] = capped_run(ctx, label, name, prec)
        except CheckError as e:
            runs[label] = {"status": ctx.cut_status(e), "reason": str(e)}
    bad = [k for k, r in runs.items() if r["status"] == "fail"]
    res: dict[str, Any] = {"status": "fail" if bad else "pass", "runs": runs}
    if bad:
        res["reason"] = "; ".join(f"{k}: {runs[k].get('reason', '')[:300]}" for k in bad)
    return res


# --------------------------------------------------------------------------- (b) vs HF + PEFT


def peer_workload(ctx: Ctx) -> dict[str, Any]:
    """The side-by-side workload: the 0.86B model in QLoRA on CUDA, the tiny one on CPU."""
    import hf_baseline

    if ctx.cuda and not ctx.small:
        return hf_baseline.peer_spec(model=str(ensure_big_model(ctx)))
    model = ctx.work / "tiny.path"
    run_python(
        ctx,
        "from pathlib import Path\nfrom shoestring.train.config import ModelConfig\n"
        "from shoestring.train.model import resolve_model_dir\n"
        f"p = resolve_model_dir(ModelConfig(), Path({str(ctx.work / 'cache')!r}))\n"
        f"open({str(model)!r}, 'w').write(str(p))",
        ctx.work / "tiny-model.log",
        120,
    )
    cuda = ctx.cuda
    return hf_baseline.peer_spec(
        model=model.read_text().strip(), steps=6, batch=2, seq=32, quantize="none",
        optimizer="adamw", precision="bf16" if cuda else "fp32", gradient_checkpointing=False,
        device=ctx.device, threads=0 if cuda else 1, lr=2e-3,
    )  # fmt: skip


def ours_side(ctx: Ctx, name: str, spec: dict[str, Any], **train: Any) -> Job:
    import hf_baseline

    cfg = write_config(ctx, name, hf_baseline.our_config(spec, **train))
    return finetune_cmd(cfg, ctx.work / name), ctx.work / f"{name}.log", ctx.env()


def ours_figures(ctx: Ctx, name: str, rc: int) -> dict[str, Any]:
    if rc != 0:
        raise CheckError(f"ours ({name}) exited {rc}: {tail(ctx.work / f'{name}.log')}")
    events = read_events(ctx.work / name)
    figures = step_figures(events)
    figures["losses"] = [e["loss"] for e in of_kind(events, "step")]
    compiled = of_kind(events, "compile")
    if compiled:
        figures["compile_s"] = compiled[0]["seconds"]
    return figures


def side_by_side(ours: dict[str, Any], theirs: dict[str, Any], prec: str) -> dict[str, Any]:
    import hf_baseline

    res: dict[str, Any] = {"tokens_per_s_ratio": ours["tokens_per_s"] / theirs["tokens_per_s"]}
    if "cuda_peak_bytes" in ours and "cuda_peak_bytes" in theirs:
        res["peak_memory_ratio"] = ours["cuda_peak_bytes"] / theirs["cuda_peak_bytes"]
    res["loss_curves"] = hf_baseline.curves_agree(ours["losses"], theirs["losses"], prec)
    return res


def check_peer_hf(ctx: Ctx) -> dict[str, Any]:
    """(b) ours vs HF Trainer + PEFT on the same model, data, order, batch, precision and
    sequence; then ours with train.kernels liger and with train.compile."""
    import hf_baseline

    spec = peer_workload(ctx)
    spec["data"] = str(hf_baseline.write_data(
        ctx.work / "peer.jsonl", spec["steps"] * spec["batch"], spec["seq"], spec["seed"]
    ))  # fmt: skip
    (ctx.work / "peer-spec.json").write_text(json.dumps(spec))
    theirs_json = ctx.work / "peer-hf.json"
    hf: Job = (
        [PY, str(BENCH / "hf_baseline.py"), "--spec", str(ctx.work / "peer-spec.json"),
         "--out", str(theirs_json)],
        ctx.work / "peer-hf.log", ctx.env(),
    )  # fmt: skip
    # On CPU both sides share the cores (1 thread each): a smoke test, not a timing.
    rc_ours, rc_hf = run_pair(ctx, ours_side(ctx, "peer-ours", spec), hf, parallel=not ctx.cuda)
    ours = ours_figures(ctx, "peer-ours", rc_ours)
    if rc_hf != 0:
        raise CheckError(f"HF Trainer side exited {rc_hf}: {tail(ctx.work / 'peer-hf.log')}")
    theirs = json.loads(theirs_json.read_text())
    res: dict[str, Any] = {
        "workload": {k: v for k, v in spec.items() if k not in ("model", "data")},
        "ours": ours,
        "hf_trainer_peft": theirs,
        "ours_vs_hf": side_by_side(ours, theirs, spec["precision"]),
    }
    if not ctx.cuda:
        res["note"] = "CPU smoke: both sides ran side by side on shared cores; not a timing"
    res["variants"] = {
        "kernels_liger": speed_variant(ctx, spec, ours, "liger", kernels="liger"),
        "compile": speed_variant(ctx, spec, ours, "compile", compile=True),
    }
    return {**res, **peer_verdict(res)}


def peer_verdict(res: dict[str, Any]) -> dict[str, Any]:
    problems = []
    if not res["ours_vs_hf"]["loss_curves"]["agree"]:
        problems.append(f"loss curves disagree: {res['ours_vs_hf']['loss_curves']}")
    for name, v in res["variants"].items():
        if v["status"] == "fail":
            problems.append(f"{name}: {v['reason'][:300]}")
    return {"status": "fail", "reason": "; ".join(problems)} if problems else {"status": "pass"}


def liger_ready(ctx: Ctx) -> str:
    """'' when liger-kernel imports (installed from --wheelhouse if need be), else why not."""
    probe_code = [PY, "-c", "import liger_kernel"]
    if subprocess.run(probe_code, capture_output=True, timeout=120).returncode == 0:
        return ""
    if ctx.wheelhouse is None:
        return "liger-kernel not installed (pass --wheelhouse DIR holding its wheel)"
    log = ctx.work / "pip-liger.log"
    pip = [PY, "-m", "pip", "install", "--no-index", "--find-links", str(ctx.wheelhouse),
           "liger-kernel"]  # fmt: skip
    if run_proc(ctx, pip, log, 120) != 0:
        return f"liger-kernel not installed: pip from {ctx.wheelhouse} failed: {tail(log, 600)}"
    return ""


def speed_variant(
    ctx: Ctx, spec: dict[str, Any], plain: dict[str, Any], name: str, **train: Any
) -> dict[str, Any]:
    """Ours with one speed lever on: figures and ratios against ours without it."""
    if not ctx.cuda:
        why = {
            "liger": "no CUDA (liger-kernel is Triton; refused on CPU by design)",
            "compile": "no CUDA: inductor compiles for minutes on CPU; the CPU path is "
            "tests/test_speed_knobs.py (slow: SIGKILL resume of a compiled run)",
        }[name]
        return {"status": "not_run", "reason": why}
    if name == "liger" and (missing := liger_ready(ctx)):
        return {"status": "not_run", "reason": missing}
    try:
        job = ours_side(ctx, f"peer-ours-{name}", spec, **train)
        figures = ours_figures(ctx, f"peer-ours-{name}", run_proc(ctx, *job[:2], ctx.remaining()))
    except CheckError as e:
        return {"status": ctx.cut_status(e), "reason": str(e)}
    res = {
        "status": "pass",
        **figures,
        "vs_ours_plain": side_by_side(figures, plain, spec["precision"]),
    }
    if not res["vs_ours_plain"]["loss_curves"]["agree"]:
        res.update(status="fail", reason="loss curve differs from ours without it")
    return res


# --------------------------------------------------------------------------- (d) blocking


def check_checkpoint_blocking(ctx: Ctx) -> dict[str, Any]:
    """(d) Periodic saves' blocking vs the step, at 0.86B on CUDA (LoRA bf16, a save every
    5 steps), over the tiny runs so far on CPU."""
    if ctx.cuda and not ctx.small:
        shape = replace(big_shape(ctx, ensure_big_model(ctx)), every=5)
        run = train_run(ctx, "blocking-1b", shape, ctx.remaining())
        if run["status"] != "pass":
            return {"status": "fail", "reason": run.get("reason", ""), "run": run}
    if not ctx.runs:
        return {"status": "not_run", "reason": "no finetune run finished before this check"}
    runs = {name: b for name, out in ctx.runs.items() if (b := blocking_of(out)) is not None}
    if not runs:
        return {
            "status": "fail",
            "reason": f"no checkpoint event with blocking_ms in {', '.join(ctx.runs)}",
        }
    return {
        "status": "pass",
        "target": f"median blocking_ms / median step_ms < {BLOCKING_TARGET}",
        "what_blocks": blocking_parts(ctx),
        "runs": runs,
    }


def blocking_parts(ctx: Ctx) -> dict[str, Any]:
    """``ckpt_parts.py`` on the device: capture vs per-tensor copy-out vs one coalesced
    copy vs the bus, on the 0.86B run's state shapes (tiny ones with --small)."""
    out = ctx.work / "ckpt-parts.json"
    try:
        run_python(
            ctx,
            "import json, torch, ckpt_parts\n"
            f"r = ckpt_parts.measure(torch.device({ctx.device!r}), {ctx.small or not ctx.cuda})\n"
            f"open({str(out)!r}, 'w').write(json.dumps(r))",
            ctx.work / "ckpt-parts.log",
            60,
        )
    except CheckError as e:
        return {"status": ctx.cut_status(e), "reason": str(e)}
    res: dict[str, Any] = json.loads(out.read_text())
    if not ctx.cuda:
        res["note"] = "CPU smoke of the measurement: host copies, no bus; not the GPU answer"
    return res


# --------------------------------------------------------------------------- (e) FSDP2 + QLoRA

#: (e)'s finetune runs, most valuable first: label -> the ``distributed`` section
#: (``single``: one process, no FSDP, the losses' reference).
FSDP_RUNS: dict[str, dict[str, Any]] = {
    "fsdp": {"strategy": "fsdp"},
    "fsdp_cpu_offload": {"strategy": "fsdp", "cpu_offload": True},
    "single": {},
}
#: The planner's per-rank prediction for each FSDP run: (job label, plan flags).
FSDP_PLANS: dict[str, tuple[str, tuple[str, ...]]] = {
    "fsdp": ("plan", ("--strategy", "fsdp", "--world-size", "1")),
    "fsdp_cpu_offload": (
        "plan_cpu_offload",
        ("--strategy", "fsdp", "--world-size", "1", "--cpu-offload"),
    ),
}
#: FSDP2 over a mesh of one vs one process, the largest per-step relative loss gap. The
#: math is the same (one rank's reduce-scatter is a copy): fp32 on CPU agrees to ~1e-6
#: (tests/test_fsdp_qlora.py's LOSS_RTOL is 1e-4); under bf16 autocast on CUDA the
#: sharded modules' kernels may run in another order.
FSDP_LOSS_RTOL = {"fp32": 1e-4, "bf16": 1e-2}
#: A job's outcome: its exit code, or the status and reason of a job that did not end.
Outcome = int | dict[str, Any]


def fsdp_name(label: str) -> str:
    return f"fsdpq-{label}"


def fsdp_shape(ctx: Ctx) -> Shape:
    """The 0.86B Llama on CUDA (6 steps of 4 x 512 packed tokens, a checkpoint every 3);
    the tiny model on CPU (a smoke of the same code)."""
    if ctx.cuda and not ctx.small:
        return Shape(str(ensure_big_model(ctx)), steps=6, batch=4, seq=512, every=3, packing=True)
    return Shape("builtin:tiny", steps=4, batch=2, seq=32, every=2)


def fsdp_quantize() -> tuple[str, str]:
    """nf4 where bitsandbytes is installed (its CPU kernels run the tiny model too), else
    plain LoRA under FSDP2, and why."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        return "none", "bitsandbytes not installed: nf4 skipped, plain LoRA under FSDP2"
    return "nf4", ""


def fsdp_jobs(ctx: Ctx, shape: Shape, quantize: str) -> dict[str, Job]:
    """The runs of :data:`FSDP_RUNS` (deterministic, AdamW: FSDP2 refuses bitsandbytes'
    8-bit optimizers), the FSDP run SIGKILLed once (``kill``) and the plans."""
    base = finetune_config(ctx, shape, quantize=quantize, deterministic=True)
    det = ctx.env(**deterministic_env(ctx))
    jobs: dict[str, Job] = {}
    cfgs: dict[str, Path] = {}
    for label, dist in FSDP_RUNS.items():
        name = fsdp_name(label)
        cfgs[label] = write_config(ctx, name, {**base, "distributed": dist} if dist else base)
        jobs[label] = finetune_cmd(cfgs[label], ctx.work / name), ctx.work / f"{name}.log", det
    jobs["kill"] = killed_job(ctx, fsdp_name("kill"), cfgs["fsdp"])
    for label, (job, flags) in FSDP_PLANS.items():
        jobs[job] = plan_job(ctx, fsdp_name(label), cfgs[label], *flags)
    return jobs


def fsdp_schedule(ctx: Ctx) -> tuple[list[list[str]], dict[str, str]]:
    """Phases of jobs run side by side, and the jobs left out with why. On CUDA one run
    at a time (clean timings and peaks; the plans, CPU only, beside the first); on CPU
    every job at once on the shared cores, the SIGKILL resume not with --small."""
    if ctx.cuda:
        phases = [["fsdp", "plan", "plan_cpu_offload"], ["fsdp_cpu_offload"], ["single"], ["kill"]]
        return phases, {}
    why = "refused on CPU (nothing to offload): distributed.cpu_offload is the GPU path"
    left_out = {"fsdp_cpu_offload": why, "plan_cpu_offload": why}
    if not ctx.small:
        return [["fsdp", "single", "kill", "plan"]], left_out
    left_out["kill"] = (
        "--small (CI time: two more processes); --device cpu without --small runs it, and "
        "tests/test_fsdp_qlora.py restarts a killed FSDP2 + nf4 job byte-identically"
    )
    return [["fsdp", "single", "plan"]], left_out


def run_phases(
    ctx: Ctx, jobs: dict[str, Job], phases: list[list[str]], left_out: dict[str, str]
) -> dict[str, Outcome]:
    """The phases in turn, each one's jobs side by side: label -> :data:`Outcome`. Once
    the budget (or a timeout) cuts a phase, its jobs and the later ones did not end."""
    done: dict[str, Outcome] = {k: {"status": "not_run", "reason": r} for k, r in left_out.items()}
    for i, labels in enumerate(phases):
        try:
            codes = run_jobs(ctx, [jobs[k] for k in labels], True, ctx.remaining())
        except CheckError as e:
            why = f"{' + '.join(labels)} side by side: {e}" if len(labels) > 1 else str(e)
            done |= {k: {"status": ctx.cut_status(e), "reason": why} for k in labels}
            later = [k for phase in phases[i + 1 :] for k in phase]
            return done | {k: {"status": "not_run", "reason": "time budget spent"} for k in later}
        done |= dict(zip(labels, codes, strict=True))
    return done


def fsdp_prediction(ctx: Ctx, label: str, outcome: Outcome) -> dict[str, Any]:
    """The plan of an FSDP run's config (per rank, world size 1), or why there is none."""
    if isinstance(outcome, dict):
        return outcome
    try:
        plan = read_plan(ctx.work / f"{fsdp_name(label)}-plan.json", outcome)
    except CheckError as e:
        return {"status": "fail", "reason": str(e)}
    return {"status": "pass", **plan}


def fsdp_memory(ctx: Ctx, plan: dict[str, Any], figures: dict[str, Any]) -> dict[str, Any]:
    """``max_memory_allocated`` vs the planner's per-rank prediction (present on CPU too)."""
    if plan["status"] != "pass":
        return {"status": plan["status"], "reason": f"plan: {plan['reason']}"}
    pred = {"plan_peak_bytes": plan["peak_bytes"], "plan_host_bytes": plan["host_bytes"]}
    if not ctx.cuda:
        return {**pred, "status": "not_run", "reason": "no CUDA: no max_memory_allocated"}
    if "cuda_peak_bytes" not in figures:
        return {**pred, **NO_PEAK}
    return {**pred, **measured_vs_plan(plan, figures["cuda_peak_bytes"])}


def fsdp_run(ctx: Ctx, label: str, outcome: Outcome, plan: dict[str, Any] | None) -> dict[str, Any]:
    """One run's figures (tokens/s, ``cuda_peak_bytes``, losses) and, for an FSDP run,
    its memory against the plan; ``fail`` on a non-zero exit."""
    if isinstance(outcome, dict):
        return outcome
    name = fsdp_name(label)
    try:
        res: dict[str, Any] = {"status": "pass", **ours_figures(ctx, name, outcome)}
    except CheckError as e:
        return {"status": "fail", "exit_code": outcome, "reason": str(e)}
    ctx.runs[name] = ctx.work / name
    res["as_run"] = as_run(read_events(ctx.work / name))
    if plan is not None:
        res["memory"] = fsdp_memory(ctx, plan, res)
        if res["memory"]["status"] == "fail":
            res.update(status="fail", reason="memory: " + res["memory"]["reason"])
    return res


def losses_agree(ours: list[float], ref: list[float], prec: str) -> dict[str, Any]:
    """Per-step loss gap of an FSDP run to the single-process one (same steps, same data)."""
    if not ours or len(ours) != len(ref):
        return {"agree": False, "reason": f"{len(ours)} losses vs {len(ref)}"}
    rel = [abs(a - b) / abs(b) for a, b in zip(ours, ref, strict=True)]
    tol = FSDP_LOSS_RTOL[prec]
    return {
        "steps_compared": len(rel),
        "max_rel_diff": max(rel),
        "tolerance_max_rel": tol,
        "agree": max(rel) <= tol,
    }


def fsdp_losses(runs: dict[str, dict[str, Any]], prec: str) -> dict[str, Any]:
    """Each FSDP run's losses against the single-process run's."""
    res: dict[str, Any] = {}
    for label in FSDP_PLANS:
        ran = {k: runs[k] for k in (label, "single")}
        if not_passed := [k for k, r in ran.items() if r["status"] != "pass"]:
            why = ", ".join(f"{k} {ran[k]['status']}" for k in not_passed)
            res[label] = {"status": "not_run", "reason": why}
        else:
            res[label] = losses_agree(ran[label]["losses"], ran["single"]["losses"], prec)
    return res


def fsdp_resume(ctx: Ctx, done: dict[str, Outcome], cfg: Path) -> dict[str, Any]:
    """The SIGKILLed FSDP run rerun: resumed, and byte-identical to the uninterrupted one."""
    rc_kill, rc_ref = done["kill"], done["fsdp"]
    if isinstance(rc_kill, dict):
        return rc_kill
    if rc_ref != 0:
        return {"status": "not_run", "reason": "the uninterrupted FSDP run did not pass"}
    try:
        return resume_killed(ctx, fsdp_name("kill"), cfg, rc_kill, ctx.work / fsdp_name("fsdp"))
    except CheckError as e:
        return {"status": ctx.cut_status(e), "reason": str(e)}


def check_fsdp_qlora(ctx: Ctx) -> dict[str, Any]:
    """(e) FSDP2 over a mesh of one (one process) on a 4-bit base: without and with
    ``distributed.cpu_offload``, against the planner and the single-process losses,
    and resumed after a SIGKILL."""
    shape, (quantize, skipped) = fsdp_shape(ctx), fsdp_quantize()
    jobs = fsdp_jobs(ctx, shape, quantize)
    done = run_phases(ctx, jobs, *fsdp_schedule(ctx))
    runs: dict[str, Any] = {}
    for label in FSDP_RUNS:
        plan = (
            fsdp_prediction(ctx, label, done[FSDP_PLANS[label][0]]) if label in FSDP_PLANS else None
        )
        runs[label] = fsdp_run(ctx, label, done[label], plan)
    prec = precision(ctx)["used"]
    res: dict[str, Any] = {
        "workload": fsdp_workload(ctx, shape, quantize, skipped),
        "runs": runs,
        "losses_vs_single": fsdp_losses(runs, prec),
        "sigkill_resume": fsdp_resume(ctx, done, ctx.work / f"{fsdp_name('fsdp')}.yaml"),
    }
    return {**res, **fsdp_verdict(res)}


def fsdp_workload(ctx: Ctx, shape: Shape, quantize: str, skipped: str) -> dict[str, Any]:
    res: dict[str, Any] = {
        "model": shape.model if shape.model.startswith("builtin:") else "llama-0.86b-random",
        **{k: getattr(shape, k) for k in ("steps", "batch", "seq", "packing", "every")},
        "quantize": quantize,
        "optimizer": "adamw",
        "precision": precision(ctx)["used"],
        "deterministic": True,
        "mesh": "one process, world size 1 (FSDP2 over a mesh of one, in-memory store)",
    }
    if skipped:
        res["nf4_skipped"] = skipped
    if not ctx.cuda:
        res["note"] = "CPU smoke: the runs shared the cores; not a timing"
    return res


def fsdp_verdict(res: dict[str, Any]) -> dict[str, Any]:
    runs = res["runs"]
    problems = [f"{k}: {r['reason'][:300]}" for k, r in runs.items() if r["status"] == "fail"]
    problems += [
        f"{k}'s losses differ from the single-process run's: {c}"
        for k, c in res["losses_vs_single"].items()
        if c.get("agree") is False
    ]
    if res["sigkill_resume"]["status"] == "fail":
        problems.append(f"sigkill_resume: {res['sigkill_resume']['reason'][:300]}")
    if problems:
        return {"status": "fail", "reason": "; ".join(problems)}
    if runs["fsdp"]["status"] != "pass":
        return {"status": runs["fsdp"]["status"], "reason": runs["fsdp"]["reason"]}
    return {"status": "pass"}


CHECKS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "promise_16gb": check_promise_16gb,
    "peer_hf": check_peer_hf,
    "infer": check_infer,
    "checkpoint_blocking": check_checkpoint_blocking,
    "sigkill_resume": check_sigkill_resume,
    "nvml": check_nvml,
    "distributed": check_distributed,
    "fsdp_qlora": check_fsdp_qlora,
}


# --------------------------------------------------------------------------- driver


def run_check(ctx: Ctx, name: str, budget: float) -> dict[str, Any]:
    """One check, isolated: an exception becomes ``fail`` with the error."""
    if time.monotonic() >= ctx.global_deadline - 1:
        return {"status": "not_run", "reason": "global time budget spent"}
    t0 = time.monotonic()
    ctx.deadline = t0 + budget
    try:
        res = CHECKS[name](ctx)
    except CheckError as e:
        res = {"status": "fail", "reason": str(e)}
    except Exception as e:  # noqa: BLE001 - the next check still runs
        res = {
            "status": "fail",
            "reason": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc()[-2000:],
        }
    res["seconds"] = round(time.monotonic() - t0, 2)
    res["budget_s"] = budget
    return res


def header(args: argparse.Namespace, info: dict[str, Any]) -> dict[str, Any]:
    return {
        "date": datetime.date.today().isoformat(),
        **git_facts(),
        "torch": info.get("torch"),
        "cuda": info.get("cuda"),
        "device": info.get("device_name", "cpu") if args.device == "cuda" else "cpu",
        "device_count": info.get("device_count", 0),
        "device_arg": args.device,
        "small": args.small,
        "pynvml": info.get("pynvml"),
        "budget_s": args.budget_s,
        "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
        "cpu_count": os.cpu_count(),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument(
        "--small",
        action="store_true",
        help="tiny shapes only (no ~1B model): the CPU/CI smoke test",
    )
    p.add_argument("--out", help="JSON path (default benchmarks/results/gpu-check-<date>.json)")
    p.add_argument(
        "--checks",
        default=",".join(CHECKS),
        help=f"comma list of checks to run (default all: {','.join(CHECKS)})",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="global time budget in seconds (default 470 on CUDA, 300 with --small "
        "on CPU); checks not started by then are not_run",
    )
    p.add_argument("--work", help="keep the scratch dir here (default: a temp dir, removed)")
    p.add_argument(
        "--wheelhouse",
        help="folder of wheels to pip install liger-kernel from (no index) when it is not "
        "importable; without it the liger variant is not_run",
    )
    args = p.parse_args(argv)
    if args.budget_s is None:
        args.budget_s = 470.0 if args.device == "cuda" else (300.0 if args.small else 900.0)
    unknown = set(args.checks.split(",")) - set(CHECKS)
    if unknown:
        p.error(f"--checks: unknown {', '.join(sorted(unknown))}")
    return args


def run_all(args: argparse.Namespace, work: Path, t0: float) -> dict[str, Any]:
    info = probe(args.device)
    report = header(args, info)
    ctx = Ctx(
        device=args.device,
        small=args.small,
        work=work,
        probe=info,
        global_deadline=t0 + args.budget_s,
        wheelhouse=Path(args.wheelhouse).resolve() if args.wheelhouse else None,
    )
    wanted = args.checks.split(",")
    checks: dict[str, Any] = {}
    for name in CHECKS:
        if args.device == "cuda" and not info["cuda_available"]:
            checks[name] = {"status": "fail", "reason": "--device cuda but torch sees no CUDA"}
        elif name not in wanted:
            checks[name] = {"status": "not_run", "reason": "not selected (--checks)"}
        else:
            scale = 1 if ctx.cuda or ctx.small else 5  # the ~1B model on CPU: slow, untuned
            checks[name] = run_check(ctx, name, BUDGETS[name][0 if ctx.cuda else 1] * scale)
        print(
            f"gpu_check: {name}: {checks[name]['status']} ({checks[name].get('seconds', 0)} s)",
            file=sys.stderr,
            flush=True,
        )
    report["checks"] = checks
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    sys.modules.setdefault("gpu_check", sys.modules[__name__])  # one module for the helpers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the cleanup below runs
    try:
        report = run_all(args, work, t0)
    finally:
        for p in list(LIVE):
            kill_group(p)
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    report["total_s"] = round(time.monotonic() - t0, 2)
    out = Path(args.out) if args.out else BENCH / "results" / f"gpu-check-{report['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=1, default=str)
    out.write_text(text + "\n")
    print(text)
    return 1 if any(c["status"] == "fail" for c in report["checks"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
