"""Host RAM at load under FSDP2: every rank reads the base (before issue 27 item 2) vs one
reader (rank 0 reads, the others start on the meta device and receive their shards).

For each ``lora.quantize`` (none, nf4) and each way, N gloo ranks on this host load a
random Llama exactly as ``shoestring finetune --distributed.strategy fsdp`` does (the
trainer's ``load_base``, LoRA, ``FSDPStrategy.wrap``), each in a fresh process, and each
rank samples its own RSS every 2 ms from just before the load to just after wrapping:

* ``peak_anon``: peak anonymous RSS growth (memory that is this process's alone);
* ``peak_rss``: peak total RSS growth (VmHWM: includes the safetensors pages a reader
  maps, which the page cache shares between the ranks of a host);
* ``kept``: the bytes the rank keeps (its shards, LoRA, buffers, quant states).

Prints a table and the ratios, writes ``benchmarks/results/one-reader-rss-<date>.json``.

    .venv/bin/python benchmarks/one_reader_rss.py --layers 8 --hidden 1024 --nproc 2 \\
        [--dtype bfloat16] [--quantize none nf4]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from _common import DEFAULT_CACHE, ROOT, load_note, model_dir

MIB = 1 << 20


def _status() -> dict[str, int]:
    got = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "VmHWM"):
            got[key] = int(value.split()[0]) * 1024
    return got


class Sampler:
    """The peak of RssAnon, sampled every 2 ms in a thread."""

    def __init__(self) -> None:
        self.peak_anon = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_anon = max(self.peak_anon, _status()["RssAnon"])
            time.sleep(0.002)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_anon = max(self.peak_anon, _status()["RssAnon"])


def _worker(
    rank: int, nproc: int, port: int, mdir: str, dtype: str, quantize: str, way: str, out: str
) -> None:
    import ctypes

    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import bitsandbytes  # noqa: F401  (what the load imports, before measuring it)
    import peft  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    from shoestring.config import load
    from shoestring.distributed import DistEnv, ProcessGroups
    from shoestring.train.baseload import load_base
    from shoestring.train.config import FinetuneConfig
    from shoestring.train.model import apply_lora
    from shoestring.train.onereader import held_bytes
    from shoestring.train.strategy import FSDPStrategy

    flags = ["--model.path", mdir, "--model.dtype", dtype, "--lora.quantize", quantize]
    flags += ["--distributed.strategy", "fsdp", "--lora.cache_quantized", "false"]
    cfg = load(FinetuneConfig, None, flags)
    env = DistEnv(rank=rank, world_size=nproc, source="torchrun")
    with ProcessGroups(env, "gloo", 600) as pg:
        strategy = FSDPStrategy(
            torch.device("cpu"), pg, quantize=quantize, one_reader=way == "one_reader"
        )
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from here
        before = _status()
        t0 = time.perf_counter()
        with Sampler() as sampler:
            loaded = load_base(cfg, SimpleNamespace(strategy=strategy), Path(mdir), "")  # type: ignore[arg-type]
            model = apply_lora(loaded.model, cfg.lora, 0, gradient_checkpointing=False)
            strategy.wrap(model, None)
        seconds = time.perf_counter() - t0
        after = _status()
        result = {
            "rank": rank,
            "seconds": round(seconds, 2),
            "peak_anon": sampler.peak_anon - before["RssAnon"],
            "peak_rss": after["VmHWM"] - before["VmRSS"],
            "after_anon": after["RssAnon"] - before["RssAnon"],
            "kept": held_bytes(model),
            "fields": loaded.fields | strategy.load_fields(),
        }
    Path(out, f"{quantize}-{way}-rank{rank}.json").write_text(json.dumps(result))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--dtype", default="float32", help="model.dtype (the file is float32)")
    ap.add_argument("--quantize", nargs="+", default=["none", "nf4"])
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    args = ap.parse_args()
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    mdir = model_dir(args.cache, args.hidden, args.layers, args.intermediate)
    weights = sum(p.stat().st_size for p in mdir.glob("*.safetensors"))
    out = ROOT / "benchmarks" / "results" / f".one-reader-{os.getpid()}"
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, Any] = {}
    for quantize in args.quantize:
        for way in ("every_rank", "one_reader"):
            wargs = (args.nproc, _port(), str(mdir), args.dtype, quantize, way, str(out))
            mp.start_processes(_worker, args=wargs, nprocs=args.nproc, start_method="spawn")
            ranks = [
                json.loads((out / f"{quantize}-{way}-rank{r}.json").read_text())
                for r in range(args.nproc)
            ]
            rows[f"{quantize}/{way}"] = ranks
            for r in ranks:
                print(
                    f"{quantize:4} {way:10} rank {r['rank']}: peak anon +{r['peak_anon'] / MIB:7.1f}"
                    f" MiB, peak rss +{r['peak_rss'] / MIB:7.1f} MiB, kept {r['kept'] / MIB:6.1f}"
                    f" MiB, {r['seconds']:.1f} s",
                    flush=True,
                )
    for f in out.iterdir():
        f.unlink()
    out.rmdir()
    summary = {}
    for quantize in args.quantize:
        every = sum(r["peak_anon"] for r in rows[f"{quantize}/every_rank"])
        one = sum(r["peak_anon"] for r in rows[f"{quantize}/one_reader"])
        summary[quantize] = {"host_peak_anon_every_rank": every, "host_peak_anon_one_reader": one}
        print(
            f"{quantize}: sum of the ranks' peak anonymous growth: every rank reads "
            f"{every / MIB:.0f} MiB, one reader {one / MIB:.0f} MiB ({every / max(one, 1):.2f}x less)"
        )
    result = {
        "date": datetime.date.today().isoformat(),
        "model_dir": mdir.name,
        "weights_bytes": weights,
        "nproc": args.nproc,
        "dtype": args.dtype,
        "note": load_note(),
        "ranks": rows,
        "summary": summary,
    }
    name = f"one-reader-rss-{result['date']}-{args.dtype}-n{args.nproc}.json"
    dest = ROOT / "benchmarks" / "results" / name
    dest.write_text(json.dumps(result, indent=1) + "\n")
    print(f"model {weights / MIB:.0f} MiB fp32 on disk; {load_note()}; wrote {dest}")


if __name__ == "__main__":
    main()
