"""Layer-streamed batch inference: ours vs AirLLM 4.0.0 vs Accelerate disk offload.

One invocation runs every tool as a whole process on the same random-init Llama
(larger than the memory cap), the same prompts and the same greedy settings,
each in its own memory cgroup (v1 or v2, created under this process's own
cgroup; page cache is charged to it, so streaming is real), and prints ratios.

    .venv/bin/python benchmarks/infer_vs_peers.py                  # mid model, 64 x 32
    .venv/bin/python benchmarks/infer_vs_peers.py --compress int8,nf4  # adds ours+int8, +nf4
    ... --tools ours,airllm,accelerate,accelerate-bf16  # + Accelerate loading it as bf16

Peers run from benchmarks/.venv-peers (gitignored): a venv that sees the project
venv's packages through a .pth file and adds ``airllm==4.0.0`` (``--no-deps``);
see docs/inference.md. Disk bandwidth is re-measured in the same run (best of 3
``dd iflag=direct`` over a shard at bs=16M and bs=256M), before and after the tools.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
PEERS_PY = ROOT / "benchmarks" / ".venv-peers" / "bin" / "python"
CACHE = Path(os.environ.get("SHOESTRING_BENCH_CACHE", Path.home() / ".cache" / "shoestring"))
WORDS = "the of and to in is was for on are with as by at from that this be it an".split()


# ---------------------------------------------------------------------------- setup


def build_model(hidden: int, layers: int, ffn: int) -> Path:
    target = CACHE / f"bench-infer-llama-gqa-h{hidden}-l{layers}-f{ffn}"
    if (target / ".complete").is_file():
        return target
    from shoestring.infer.fixtures import build_random_model

    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"building {target.name} ...", flush=True)
    build_random_model(
        tmp,
        "llama",
        hidden=hidden,
        layers=layers,
        ffn=ffn,
        heads=hidden // 64,
        kv_heads=max(hidden // 256, 1),
        shard="1GB",
        init_std=0.02,
    )
    (tmp / ".complete").write_text("1\n")
    shutil.rmtree(target, ignore_errors=True)
    os.rename(tmp, target)
    return target


def offload_map(config: Any) -> dict[str, str]:
    """Accelerate's device map for the peer: every decoder layer on disk, the decoder's
    other parts and the head in RAM; a vision-language model's tower on disk too (text
    never runs it, so it is never read)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    decoder = model.get_decoder()
    path = next(n for n, m in model.named_modules() if m is decoder)
    n = config.get_text_config().num_hidden_layers
    dmap = {f"{path}.layers.{i}": "disk" for i in range(n)}
    dmap |= {f"{path}.{c}": "cpu" for c, _ in decoder.named_children() if c != "layers"}
    for name, child in model.named_children():  # the head; beside the decoder, a tower
        inside = path == name or path.startswith(name + ".")
        if not inside:
            dmap[name] = "cpu" if child is model.get_output_embeddings() else "disk"
        elif path != name:
            dmap |= {f"{name}.{c}": "disk" for c, _ in child.named_children()
                     if not path.startswith(f"{name}.{c}")}  # fmt: skip
    return dmap


def write_prompts(path: Path, n: int, seed: int = 0) -> Path:
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 6)))
            f.write(json.dumps({"id": i, "prompt": text}) + "\n")
    return path


def evict(paths: list[Path]) -> None:
    """Drop these files' pages from the page cache (so every tool starts cold)."""
    for root in paths:
        for p in root.rglob("*") if root.is_dir() else [root]:
            if p.is_file():
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd) if os.access(p, os.W_OK) else None
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def disk_bandwidth(shard: Path, tries: int = 3) -> float:
    """Best of ``tries`` O_DIRECT sequential reads of ``shard``, at 16 MiB and 256 MiB
    requests: the device's ceiling (this virtio disk gives ~2x more with big requests,
    which is what our reader issues, so 16 MiB alone would flatter every tool)."""
    best = 0.0
    for bs in ("16M", "256M"):
        for _ in range(tries):
            evict([shard])
            r = subprocess.run(
                ["dd", f"if={shard}", "of=/dev/null", f"bs={bs}", "iflag=direct"],
                capture_output=True,
                text=True,
            )
            m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", r.stderr)
            if m:
                best = max(best, int(m.group(1)) / float(m.group(2)))
    return best


