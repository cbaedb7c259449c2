"""Helpers shared by the benchmark scripts (not part of the package).

* ``model_dir(...)``: the built-in tiny Llama, or a bigger random-init Llama built
  from the same config and byte-level tokenizer (for meaningful state sizes).
* small statistics helpers and a machine-load note.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:  # run from a checkout without `pip install -e`
    sys.path.insert(0, str(ROOT / "src"))

DEFAULT_CACHE = Path(
    os.environ.get("SHOESTRING_BENCH_CACHE", Path.home() / ".cache" / "shoestring")
)


def model_dir(
    cache: Path,
    hidden: int | None = None,
    layers: int | None = None,
    intermediate: int | None = None,
) -> Path:
    """The built-in tiny model dir, or (any size knob given) a random Llama of that size."""
    from shoestring.train.builtin import materialize_tiny_model

    tiny = materialize_tiny_model(cache)
    if hidden is None and layers is None and intermediate is None:
        return tiny
    base = json.loads((tiny / "config.json").read_text())
    hidden = hidden or base["hidden_size"]
    layers = layers or base["num_hidden_layers"]
    intermediate = intermediate or (hidden * 8 // 3 + 63) // 64 * 64
    head_dim = 64
    if hidden % head_dim:
        raise SystemExit(f"--hidden must be a multiple of {head_dim}")
    target = cache / f"bench-llama-h{hidden}-l{layers}-i{intermediate}"
    if (target / ".complete").is_file():
        return target
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=base["vocab_size"],
        pad_token_id=base["pad_token_id"],
        bos_token_id=base["bos_token_id"],
        eos_token_id=base["eos_token_id"],
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // head_dim,
        num_key_value_heads=hidden // head_dim,
        head_dim=head_dim,
        max_position_embeddings=base["max_position_embeddings"],
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    )
    tmp = cache / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        model = LlamaForCausalLM(cfg)
        with torch.no_grad():  # same init tweak as builtin:tiny (confident frozen head)
            model.lm_head.weight.normal_(0.0, 0.15)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, tmp / f.name)
    (tmp / ".complete").write_text("ok\n")
    shutil.rmtree(target, ignore_errors=True)
    os.rename(tmp, target)
    return target


def pct(xs: Sequence[float], q: float) -> float:
    """Percentile by linear interpolation (q in [0, 100])."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def load_note() -> str:
    """1-minute load average vs cores, so a noisy result says so."""
    try:
        la = os.getloadavg()[0]
    except OSError:  # pragma: no cover
        return "load unknown"
    n = os.cpu_count() or 1
    busy = (
        " (BUSY: other processes compete for the CPUs; numbers are noisy)" if la > n * 0.75 else ""
    )
    return f"load avg {la:.2f} on {n} cores{busy}"


#: Words for synthetic prompts (the byte tokenizer: one token per character).
WORDS = "the of and to in is was for on are with as by at from that this be it an".split()


def random_llama(tag: str, hidden: int, layers: int, **extra: Any) -> Path:
    """A random-init Llama for the inference benchmarks (GQA, shards of 1 GB), built
    once into the cache as ``bench-infer-TAG-hH-lL``."""
    from shoestring.infer.fixtures import build_random_model

    target = DEFAULT_CACHE / f"bench-infer-{tag}-h{hidden}-l{layers}"
    if not (target / ".complete").is_file():
        print(f"building {target.name} ...", flush=True)
        build_random_model(
            target, "llama", hidden=hidden, layers=layers, ffn=hidden * 11 // 4,
            heads=hidden // 64, kv_heads=max(hidden // 256, 1), shard="1GB", init_std=0.02,
            **extra,
        )  # fmt: skip
        (target / ".complete").touch()
    return target


def infer_job(
    name: str, model: Path, lines: list[dict[str, Any]], extra: list[str], tmp: Path
) -> tuple[float, dict[str, Any], Path]:
    """``shoestring infer`` on ``lines`` as its own process: (wall seconds, its
    ``infer_end`` event, the output file)."""
    import subprocess
    import time

    inp, out = tmp / f"{name}.jsonl", tmp / f"{name}.out.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cmd = [sys.executable, "-m", "shoestring", "infer", "--model", str(model),
           "--input", str(inp), "--output", str(out), "--job.progress", "off", *extra]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{name} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    events = [json.loads(x) for x in (tmp / f"{name}.out.jsonl.run/events.jsonl").open()]
    return wall, next(e for e in events if e["event"] == "infer_end"), out
