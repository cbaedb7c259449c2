"""Opening a run: the cheap input checks, then the spine every rank stands on.

:class:`Inputs` is everything that can fail on bad input without loading weights.
:func:`open_run` joins the process group (if any), picks the strategy, prepares
the run directory (run id, config.yaml, stale temp dirs), and opens the event
log, the checkpoint writer, the watchdog's recorder, the signal handlers and the
cloud-notice watcher — closing them in reverse order, whatever happens.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoestring.checkpoint import NO_FAULTS, FaultPlan, RemoteStore, Writer
from shoestring.checkpoint.attemptlog import AttemptLog
from shoestring.checkpoint.local import clean_stale
from shoestring.config import ConfigError, to_yaml
from shoestring.distributed import DistEnv, ProcessGroups
from shoestring.events import EventLog, rotate
from shoestring.fsio import atomic_write
from shoestring.hub import HubAccess, ModelRef
from shoestring.preempt import PreemptionFlag, SignalSource, cloud_watcher
from shoestring.rundir import RunDir
from shoestring.train.config import FinetuneConfig, ResolvedConfig
from shoestring.train.dataset import DataInputs
from shoestring.train.device import Accelerator
from shoestring.train.model import (
    check_fused_base,
    check_stored_quantization,
    require_bitsandbytes,
    resolve_base,
)
from shoestring.train.objective import check_objective
from shoestring.train.parallel import BatchPlan
from shoestring.train.strategy import Strategy, make_strategy
from shoestring.watch.recorder import NullRecorder, Recorder, StartupBeacon


@dataclass
class RunOptions:
    """Run control that is not part of the (resume-checked) config."""

    resume: str = "auto"
    faults: FaultPlan = field(default_factory=lambda: NO_FAULTS)
    cache_dir: Path = Path.home() / ".cache" / "shoestring"
    tty: bool | None = None
    flag: PreemptionFlag | None = None
    dist: DistEnv = field(default_factory=DistEnv)
    accelerator: Accelerator | None = None  # None: probe this machine
    # Given by the CLI layer, so the trainer imports neither the planner nor the views:
    # the memory plan's ``plan`` event fields (raises ConfigError when it will not fit) and,
    # at a clean finish, the cost ledger's ``cost`` event fields and one summary line.
    preflight: Callable[[FinetuneConfig, Path, int], dict[str, Any] | None] | None = None
    ledger: Callable[[Path], tuple[dict[str, Any], str]] | None = None
    process_start: float | None = None  # epoch seconds, read by the CLI (``start`` event)
    hub: HubAccess | None = None  # how model ids and bucket URLs are fetched (the CLI's)

    def hub_access(self) -> HubAccess:
        return self.hub or HubAccess(self.cache_dir)


@dataclass(frozen=True)
class Inputs:
    """The base model (resolved: downloaded if it is a Hub id or a bucket URL; None for
    the built-in one), the data (sources, template, parsed records), the batch split
    and the checkpoint store, checked before anything is written or loaded."""

    data: DataInputs
    batch: BatchPlan
    remote: RemoteStore | None
    model: ModelRef | None = None

    @classmethod
    def prepare(
        cls, cfg: FinetuneConfig, dist: DistEnv, cache_dir: Path, hub: HubAccess | None = None
    ) -> Inputs:
        check_objective(cfg)
        if cfg.lora.quantize != "none":
            require_bitsandbytes("lora.quantize")
        if cfg.train.optimizer != "adamw":
            require_bitsandbytes("train.optimizer")
        batch = BatchPlan.make(
            cfg.train.batch_size, cfg.train.micro_batch_size, dist.world_size, dist.rank
        )
        model = resolve_base(cfg.model, hub or HubAccess(cache_dir))
        if model is not None:
            check_stored_quantization(model.path, cfg.lora.quantize)
            check_fused_base(model.path, cfg.model, cfg.lora, cfg.distributed.strategy)
        if cfg.export.gguf != "none":
            from shoestring.train.ggufexport import check_exportable

            # model_type and tokenizer, before any training
            check_exportable(cfg, model.path if model is not None else None)
        tokenizer_dir = str(model.path) if model is not None else cfg.model.path
        data = DataInputs.prepare(cfg, cache_dir, tokenizer_dir)
        return cls(data, batch, _remote_store(cfg, dist.rank), model)


def data_cache_storage(cfg: FinetuneConfig) -> str | None:
    """Where the tokenized cache is published: ``data.cache_storage``, else next to the
    remote checkpoints (``<checkpoint.storage>/data-cache``), else nowhere."""
    if cfg.data.cache_storage:
        return cfg.data.cache_storage
    storage = cfg.checkpoint.storage
    return f"{storage.rstrip('/')}/data-cache" if storage else None


def _remote_store(cfg: FinetuneConfig, rank: int) -> RemoteStore | None:
    storage = cfg.checkpoint.storage
    local = RunDir(Path(cfg.output_dir)).checkpoints
    if not storage or Path(storage).expanduser().resolve() == local.resolve():
        return None
    remote = RemoteStore(storage)
    if rank == 0:
        try:
            remote.check()
        except (OSError, ValueError) as e:
            raise ConfigError(f"checkpoint.storage: cannot use {storage!r}: {e}") from e
    return remote


@dataclass
class Run:
    """The open spine of one rank's run."""

    cfg: FinetuneConfig
    opts: RunOptions
    out: Path
    strategy: Strategy
    flag: PreemptionFlag
    events: EventLog
    writer: Writer
    rec: Recorder | NullRecorder
    remote: RemoteStore | None
    #: rank 0 with checkpoint.storage: this attempt's records mirrored to the bucket
    attempts: AttemptLog | None = None

    def publish_events(self, every_s: float = 0.0) -> None:
        """Copy this attempt's records to checkpoint.storage (a start, a save, the end;
        after a step, ``every_s`` since the last copy)."""
        if self.attempts is not None and self.attempts.due(every_s):
            self.events.sync()
            self.attempts.push()

    @property
    def dir(self) -> RunDir:
        return RunDir(self.out)

    @property
    def faults(self) -> FaultPlan:
        return self.opts.faults


