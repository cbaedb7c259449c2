"""Shared helpers: run the real CLI in a subprocess on the built-in tiny model."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from s3server import s3_server  # noqa: F401  (session fixture: a real S3 server on 127.0.0.1)

REPO = Path(__file__).resolve().parents[1]

# Nothing in shoestring uses torch.compile, but importing peft imports bitsandbytes, whose
# CPU ops are wrapped in torch.compile at import: that alone loads inductor, ~2 s of every
# one of the suite's ~150 process starts. Tests (and the processes they start) skip it.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

#: A small, fast, deterministic run: 12 steps, checkpoints at 4, 8, 12.
FAST = [
    "--train.max_steps",
    "12",
    "--train.batch_size",
    "4",
    "--train.num_threads",
    "1",
    "--train.warmup_steps",
    "2",
    "--checkpoint.every_steps",
    "4",
    "--checkpoint.keep",
    "3",
    "--data.max_length",
    "32",
    "--data.eval",
    "",
]


#: Fixtures that start real processes or servers: a test using one is end-to-end.
PROCESS_FIXTURES = frozenset(
    {"cli", "reference", "reference_run", "ddp_ref", "s3_server", "slurm_cluster"}
)


#: The files that take longest in CI, longest first (fresh-clone `.ci/run`, 2-core VM,
#: 2026-12-06: 350 s of test time down to about 60). CI's workers take a file at a time
#: in collection order (`--dist loadfile --no-loadscope-reorder`), so the long ones start
#: first and the short ones fill the end, instead of a two-minute file starting last.
LONGEST_FIRST = (
    "test_fsdp_qlora.py",
    "test_distributed.py",
    "test_resume_exact.py",
    "test_s3_storage.py",
    "test_multinode.py",
    "test_preempt_cloud_run.py",
    "test_early_errors.py",
    "test_rundir_lock.py",
    "test_data_e2e.py",
    "test_gguf.py",
    "test_launch.py",
    "test_slurm.py",
    "test_training_options.py",
    "test_outputs.py",
    "test_preference_run.py",
    "test_checkpoint_trust.py",
    "test_infer_budget.py",
    "test_ledger.py",
    "test_chaos.py",
    "test_report.py",
)


#: Last of all, when the other workers run short tests: the watchdog's tests time a job's
#: start-up phases (its first wave of two fresh-clone CI runs, 2026-12-06, took its ranks
#: past a 20 s setup budget), and the default job runs on every core (its threads are
#: the default's: 341 s in the first wave, 126 s at the end).
LAST = ("test_watchdog.py", "test_default_run.py")


def _file_rank(item: pytest.Item) -> int:
    name = item.path.name
    if name in LAST:
        return len(LONGEST_FIRST) + 1 + LAST.index(name)
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark end-to-end tests (``-m "not e2e"`` is the sub-minute loop): those that use a
    process-starting fixture; modules that start processes themselves say so with
    ``pytestmark = pytest.mark.e2e``. Then put the longest files first (a stable sort:
    each file's tests keep their order, the other files theirs)."""
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)
    items.sort(key=_file_rank)


def sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def read_events(out: Path) -> list[dict[str, Any]]:
    p = out / "events.jsonl"
    if not p.exists():
        return []
    recs = []
    for line in p.read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return recs


def state_digest(out: Path, step: int) -> dict[str, str]:
    """sha256 of everything that defines the training state at ``step``, plus the final adapter."""
    ck = out / "checkpoints" / f"step-{step:08d}"
    d = {
        name: sha256(ck / name)
        for name in ("adapter.safetensors", "optimizer.safetensors", "rng_rank0.safetensors")
    }
    d["final/adapter_model.safetensors"] = sha256(out / "final" / "adapter_model.safetensors")
    return d


class CLI:
    """Runs ``python -m shoestring ...`` with a shared model cache and fixed threads."""

    def __init__(self, cache: Path) -> None:
        self.cache = cache

    def env(self, **extra: str) -> dict[str, str]:
        # WANDB_SERVICE: set in this process by any in-process wandb.init (test_track.py);
        # a child that inherits it joins this process's wandb-core instead of starting its
        # own, so a SIGKILLed attempt's run stays open there and the next attempt's
        # wandb.init of the same id is merged into it.
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("SHOESTRING_") and k != "WANDB_SERVICE"
        }
        env.update(
            SHOESTRING_CACHE=str(self.cache),
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(REPO / "src"),
            TOKENIZERS_PARALLELISM="false",
        )
        env.update(extra)
        return env

    def cmd(self, out: Path, *args: str, verb: str = "finetune") -> list[str]:
        return [sys.executable, "-m", "shoestring", verb, "--output_dir", str(out), *args]

    def run(
        self, out: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.cmd(out, *args),
            env=self.env(**(env or {})),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def start(
        self, out: Path, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.cmd(out, *args),
            env=self.env(**(env or {})),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )


def wait_for_step(out: Path, step: int, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(e.get("event") == "step" and e["step"] >= step for e in read_events(out)):
            return
        if proc.poll() is not None:
            raise AssertionError(
                f"process exited {proc.returncode} before step {step}:\n"
                f"{proc.stdout.read() if proc.stdout else ''}"
            )
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout}s")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from shoestring.train.builtin import materialize_tiny_model

    d = tmp_path_factory.mktemp("model-cache")
    materialize_tiny_model(d)
    return d


@pytest.fixture(scope="session")
def cli(cache_dir: Path) -> CLI:
    return CLI(cache_dir)


@pytest.fixture(scope="session")
def reference_run(cli: CLI, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output directory of the uninterrupted FAST run."""
    out = tmp_path_factory.mktemp("reference") / "run"
    r = cli.run(out, *FAST)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="session")
def reference(reference_run: Path) -> dict[str, str]:
    """The uninterrupted FAST run's state digest at step 12."""
    return state_digest(reference_run, 12)


#: Global batch 8 in micro-batches of 2: 4 accumulated micro-batches at world size 1,
#: 2 per rank at world size 2 — the same chunks, so the same dropout masks.
DIST = [*FAST, "--train.batch_size", "8", "--train.micro_batch_size", "2"]


def run_job(
    cli: CLI,
    out: Path,
    nproc: int,
    *args: str,
    restarts: int = 0,
    env: dict[str, str] | None = None,
    run_args: tuple[str, ...] = (),
    run_dir: bool = True,
) -> subprocess.CompletedProcess[str]:
    """``shoestring run --nproc-per-node N ... -- shoestring finetune --output_dir OUT ARGS``
    (``run_dir=False``: without ``--run-dir OUT``, which run then finds itself)."""
    cmd = [
        sys.executable,
        "-m",
        "shoestring",
        "run",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(restarts),
        *(["--run-dir", str(out)] if run_dir else []),
        *run_args,
        "--",
        sys.executable,
        "-m",
        "shoestring",
        "finetune",
        "--output_dir",
        str(out),
        *args,
    ]
    r = subprocess.run(cmd, env=cli.env(**(env or {})), capture_output=True, text=True, timeout=600)
    return r


@pytest.fixture(scope="session")
def ddp_ref(cli: CLI, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ddp") / "ref"
    r = run_job(cli, out, 2, *DIST)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


__all__ = [
    "CLI",
    "DIST",
    "FAST",
    "read_events",
    "run_job",
    "sha256",
    "signal",
    "state_digest",
    "wait_for_step",
]