class Cgroup:
    """A child memory cgroup of ours with a hard limit; v1 (memory.limit_in_bytes) or v2."""

    def __init__(self, name: str, limit: int) -> None:
        self.path = self._base() / name
        self.v2 = (self.path.parent / "cgroup.controllers").exists()
        self.path.mkdir(exist_ok=True)
        self._write("memory.max" if self.v2 else "memory.limit_in_bytes", str(limit))
        if not self.v2:
            self._write("memory.max_usage_in_bytes", "0")
            (self.path / "memory.memsw.limit_in_bytes").exists() and self._write(
                "memory.memsw.limit_in_bytes", str(limit)
            )

    @staticmethod
    def _base() -> Path:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctrl, rel = line.split(":", 2)
            if "memory" in ctrl.split(","):
                return Path("/sys/fs/cgroup/memory") / rel.lstrip("/")
            if ctrl == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
                return Path("/sys/fs/cgroup") / rel.lstrip("/")
        raise SystemExit("no memory cgroup found; run as root on a cgroup v1/v2 host")

    def _write(self, name: str, value: str) -> None:
        (self.path / name).write_text(value)

    def peak(self) -> int:
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        p = self.path / name
        return int(p.read_text()) if p.exists() else -1

    def oom_kills(self) -> int:
        p = self.path / ("memory.events" if self.v2 else "memory.oom_control")
        m = re.search(r"oom_kill (\d+)", p.read_text()) if p.exists() else None
        return int(m.group(1)) if m else 0

    def enter(self) -> None:  # preexec_fn of the child
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass


def run_tool(
    tool: str, args: argparse.Namespace, model: Path, prompts: Path, work: Path, cap: int
) -> dict[str, Any]:
    py = sys.executable if tool.startswith("ours") else str(PEERS_PY)
    cg = Cgroup(f"bench-{tool}-{os.getpid()}", cap)
    evict([model])
    cmd = [
        py,
        __file__,
        "--worker",
        tool,
        "--model",
        str(model),
        "--prompts",
        str(prompts),
        "--work",
        str(work / tool),
        "--new-tokens",
        str(args.new_tokens),
        "--threads",
        str(args.threads),
        "--budget",
        str(args.budget or cap - (64 << 20)),
    ]
    t0 = time.perf_counter()
    r = subprocess.run(
        cmd, capture_output=True, text=True, preexec_fn=cg.enter, timeout=args.timeout
    )
    wall = time.perf_counter() - t0
    shutil.rmtree(work / tool, ignore_errors=True)  # its copies (40 GB for gpt-oss-20b)
    res: dict[str, Any] = {
        "tool": tool,
        "rc": r.returncode,
        "process_s": wall,
        "cgroup_peak": cg.peak(),
        "oom_kills": cg.oom_kills(),
    }
    cg.remove()
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        res["error"] = (r.stderr or r.stdout)[-1500:]
        return res
    res.update(json.loads(lines[-1][7:]))
    return res


# ---------------------------------------------------------------------------- workers


def _io_read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


class _Stamps:
    """A logits processor that only timestamps each generation step."""

    def __init__(self) -> None:
        self.t: list[float] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.t.append(time.perf_counter())
        return scores