def _run_id(rd: RunDir) -> str:
    """The run's stable id: read from run.json, or created with it on the first start."""
    existing = rd.run_id()
    if existing is not None:
        return existing
    rid = uuid.uuid4().hex[:12]
    atomic_write(rd.run_json, json.dumps({"run_id": rid, "created": time.time()}).encode())
    return rid


def _prepare_dir(cfg: FinetuneConfig, out: Path, strategy: Strategy, model: ModelRef | None) -> str:
    """Rank 0 creates the run directory (run.json also says where the base model came
    from); every rank gets the run id."""
    run_id = ""
    if strategy.rank == 0:
        rd = RunDir(out)
        out.mkdir(parents=True, exist_ok=True)
        run_id = _run_id(rd)
        if model is not None:
            rd.record(model=model.record())
        clean_stale(rd.checkpoints)
        for log_file in rd.event_files():  # no one writes them yet: start new segments
            rotate(log_file, int(cfg.events_rotate_mb * 2**20))
        atomic_write(rd.config_yaml, to_yaml(cfg).encode())
    return str(strategy.share(run_id))


@contextlib.contextmanager
def _process_group(cfg: FinetuneConfig, opts: RunOptions) -> Iterator[ProcessGroups | None]:
    """The process groups of a distributed run; also of one process with
    ``distributed.strategy fsdp`` (FSDP2 over a mesh of one: with its CPU offload, one
    GPU trains a base whose shards live in host RAM). None for a plain process."""
    dist = opts.dist
    if not (dist.is_distributed or cfg.distributed.strategy == "fsdp"):
        yield None
        return
    opts.faults.hit("start.init")  # a rank stuck before it joins the group
    beacon = (
        StartupBeacon(Path(cfg.output_dir), dist.rank, dist.world_size)
        if cfg.watch.enabled
        else contextlib.nullcontext()
    )
    with beacon, ProcessGroups(dist, cfg.distributed.backend, cfg.distributed.timeout_s) as groups:
        yield groups


@contextlib.contextmanager
def open_run(
    cfg: ResolvedConfig,
    opts: RunOptions,
    remote: RemoteStore | None,
    model: ModelRef | None = None,
) -> Iterator[Run]:
    """``model``: the resolved base (recorded in run.json)."""
    out, dist = Path(cfg.output_dir), opts.dist
    flag = opts.flag or PreemptionFlag()
    with contextlib.ExitStack() as stack:
        groups = stack.enter_context(_process_group(cfg, opts))
        strategy = make_strategy(cfg, groups)
        run_id = _prepare_dir(cfg, out, strategy, model)
        attempts = (
            AttemptLog.open(remote, RunDir(out), run_id)
            if remote is not None and strategy.rank == 0
            else None
        )
        # Rank 0 owns events.jsonl; other ranks log beside it (the watchdog reads those).
        events = EventLog(RunDir(out).rank_events(dist.rank), run_id=run_id, rank=dist.rank)
        stack.callback(events.close)
        # The attempt begins when the process did: its load time counts (report, ledger).
        events.emit("start", process_start=opts.process_start, pid=os.getpid())
        writer = strategy.make_writer(
            RunDir(out).checkpoints, cfg.checkpoint, events, remote, opts.faults
        )
        stack.callback(writer.close)
        w = cfg.watch
        rec: Recorder | NullRecorder = (
            Recorder(
                out,
                dist.rank,
                world_size=dist.world_size,
                interval_s=w.interval_s,
                faults=opts.faults,
            )
            if w.enabled
            else NullRecorder()
        )
        stack.enter_context(SignalSource(flag, cfg.preempt.signal))
        stack.enter_context(
            cloud_watcher(cfg.preempt, flag, events.emit, local_rank=dist.local_rank)
        )
        stack.enter_context(rec)
        stack.enter_context(rec.trace_collectives())
        yield Run(cfg, opts, out, strategy, flag, events, writer, rec, remote, attempts)
