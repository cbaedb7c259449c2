"""Training step time with a busy neighbour: OpenMP wait policies side by side.

A short ``shoestring finetune`` of the built-in model (the default config, torch's
default thread count unless a setting says otherwise), once on an idle machine and
once while CPU burners (``python -c "while True: pass"``, ``--burners`` of them) run
beside it, for each OpenMP setting:

* ``spin``: libgomp's own default (``GOMP_SPINCOUNT=300000``: a waiting thread spins
  a few ms before it sleeps), what every command got before the CLI set a policy;
* ``cli``: nothing set, so the CLI's own default (``GOMP_SPINCOUNT=3000``, see
  ``shoestring.cli.openmp_defaults``);
* ``passive``: ``OMP_WAIT_POLICY=PASSIVE`` (waiting threads sleep at once);
* ``spinN``: ``GOMP_SPINCOUNT=N`` (``spin3k``: 3000);
* ``1thread``: ``--train.num_threads`` = cores - 1 (the CLI's default spin).

torch's CPU wheels bundle GNU libgomp (``torch/lib/libgomp.so.1``), which reads
``OMP_WAIT_POLICY`` and ``GOMP_SPINCOUNT``; ``KMP_BLOCKTIME`` is Intel OpenMP's and does
nothing here. Settings and loads alternate round by round; the median ``step_ms`` of
each run (its first steps dropped) is reported, then per setting the median over
rounds, busy/idle, and each setting vs ``spin``.

Usage (from the repo root)::

    .venv/bin/python benchmarks/busy_neighbour.py [--steps 40] [--rounds 2] [--burners 1]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import DEFAULT_CACHE, ROOT, load_note, median, model_dir
from shoestring.events import read_events

SETTINGS = {"spin": {"GOMP_SPINCOUNT": "300000"}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}


def run_once(out: Path, args: argparse.Namespace, setting: str, nice: int = 0) -> float:
    """Median step_ms of one short default finetune (steps after the 5th)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(PYTHONPATH=str(ROOT / "src"), TORCHDYNAMO_DISABLE="1")
    env.update(SETTINGS.get(setting, {}))
    n = setting[4:]
    if setting.startswith("spin") and n.rstrip("k").isdigit():
        env["GOMP_SPINCOUNT"] = str(int(n[:-1]) * 1000 if n.endswith("k") else int(n))
    cmd = ["nice", "-n", str(nice)] if nice else []
    cmd += [sys.executable, "-m", "shoestring", "finetune", "--output_dir", str(out)]
    cmd += ["--train.max_steps", str(args.steps), "--data.eval", "", "--resume", "never"]
    if args.model:
        cmd += ["--model.path", str(args.model)]
    if setting == "1thread":
        cmd += ["--train.num_threads", str(max(1, (os.cpu_count() or 2) - 1))]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if r.returncode:
        raise SystemExit(f"{setting}: finetune exited {r.returncode}:\n{r.stderr[-3000:]}")
    recs = read_events(out / "events.jsonl")
    return median([r["step_ms"] for r in recs if r.get("event") == "step" and r["step"] > 5])


def start_burners(n: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def measure(args: argparse.Namespace, tmp: Path) -> dict[tuple[str, str], list[float]]:
    got: dict[tuple[str, str], list[float]] = {}
    for rnd in range(args.rounds):
        for load in ("idle", "busy"):
            burners = start_burners(args.burners) if load == "busy" else []
            try:
                time.sleep(0.5 if burners else 0)
                for setting in args.settings:
                    out = tmp / f"{setting}-{load}-{rnd}"
                    nice = args.idle_nice if load == "idle" else 0
                    ms = run_once(out, args, setting, nice)
                    got.setdefault((setting, load), []).append(ms)
                    print(f"round {rnd} {load:4} {setting:8} {ms:9.1f} ms/step  {load_note()}")
            finally:
                stop(burners)
    return got


def report(got: dict[tuple[str, str], list[float]], settings: list[str]) -> None:
    print(
        f"\n{'setting':8} {'idle ms':>9} {'busy ms':>9} {'busy/idle':>9} "
        f"{'idle/spin':>9} {'busy/spin':>9}   per round (idle | busy)"
    )
    med = {k: median(v) for k, v in got.items()}
    for s in settings:
        idle, busy = med[(s, "idle")], med[(s, "busy")]
        rel_i, rel_b = idle / med[("spin", "idle")], busy / med[("spin", "busy")]
        rounds = " ".join(f"{x:.0f}" for x in got[(s, "idle")])
        rounds += " | " + " ".join(f"{x:.0f}" for x in got[(s, "busy")])
        print(
            f"{s:8} {idle:9.1f} {busy:9.1f} {busy / idle:9.2f} {rel_i:9.2f} {rel_b:9.2f}   {rounds}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--burners", type=int, default=1, help="CPU burners beside the busy runs")
    ap.add_argument(
        "--settings",
        default="spin,cli,passive,1thread",
        help="comma-separated: spin, cli, passive, 1thread, spinN (e.g. spin3000, spin3k)",
    )
    ap.add_argument(
        "--idle-nice",
        type=int,
        default=0,
        help="run the idle side at this niceness (e.g. -15 as root: on a VM "
        "shared with other jobs, they then barely take its cores)",
    )
    ap.add_argument(
        "--hidden",
        type=int,
        help="a random Llama this wide instead of the "
        "built-in model (with --layers; built into the bench cache)",
    )
    ap.add_argument("--layers", type=int)
    args = ap.parse_args()
    args.model = (
        model_dir(DEFAULT_CACHE, args.hidden, args.layers) if args.hidden or args.layers else None
    )
    args.settings = args.settings.split(",")
    if "spin" not in args.settings:
        args.settings.insert(0, "spin")
    print(
        f"{load_note()}; {args.steps} steps, {args.rounds} rounds, {args.burners} burner(s), "
        f"idle side at nice {args.idle_nice}, model {args.model or 'builtin:tiny'}"
    )
    with tempfile.TemporaryDirectory() as d:
        got = measure(args, Path(d))
    report(got, args.settings)


if __name__ == "__main__":
    main()