def _hf_batch(tok: Any, prompts: list[str]) -> tuple[Any, Any]:
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(prompts, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


def worker(tool: str, a: argparse.Namespace) -> dict[str, Any]:
    import resource

    import torch

    torch.set_num_threads(a.threads)
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    records = [json.loads(x) for x in Path(a.prompts).read_text().splitlines()]
    t_setup = time.perf_counter()
    out: dict[str, Any] = {}
    if tool.startswith("ours"):
        from shoestring.infer.config import InferConfig
        from shoestring.infer.job import run_infer

        cfg = InferConfig()
        cfg.model.path, cfg.io.input = a.model, a.prompts
        cfg.io.output = str(work / "out.jsonl")
        cfg.generate.max_new_tokens, cfg.generate.stop_at_eos = a.new_tokens, False
        cfg.memory.budget, cfg.memory.batch_size = str(a.budget), len(records)
        cfg.job.progress = "off"
        if tool == "ours-decoded":
            cfg.compress.decode_once = True
        elif tool.startswith("ours-"):
            cfg.compress.scheme = tool[len("ours-") :]
        t0 = time.perf_counter()
        assert run_infer(cfg, stream=sys.stderr) == 0
        gen_s = time.perf_counter() - t0
        end = [
            json.loads(x)
            for x in (work / "out.jsonl.run" / "events.jsonl").read_text().splitlines()
        ][-1]
        start = [
            json.loads(x)
            for x in (work / "out.jsonl.run" / "events.jsonl").read_text().splitlines()
        ][0]
        out.update(
            gen_s=end["pass_s"],
            job_s=gen_s,
            decode_step_s=end["decode_s_per_pass"],
            prefill_s=end["prefill_s"],
            passes=end["passes"],
            bytes_per_step=end["bytes_per_pass"],
            model_bytes=start["model_bytes"],
            resident_bytes=start["plan"]["breakdown"]["resident"],
            tokens=end["tokens"],
            peak_rss=end["peak_rss_bytes"],
            roofline_pct_self=end["roofline_pct"],
            read_bw_self=end["read_bytes_per_s"],
            dtype=start["dtype"],
            setup_s=start["setup_s"],
        )
        lines = (work / "out.jsonl").read_text().splitlines()
        out["first_completion"] = json.loads(lines[0])["completion"]
    else:
        from transformers import AutoTokenizer, LogitsProcessorList

        tok = AutoTokenizer.from_pretrained(a.model)
        ids, mask = _hf_batch(tok, [r["prompt"] for r in records])
        if tool == "airllm":
            from airllm import AutoModel

            model = AutoModel.from_pretrained(
                a.model, device="cpu", layer_shards_saving_path=str(work / "split")
            )
        else:  # accelerate: every decoder layer offloaded to disk, small parts on CPU
            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.from_pretrained(a.model)
            dmap = offload_map(config)
            # accelerate-bf16: loaded as bf16, so its offloaded copy is bf16 too (half the
            # bytes per step) and it computes in bf16: its fastest setting on this CPU.
            kw: dict[str, Any] = {"dtype": torch.bfloat16} if tool == "accelerate-bf16" else {}
            q = getattr(config, "quantization_config", None)
            if isinstance(q, dict) and q.get("quant_method") == "compressed-tensors":
                # Its default keeps the weights packed until a first-forward hook
                # decompresses them, which Accelerate's offload hooks break
                # ('no attribute _hf_hook'); decompressed at load, it runs.
                from transformers import CompressedTensorsConfig

                kw["quantization_config"] = CompressedTensorsConfig(dequantize=True)
            model = AutoModelForCausalLM.from_pretrained(
                a.model, device_map=dmap, offload_folder=str(work / "offload"), **kw
            )
        out["setup_s"] = time.perf_counter() - t_setup
        stamps = _Stamps()
        read0 = _io_read_bytes()
        t0 = time.perf_counter()
        with torch.inference_mode():
            g = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=a.new_tokens,
                min_new_tokens=a.new_tokens,
                do_sample=False,
                use_cache=True,
                logits_processor=LogitsProcessorList([stamps]),
                pad_token_id=tok.pad_token_id,
            )
        gen_s = time.perf_counter() - t0
        steps = [b - c for b, c in zip(stamps.t[1:], stamps.t[:-1])]
        seq = g.sequences if hasattr(g, "sequences") else g
        new = seq[:, ids.shape[1] :]
        out.update(
            gen_s=gen_s,
            prefill_s=stamps.t[0] - t0 if stamps.t else gen_s,
            decode_step_s=sum(steps) / len(steps) if steps else 0.0,
            passes=len(stamps.t),
            tokens=int(new.numel()),
            bytes_per_step=(_io_read_bytes() - read0) / max(len(stamps.t), 1),
            peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            first_completion=tok.decode(new[0], skip_special_tokens=True),
        )
    out["prompts"] = len(records)
    return out


