"""Real size on this machine: QLoRA of a Llama-2-7B and a Llama-3-8B shape, measured.

For each shape (random init, written by ``realshape.py`` without holding it in
memory), as a new user runs it — whole ``shoestring`` processes:

* ``build``: the streamed writer's time and peak RSS (and, ``--small``, that what it
  wrote loads in transformers equal to the same model built in memory);
* ``plan``: ``shoestring plan --device cpu`` for the exact finetune config;
* ``qlora``: an uninterrupted run with an empty cache: load split into read and
  quantize (and the quantized base's save), step time, checkpoint size and
  blocking, peak anonymous RSS of the load and of the steps vs the plan;
* ``restart``: the same command SIGKILLed right after the step-2 checkpoint, then
  restarted twice from copies of that directory, side by side: reading the
  cached quantized base vs quantizing again (``--lora.cache_quantized false``):
  process start -> first resumed step for each, and every final adapter's sha256
  against the uninterrupted run's.

    .venv/bin/python benchmarks/scale.py                       # 7B and 8B, ~1 h
    .venv/bin/python benchmarks/scale.py --shapes llama2-7b    # one shape
    .venv/bin/python benchmarks/scale.py --small               # CI smoke, small widths
    .venv/bin/python benchmarks/scale.py --shapes olmoe-1b-7b --checks qlora,merge \
        --finetune-args '--lora.dropout 0'                      # an MoE, merged export

Writes ``benchmarks/results/scale-<date>.json`` after every check (a cut-off run
keeps what it measured). Heavy: run it alone, in the background.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(BENCH), str(ROOT / "src")]

import realshape  # noqa: E402

PY = sys.executable
RESULTS = BENCH / "results"


class RssSampler:
    """Peak anonymous RSS (RssAnon: heap, not the page cache of mapped files) of a
    process tree, sampled every ``interval`` seconds, with the time of each sample."""

    def __init__(self, pid: int, interval: float = 0.25) -> None:
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree_anon(self) -> int:
        import psutil

        try:
            procs = [psutil.Process(self.pid)]
            procs += procs[0].children(recursive=True)
        except psutil.Error:
            return 0
        total = 0
        for p in procs:
            try:
                with open(f"/proc/{p.pid}/status") as f:
                    for line in f:
                        if line.startswith("RssAnon:"):
                            total += int(line.split()[1]) * 1024
            except OSError:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self._tree_anon()))
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def peak(self, t0: float = 0.0, t1: float = float("inf")) -> int:
        return max((b for t, b in self.samples if t0 <= t <= t1), default=0)


def read_events(out: Path) -> list[dict[str, Any]]:
    p = out / "events.jsonl"
    recs = []
    for line in p.read_text().splitlines() if p.exists() else []:
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return [r for r in recs if r.get("rank", 0) == 0]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def finetune_args(model: Path, out: Path, a: argparse.Namespace) -> list[str]:
    """As a user on this CPU runs it: ``model.dtype`` auto (float32 on a CPU; a bf16
    GEMM without AVX512-BF16/AMX takes 80x longer here: 22.6 s vs 0.27 s for one
    64x11008 @ 11008x4096 product on the AMD EPYC this was measured on)."""
    return [
        "--output_dir", str(out),
        "--model.path", str(model),
        "--lora.quantize", "nf4",
        "--train.optimizer", "adamw8bit",
        "--data.eval", "",
        "--data.max_length", str(a.seq),
        "--train.batch_size", "1",
        "--train.micro_batch_size", "1",
        "--train.max_steps", str(a.steps),
        "--train.warmup_steps", "1",
        "--train.log_every_steps", "1",
        "--train.deterministic", "true",
        "--checkpoint.every_steps", "1",
        "--checkpoint.keep", "2",
        "--watch.enabled", "false",
        *shlex.split(a.finetune_args),
    ]  # fmt: skip


class Runner:
    def __init__(self, work: Path, cache: Path) -> None:
        self.work, self.cache = work, cache

    def env(self, cache: Path | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SHOESTRING_")}
        env.update(SHOESTRING_CACHE=str(cache or self.cache), TOKENIZERS_PARALLELISM="false")
        return env

    def finetune(
        self,
        args: list[str],
        log: str,
        *,
        cache: Path | None = None,
        kill_after_checkpoint: int | None = None,
        cap: float = 7200,
    ) -> dict[str, Any]:
        """One ``shoestring finetune`` process: exit code, wall, RSS samples, events."""
        out = Path(args[args.index("--output_dir") + 1])
        cmd = [PY, "-m", "shoestring", "finetune", *args]
        t0 = time.time()
        with open(self.work / f"{log}.log", "ab") as f:
            p = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env(cache), cwd=ROOT,
                start_new_session=True,
            )  # fmt: skip
        rss = RssSampler(p.pid)
        killed = False
        try:
            while p.poll() is None:
                if time.time() - t0 > cap:
                    raise TimeoutError(f"{log}: over {cap:.0f} s")
                if kill_after_checkpoint is not None and any(
                    e["event"] == "checkpoint" and e.get("step") == kill_after_checkpoint
                    for e in read_events(out)
                ):
                    os.killpg(p.pid, signal.SIGKILL)
                    killed = True
                    p.wait()
                    break
                time.sleep(0.5)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            rss.stop()
        return {"rc": p.returncode, "killed": killed, "wall_s": time.time() - t0,
                "rss": rss, "out": out}  # fmt: skip


def attempt_figures(events: list[dict[str, Any]], rss: RssSampler) -> dict[str, Any]:
    """This process's figures: the last ``start`` record's attempt."""
    i = max(i for i, e in enumerate(events) if e["event"] == "start")
    mine = events[i:]
    start = mine[0].get("process_start") or mine[0]["ts"]
    loads = {e["phase"]: e for e in mine if e["event"] == "load"}
    steps = [e for e in mine if e["event"] == "step"]
    run_start = next((e["ts"] for e in mine if e["event"] == "run_start"), None)
    cks = [e for e in mine if e["event"] == "checkpoint"]
    res: dict[str, Any] = {
        "process_start_to_first_step_s": round(steps[0]["ts"] - start, 2) if steps else None,
        "load_model": {k: v for k, v in loads.get("model", {}).items()
                       if k not in ("v", "ts", "event", "run_id", "rank", "phase")},
        "load_data_s": loads.get("data", {}).get("seconds"),
        "step_ms": [e.get("step_ms") for e in steps],
        "tokens_per_s": [e.get("tokens_per_s") for e in steps],
        "checkpoints": [{k: e.get(k) for k in ("step", "bytes", "blocking_ms", "write_ms", "background_ms")}
                        for e in cks],
        "peak_rss_anon_bytes": rss.peak(),
    }  # fmt: skip
    if run_start is not None:
        res["peak_rss_anon_load_bytes"] = rss.peak(0, run_start)
        res["peak_rss_anon_steps_bytes"] = rss.peak(run_start)
        # A checkpoint's write serializes its staged copy in the background: the steps'
        # peak away from those windows, and the staging bytes each checkpoint holds.
        writes = [(e["ts"] - (e.get("background_ms") or 0) / 1e3 - 1.0, e["ts"] + 1.0)
                  for e in cks]  # fmt: skip
        quiet = [b for t, b in rss.samples
                 if t >= run_start and not any(a <= t <= z for a, z in writes)]  # fmt: skip
        res["peak_rss_anon_steps_outside_writes_bytes"] = max(quiet, default=None)
    resume = [e for e in mine if e["event"] == "resume"]
    if resume:
        res["resumed_from"] = resume[0].get("from_step")
    return res


def write_config(path: Path, args: list[str]) -> Path:
    """The finetune flags as a config file ``shoestring plan --config`` reads."""
    import yaml

    cfg: dict[str, Any] = {}
    for key, value in zip(args[::2], args[1::2]):
        node = cfg
        *parents, leaf = key.removeprefix("--").split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value) if value else value  # "64" -> 64, "true" -> True
    path.write_text(yaml.safe_dump(cfg))
    return path


def plan(args: list[str], work: Path, name: str) -> dict[str, Any]:
    cfg = write_config(work / f"{name}.yaml", args)
    r = subprocess.run(
        [PY, "-m", "shoestring", "plan", "--config", str(cfg), "--device", "cpu", "--json"],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    if r.returncode == 2:  # refused (a mixture of experts): the run is measured all the same
        return {"refused": r.stderr.strip().splitlines()[-1]}
    r.check_returncode()
    p = json.loads(r.stdout)
    return {"peak_bytes": p["peak_bytes"], "breakdown": p["breakdown"]}


def final_sha(out: Path) -> str:
    return sha256(out / "final" / "adapter_model.safetensors")


def check_build(name: str, cache: Path, small: bool) -> tuple[Path, dict[str, Any]]:
    target = cache / f"realshape-{name}-s0-v1"
    fresh = not (target / ".complete").is_file()
    t0 = time.time()
    p = subprocess.Popen([PY, str(BENCH / "realshape.py"), name], cwd=ROOT,
                         env={**os.environ, "SHOESTRING_BENCH_CACHE": str(cache)},
                         stdout=subprocess.PIPE, text=True)  # fmt: skip
    rss = RssSampler(p.pid)
    stdout, _ = p.communicate()
    rss.stop()
    model = Path(stdout.strip().splitlines()[-1])
    res: dict[str, Any] = {
        "built_now": fresh,
        "seconds": round(time.time() - t0, 1) if fresh else None,
        "peak_rss_anon_bytes": rss.peak() if fresh else None,
        "bytes": sum(f.stat().st_size for f in model.glob("*.safetensors")),
        "shards": len(list(model.glob("*.safetensors"))),
    }
    if small:
        res["equal_to_in_memory_model"] = writer_matches(model)
    return model, res


def writer_matches(model: Path) -> bool:
    """Loaded by transformers, every tensor equals the in-memory init of the same seed."""
    import torch
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    return all(
        torch.equal(t, realshape.init_tensor(n, tuple(t.shape), 0, torch.bfloat16))
        for n, t in loaded.state_dict().items()
    )


def check_qlora(r: Runner, model: Path, a: argparse.Namespace, name: str) -> dict[str, Any]:
    args = finetune_args(model, r.work / f"{name}-ref", a)
    res: dict[str, Any] = {"plan": plan(args, r.work, name)}
    run = r.finetune(args, f"{name}-ref")
    if run["rc"] != 0:
        raise RuntimeError(f"{name}-ref exited {run['rc']} (see {r.work}/{name}-ref.log)")
    fig = attempt_figures(read_events(run["out"]), run["rss"])
    res.update(fig, final_sha256=final_sha(run["out"]), wall_s=round(run["wall_s"], 1))
    if "peak_bytes" in res["plan"]:
        plan_peak = res["plan"]["peak_bytes"]
        res["plan_vs_peak_rss_anon"] = round(plan_peak / max(fig["peak_rss_anon_bytes"], 1), 3)
    qbase = r.cache / "qbase"
    res["qbase_bytes"] = sum(f.stat().st_size for f in qbase.rglob("*") if f.is_file())
    return res


def check_restart(r: Runner, model: Path, a: argparse.Namespace, name: str,
                  ref_sha: str) -> dict[str, Any]:  # fmt: skip
    out = r.work / f"{name}-killed"
    args = finetune_args(model, out, a)
    killed = r.finetune(args, f"{name}-killed", kill_after_checkpoint=2)
    res: dict[str, Any] = {"killed": killed["killed"], "killed_rc": killed["rc"]}
    arms = {"cached": [], "quantize": ["--lora.cache_quantized", "false"]}
    for arm in arms:
        shutil.copytree(out, r.work / f"{name}-{arm}", symlinks=True)
    for arm, extra in arms.items():
        args = finetune_args(model, r.work / f"{name}-{arm}", a) + extra
        run = r.finetune(args, f"{name}-{arm}")
        fig = attempt_figures(read_events(run["out"]), run["rss"])
        fig["rc"] = run["rc"]
        fig["final_sha256_equal"] = run["rc"] == 0 and final_sha(run["out"]) == ref_sha
        res[arm] = fig
    q, c = res["quantize"], res["cached"]
    if q["process_start_to_first_step_s"] and c["process_start_to_first_step_s"]:
        res["restart_speedup"] = round(
            q["process_start_to_first_step_s"] / c["process_start_to_first_step_s"], 2
        )
    return res


def check_merge(r: Runner, model: Path, a: argparse.Namespace, name: str) -> dict[str, Any]:
    """The finished uninterrupted run, one more step, then ``--export.merged true``: the
    16-bit merge streamed from the trained model; peak anonymous RSS of the export phase
    (final checkpoint -> run_end) against that of the steps."""
    out = r.work / f"{name}-merge"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(r.work / f"{name}-ref", out, symlinks=True)
    args = finetune_args(model, out, a)
    args[args.index("--train.max_steps") + 1] = str(a.steps + 1)
    run = r.finetune([*args, "--export.merged", "true"], f"{name}-merge")
    if run["rc"] != 0:
        raise RuntimeError(f"{name}-merge exited {run['rc']} (see {r.work}/{name}-merge.log)")
    events = read_events(out)
    final_ck = max(e["ts"] for e in events if e["event"] == "checkpoint")
    end = max(e["ts"] for e in events if e["event"] == "run_end")
    merged = out / "merged"
    report = json.loads((merged / "merge_report.json").read_text())
    fig = attempt_figures(events, run["rss"])
    return {
        "export_s": round(end - final_ck, 1),
        "peak_rss_anon_export_bytes": run["rss"].peak(final_ck, end),
        "peak_rss_anon_steps_bytes": fig.get("peak_rss_anon_steps_bytes"),
        "merged_bytes": sum(f.stat().st_size for f in merged.glob("*.safetensors")),
        "merge_report": report,
        "load_model": fig["load_model"],
    }


def header(a: argparse.Namespace) -> dict[str, Any]:
    import platform

    import bitsandbytes
    import torch
    import transformers

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    return {
        "date": dt.date.today().isoformat(),
        "git_commit": commit,
        "machine": f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}",
        "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "bitsandbytes": bitsandbytes.__version__,
        "steps": a.steps, "seq_len": a.seq, "small": a.small, "finetune_args": a.finetune_args,
        "loadavg_at_start": os.getloadavg(),
        "shapes": {},
    }  # fmt: skip


def run_shape(name: str, a: argparse.Namespace, work: Path, report: dict[str, Any],
              save: Any) -> None:  # fmt: skip
    shape: dict[str, Any] = report["shapes"].setdefault(name, {})
    cache = Path(a.cache)
    model, shape["build"] = check_build(name, cache, a.small)
    save()
    qcache = work / f"cache-{name}"  # an empty model cache: the first run quantizes
    if "qlora" in a.checks:
        shutil.rmtree(qcache, ignore_errors=True)
    qcache.mkdir(parents=True, exist_ok=True)
    r = Runner(work, qcache)
    for check in a.checks:
        t0 = time.time()
        try:
            if check == "qlora":
                shape["qlora"] = check_qlora(r, model, a, name)
            elif check == "merge":
                shape["merge"] = check_merge(r, model, a, name)
            elif check == "restart":
                ref = shape.get("qlora", {}).get("final_sha256", "")
                shape["restart"] = check_restart(r, model, a, name, ref)
        except Exception as e:  # noqa: BLE001 - recorded, the next check still runs
            shape[check] = {"error": f"{type(e).__name__}: {e}"}
        shape.setdefault(check, {})["check_s"] = round(time.time() - t0, 1)
        save()


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="llama2-7b,llama3-8b")
    p.add_argument(
        "--checks",
        default="qlora,restart",
        help="build always runs; merge (after qlora, same --work): one more step and the "
        "streamed 16-bit export",
    )
    p.add_argument("--small", action="store_true", help="small-width shapes (CI smoke)")
    p.add_argument(
        "--finetune-args",
        default="",
        help="more finetune flags, e.g. '--lora.dropout 0' for an MoE shape (olmoe-1b-7b)",
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq", type=int, default=64, help="data.max_length")
    p.add_argument("--out", help="default: benchmarks/results/scale-<date>.json")
    p.add_argument("--work", default="/tmp/shoestring-scale")
    p.add_argument("--cache", default=str(realshape.DEFAULT_CACHE), help="model folders")
    a = p.parse_args(argv)
    if a.small and a.shapes == p.get_default("shapes"):
        a.shapes = "small-mha,small-gqa"
    if a.small and a.steps == p.get_default("steps"):
        a.steps = 8  # steps take 0.1 s: the kill after checkpoint 2 lands a few later
    a.checks = [c for c in a.checks.split(",") if c != "build"]  # build always runs
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    out = Path(a.out or RESULTS / f"scale-{dt.date.today().isoformat()}.json")
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    report = header(a)
    if out.is_file():  # another invocation the same day (e.g. --checks merge): add to it
        earlier = json.loads(out.read_text())
        report["shapes"] = earlier.pop("shapes", {})
        report["earlier_invocations"] = [*earlier.pop("earlier_invocations", []), earlier]

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1, default=str) + "\n")

    for name in a.shapes.split(","):
        run_shape(name, a, work, report, save)
    save()
    print(json.dumps(summary(report), indent=1))
    return 0


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers of each shape."""
    out: dict[str, Any] = {}
    for name, s in report["shapes"].items():
        q, r = s.get("qlora", {}), s.get("restart", {})
        steps = [x for x in q.get("step_ms", [])[1:] if x] or q.get("step_ms", [])
        out[name] = {
            "load_model": q.get("load_model"),
            "median_step_s": round(statistics.median(steps) / 1e3, 1) if steps else None,
            "peak_rss_anon_gb": round(q.get("peak_rss_anon_bytes", 0) / 1e9, 2),
            "plan_gb": round(q.get("plan", {}).get("peak_bytes", 0) / 1e9, 2),
            "restart_s": {k: r.get(k, {}).get("process_start_to_first_step_s")
                          for k in ("cached", "quantize")},
            "restart_speedup": r.get("restart_speedup"),
            "sha256_equal": {k: r.get(k, {}).get("final_sha256_equal")
                             for k in ("cached", "quantize")},
        }  # fmt: skip
    return out


if __name__ == "__main__":
    sys.exit(main())
