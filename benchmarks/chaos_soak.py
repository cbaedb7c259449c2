"""Kill-anywhere soak: many random SIGKILLs (also inside checkpoint writes), many seeds.

Each seed: one uninterrupted reference run, then the same command restarted after
every kill until it exits 0; the final adapter, optimizer and RNG state must be
byte-identical to the reference. Prints one line per seed and a summary.

    .venv/bin/python benchmarks/chaos_soak.py --seeds 5 --kills 20
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "src")]

from chaos import run_with_chaos  # noqa: E402
from conftest import CLI, FAST, state_digest  # noqa: E402
from shoestring.train.builtin import materialize_tiny_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--keep-dirs", action="store_true")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="chaos-soak-"))
    cache = work / "cache"
    materialize_tiny_model(cache)
    cli = CLI(cache)
    args = [
        *FAST,
        "--train.max_steps",
        str(a.steps),
        "--checkpoint.every_steps",
        "2",
        "--checkpoint.keep",
        "2",
    ]
    ref_out = work / "reference"
    r = cli.run(ref_out, *args)
    assert r.returncode == 0, r.stderr
    ref = state_digest(ref_out, a.steps)
    ok = total_kills = 0
    t0 = time.time()
    for seed in range(a.seeds):
        out = work / f"seed{seed}"
        modes = random.Random(seed + 10_000)

        def start(faults: str, out: Path = out, modes: random.Random = modes):
            return cli.start(
                out,
                *args,
                "--checkpoint.async_mode",
                modes.choice(["thread", "process", "off"]),
                env={"SHOESTRING_FAULTS": faults},
            )

        res = run_with_chaos(start, out, kills=a.kills, rng=random.Random(seed))
        same = state_digest(out, a.steps) == ref
        ok += same
        total_kills += res.kills
        inside = sum(
            1
            for how, rc in res.attempts
            if rc == -9 and how.startswith("ckpt.") and "external" not in how
        )
        print(
            f"seed {seed}: {res.kills} kills ({inside} inside checkpoint writes), "
            f"{len(res.attempts)} starts, identical={same}",
            flush=True,
        )
    print(
        f"summary: {ok}/{a.seeds} seeds byte-identical after {total_kills} SIGKILLs "
        f"in {time.time() - t0:.0f}s"
    )
    if not a.keep_dirs:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok == a.seeds else 1


if __name__ == "__main__":
    sys.exit(main())