# ---------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--prompts", default="64", help="number of prompts (or a path, in --worker)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--cap", default="1.5GiB", help="memory cgroup limit of every tool")
    p.add_argument(
        "--budget",
        type=int,
        default=0,
        help="ours: --memory-budget in bytes (default: the cap minus 64 MiB of page-cache slack)",
    )
    p.add_argument(
        "--tools",
        default="ours,airllm,accelerate",
        help="also: accelerate-bf16 (Accelerate loading the model as bf16), ours-decoded "
        "(ours with --decode-once: a checkpoint stored quantized decoded once)",
    )
    p.add_argument(
        "--compress",
        default="",
        help="also run ours with these schemes (comma-separated: int8,nf4)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per tool (with 2 threads on a shared 2-core box "
        "OpenMP collapses; see benchmarks/README.md)",
    )
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--worker", default="")
    p.add_argument("--model", default="")
    p.add_argument("--work", default="")
    p.add_argument(
        "--model-dir",
        default="",
        help="an existing model folder (e.g. benchmarks/realshape.py llama2-7b) instead of "
        "building one from --hidden/--layers/--ffn",
    )
    a = p.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(worker(a.worker, a)), flush=True)
        return
    from shoestring.infer.config import parse_size

    cap = parse_size(a.cap)
    model = Path(a.model_dir) if a.model_dir else build_model(a.hidden, a.layers, a.ffn)
    model_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    work = Path(tempfile.mkdtemp(prefix="bench-infer-"))
    prompts = write_prompts(work / "prompts.jsonl", int(a.prompts))
    shard = max(model.glob("*.safetensors"), key=lambda f: f.stat().st_size)
    bw0 = disk_bandwidth(shard)
    tools = [t for t in a.tools.split(",") if t] + [f"ours-{c}" for c in a.compress.split(",") if c]
    print(
        f"model {model.name} {model_bytes / 1e9:.2f} GB; cap "
        f"{cap / 2**30:.2f} GiB; {a.prompts} prompts x {a.new_tokens} new tokens; "
        f"{a.threads} threads; disk {bw0 / 1e9:.2f} GB/s (dd iflag=direct, best of "
        "16M/256M x 3)",
        flush=True,
    )
    results = {}
    for tool in tools:
        res = run_tool(tool, a, model, prompts, work, cap)
        results[tool] = res
        print(json.dumps(res), flush=True)
    bw1 = disk_bandwidth(shard)
    bw = max(bw0, bw1)
    shutil.rmtree(work, ignore_errors=True)
    print(
        f"\ndisk bandwidth: {bw0 / 1e9:.2f} GB/s before, {bw1 / 1e9:.2f} after; "
        f"roofline uses {bw / 1e9:.2f}"
    )
    hdr = (
        f"{'tool':<12}{'process s':>10}{'setup s':>9}{'gen s':>9}{'tok/s':>9}{'prompts/h':>11}"
        f"{'step s':>9}{'GB/step':>9}{'roofline':>9}{'peak RSS':>10}{'cg peak':>9}"
    )
    print(hdr)
    for tool, r in results.items():
        if "error" in r:
            print(f"{tool:<12} FAILED rc={r['rc']} oom_kills={r['oom_kills']}: {r['error'][-300:]}")
            continue
        tok_s = r["tokens"] / r["gen_s"]
        r["tok_s"], r["prompts_h"] = tok_s, r["prompts"] / r["process_s"] * 3600
        roof = r["bytes_per_step"] / bw
        r["roofline"] = roof / r["decode_step_s"] if r["decode_step_s"] else 0.0
        print(
            f"{tool:<12}{r['process_s']:>10.1f}{r.get('setup_s', 0.0):>9.1f}{r['gen_s']:>9.1f}{tok_s:>9.2f}"
            f"{r['prompts_h']:>11.0f}{r['decode_step_s']:>9.3f}"
            f"{r['bytes_per_step'] / 1e9:>9.3f}{100 * r['roofline']:>8.0f}%"
            f"{r['peak_rss'] / 1e9:>9.2f}G{r['cgroup_peak'] / 1e9:>8.2f}G"
        )
    for name in tools:
        ours = results[name]
        if not name.startswith("ours") or "tok_s" not in ours:
            continue
        ratio = ours["bytes_per_step"] / max(ours["model_bytes"] - ours["resident_bytes"], 1)
        print(
            f"\n{name} ({ours['dtype']} compute): disk bytes per decode step = {ratio:.3f} x "
            f"(model - resident) [target <= 1.05]; resident "
            f"{ours['resident_bytes'] / 1e9:.2f} GB; peak RSS {ours['peak_rss'] / 1e9:.2f} GB "
            f"vs budget {(a.budget or cap - (64 << 20)) / 1e9:.2f} GB"
        )
        for peer in tools:
            r = results[peer]
            if peer.startswith("ours") or "tok_s" not in r:
                continue
            print(
                f"{name} / {peer:<15} generated tok/s {ours['tok_s'] / r['tok_s']:6.2f}x, "
                f"prompts/h (whole process) {ours['prompts_h'] / r['prompts_h']:6.2f}x, "
                f"decode step {r['decode_step_s'] / ours['decode_step_s']:6.2f}x faster"
            )


if __name__ == "__main__":
    main()
