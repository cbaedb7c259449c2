"""Host memory and time of writing a checkpoint's tensors: ours vs the peers' writers.

One state (``--gib`` GiB of fp32 tensors, as a LoRA-on-everything adapter with its
optimizer moments is), written by each side in its own fresh process, after the
state is built and touched. Each side's peak is VmHWM minus the resident set just
before its write (the peak is reset through ``/proc/self/clear_refs``):

* ``ours``: ``run_commit`` of the snapshot (the background half of a save): the
  safetensors file streamed from the tensors (:class:`shoestring.stwriter.TensorFile`),
  hashed as written, fsynced, manifest last, renamed;
* ``st_save``: ``safetensors.torch.save`` then a write of its bytes (what our writer
  did before 2026-12-07);
* ``st_save_file``: ``safetensors.torch.save_file`` (PEFT's ``save_pretrained``, the
  HF Trainer's adapter file), streamed by safetensors' Rust writer;
* ``torch_save``: ``torch.save`` of the dict (the HF Trainer's ``optimizer.pt``,
  torchtune's and litgpt's checkpoints).

Every peer is fsynced after its write (ours syncs each file and the folder), and
ours also computes the sha256 of every file for its manifest; the peers do not.

    python benchmarks/ckpt_write.py [--gib 1.0] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
SIDES = ("ours", "st_save", "st_save_file", "torch_save")

_CHILD = """
import os, sys, time
from pathlib import Path
import torch

side, gib, out = sys.argv[1], float(sys.argv[2]), Path(sys.argv[3])
n = int(gib * (1 << 30) / 4 / 64)
state = {f"p{i:02d}": torch.randn(n) for i in range(64)}


def rss():
    s = dict(l.split(":", 1) for l in Path("/proc/self/status").read_text().splitlines())
    return int(s["VmRSS"].split()[0]) * 1024, int(s["VmHWM"].split()[0]) * 1024


def synced(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def write():
    if side == "ours":
        from shoestring.checkpoint import make_snapshot
        from shoestring.checkpoint.commit import run_commit

        snap = make_snapshot(1, {"w.safetensors": state}, {"s.json": {"step": 1}}, {})
        run_commit(snap, out, keep=1, remote=None)
    elif side == "st_save":
        from safetensors.torch import save

        out.mkdir()
        data = save(state)
        with open(out / "w.safetensors", "wb") as f:
            f.write(data)
        synced(out / "w.safetensors")
    elif side == "st_save_file":
        from safetensors.torch import save_file

        out.mkdir()
        save_file(state, str(out / "w.safetensors"))
        synced(out / "w.safetensors")
    else:
        out.mkdir()
        torch.save(state, out / "w.pt")
        synced(out / "w.pt")


Path("/proc/self/clear_refs").write_text("5")
before, _ = rss()
t0 = time.perf_counter()
write()
seconds = time.perf_counter() - t0
print(seconds, rss()[1] - before)
"""


def run_side(side: str, gib: float, work: Path) -> dict[str, float]:
    env = {"PYTHONPATH": str(SRC), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, side, str(gib), str(work / side)],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    if r.returncode != 0:
        raise SystemExit(f"{side} failed:\n{r.stderr}")
    seconds, growth = r.stdout.split()
    return {"seconds": float(seconds), "peak_growth_bytes": int(growth)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    state = int(args.gib * (1 << 30))
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        for side in SIDES:
            results[side] = run_side(side, args.gib, Path(tmp))
            r = results[side]
            print(
                f"{side:13s} {r['seconds']:6.2f} s   peak +{r['peak_growth_bytes'] / 2**20:7.1f} MiB "
                f"({r['peak_growth_bytes'] / state:.3f}x the state)"
            )
    for side in SIDES[1:]:
        p, o = results[side], results["ours"]
        print(
            f"ours vs {side}: time {o['seconds'] / p['seconds']:.2f}x, peak growth "
            f"{o['peak_growth_bytes'] / 2**20:.1f} vs {p['peak_growth_bytes'] / 2**20:.1f} MiB"
        )
    doc = {"date": time.strftime("%Y-%m-%d"), "state_bytes": state, "sides": results}
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
