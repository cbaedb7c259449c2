"""One object per way of running: a single process, DDP, or FSDP2.

The training loop never asks which strategy it runs under. Everything that
differs lives here: where the base model is loaded and how it is wrapped, the
gradient no-sync context, the checkpoint format (one process: files through
the commit protocol; several: DCP shards sealed by rank 0), the three restore
paths, who evaluates, how the per-step agreement works, and how the adapter is
gathered for export.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from shoestring.checkpoint import (
    NO_FAULTS,
    FaultPlan,
    FileWriter,
    RemoteStore,
    SaveRequest,
    Writer,
    load_files,
)
from shoestring.checkpoint.faults import Extra, Skip
from shoestring.checkpoint.manifest import CorruptCheckpoint, Manifest
from shoestring.checkpoint.sharded import ShardedWriter, is_sharded
from shoestring.config import ConfigError
from shoestring.distributed import ProcessGroups, barrier, broadcast_object
from shoestring.events import EventLog
from shoestring.preempt import PreemptionFlag
from shoestring.train import parallel
from shoestring.train import state as S
from shoestring.train.config import CheckpointConfig, FinetuneConfig, ResolvedConfig, dtype_of
from shoestring.train.export import export_adapter, export_merged, export_merged_from
from shoestring.train.learner import Learner

StrategyName = Literal["single", "ddp", "fsdp"]
ConfigCheck = Callable[[Mapping[str, Any]], None]


def _ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


class Strategy(Protocol):
    name: StrategyName
    #: Whether this process's model holds every weight (False: FSDP2 shards; an export
    #: of the whole model then starts from ``final/`` and a freshly loaded base).
    whole_model: bool
    device: torch.device
    rank: int
    world_size: int
    #: The one rank that reads the base for every rank (FSDP2: the others start on the
    #: meta device and receive their shards); None: each rank reads its own.
    base_reader: int | None

    def load_device(self) -> str: ...
    def load_fields(self) -> dict[str, Any]: ...
    def wrap(self, model: Any, comm_hook: Any) -> torch.nn.Module: ...
    def grad_sync(self, wrapped: torch.nn.Module, last: bool) -> AbstractContextManager[None]: ...
    def make_writer(
        self,
        root: Path,
        c: CheckpointConfig,
        events: EventLog,
        remote: RemoteStore | None,
        faults: FaultPlan,
    ) -> Writer: ...
    def save(
        self,
        writer: Any,
        learner: Learner,
        progress: S.Progress,
        *,
        reason: str,
        sync: bool,
        config: Mapping[str, Any],
        meta: Mapping[str, Any],
    ) -> None: ...
    def restore(
        self, path: Path, manifest: Manifest, learner: Learner, check: ConfigCheck
    ) -> tuple[S.Progress, bool]: ...
    def all_agree(self, ok: bool) -> bool: ...
    def evaluates_here(self) -> bool: ...
    def eval_stop(self, flag: PreemptionFlag) -> Callable[[], bool]: ...
    def stop_requested(self, flag: PreemptionFlag) -> bool: ...
    def agree(self, loss: torch.Tensor, flag: PreemptionFlag, faults: FaultPlan) -> float: ...
    def share(self, obj: Any) -> Any: ...
    def barrier(self) -> None: ...
    def export(self, learner: Learner, tok: Any, out: Path) -> Path: ...
    def export_merged(
        self,
        learner: Learner,
        final: Path,
        model_dir: Path,
        cfg: FinetuneConfig,
        tok: Any,
        out: Path,
    ) -> Path: ...


class SingleDevice:
    """One process on one device. Checkpoints are plain files; it can also load a
    sharded (DCP) checkpoint that several ranks wrote."""

    name: StrategyName = "single"
    whole_model = True
    rank = 0
    world_size = 1
    checkpoint_group: Any = None
    base_reader: int | None = None

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def load_device(self) -> str:
        return str(self.device)

    def load_fields(self) -> dict[str, Any]:
        """What wrapping added to the ``load`` event (the shards one reader sent)."""
        return {}

    def wrap(self, model: Any, comm_hook: Any) -> torch.nn.Module:
        return model  # type: ignore[no-any-return]

    def grad_sync(self, wrapped: torch.nn.Module, last: bool) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def make_writer(
        self,
        root: Path,
        c: CheckpointConfig,
        events: EventLog,
        remote: RemoteStore | None,
        faults: FaultPlan = NO_FAULTS,
    ) -> Writer:
        return FileWriter(
            root, keep=c.keep, mode=c.async_mode, events=events, remote=remote, faults=faults
        )

    def save(
        self,
        writer: Writer,
        learner: Learner,
        progress: S.Progress,
        *,
        reason: str,
        sync: bool,
        config: Mapping[str, Any],
        meta: Mapping[str, Any],
    ) -> None:
        t0 = time.perf_counter()
        snap = S.capture(progress, learner, rank=0, config=config, meta=meta)
        req = SaveRequest.files(snap, capture_ms=_ms_since(t0))
        writer.submit(req, reason=reason, sync=sync)

    def restore(
        self, path: Path, manifest: Manifest, learner: Learner, check: ConfigCheck
    ) -> tuple[S.Progress, bool]:
        """Returns the progress and whether this rank found its own RNG streams."""
        if is_sharded(manifest.files):
            import json

            check(json.loads((path / S.STATE).read_text())["config"])
            return S.restore_sharded(path, learner, rank=self.rank, group=self.checkpoint_group)
        names = [
            n for n in manifest.files if not n.startswith("rng_rank") or n == S.rng_file(self.rank)
        ]
        with unloadable_as_corrupt(path):
            tensors, docs = load_files(path, names)
            config = docs[S.STATE]["config"]
        check(config)
        with unloadable_as_corrupt(path):
            progress = self._restore_files(tensors, docs, learner)
        return progress, S.rng_file(self.rank) in tensors

    def all_agree(self, ok: bool) -> bool:
        """Whether every rank says ``ok`` (one rank here)."""
        return ok

    def _restore_files(self, tensors: Any, docs: Any, learner: Learner) -> S.Progress:
        return S.restore(tensors, docs, learner, rank=self.rank)

    def evaluates_here(self) -> bool:
        return True

    def eval_stop(self, flag: PreemptionFlag) -> Callable[[], bool]:
        return flag.is_set

    def stop_requested(self, flag: PreemptionFlag) -> bool:
        return flag.is_set()

    def agree(self, loss: torch.Tensor, flag: PreemptionFlag, faults: FaultPlan) -> float:
        return float(loss)

    def share(self, obj: Any) -> Any:
        return obj

    def barrier(self) -> None:
        pass

    def export(self, learner: Learner, tok: Any, out: Path) -> Path:
        return export_adapter(learner.model, tok, out)

    def export_merged(
        self,
        learner: Learner,
        final: Path,
        model_dir: Path,
        cfg: FinetuneConfig,
        tok: Any,
        out: Path,
    ) -> Path:
        return export_merged(learner.model, tok, out)


class _Distributed(SingleDevice):
    """What DDP and FSDP2 share: DCP checkpoints, the per-step agreement, broadcasts."""

    def __init__(self, device: torch.device, groups: ProcessGroups) -> None:
        super().__init__(device)
        self.rank, self.world_size = groups.env.rank, groups.env.world_size
        self.checkpoint_group = groups.checkpoint_group
        self._agreed_stop = False  # the flag as all ranks saw it in the last agreement

    def make_writer(
        self,
        root: Path,
        c: CheckpointConfig,
        events: EventLog,
        remote: RemoteStore | None,
        faults: FaultPlan = NO_FAULTS,
    ) -> Writer:
        return ShardedWriter(
            root,
            rank=self.rank,
            group=self.checkpoint_group,
            keep=c.keep,
            mode="off" if c.async_mode == "off" else "thread",
            events=events,
            remote=remote,
            faults=faults,
        )

    def save(
        self,
        writer: Writer,
        learner: Learner,
        progress: S.Progress,
        *,
        reason: str,
        sync: bool,
        config: Mapping[str, Any],
        meta: Mapping[str, Any],
    ) -> None:
        t0 = time.perf_counter()
        state = S.dcp_state(learner)
        own = S.rank_files(
            progress, learner, rank=self.rank, world_size=self.world_size, config=config
        )
        req = SaveRequest.sharded(progress.step, state, own, meta, capture_ms=_ms_since(t0))
        writer.submit(req, reason=reason, sync=sync)

    def stop_requested(self, flag: PreemptionFlag) -> bool:
        """What every rank agreed on in this step's all-reduce, not the live flag: a
        watcher or signal can raise one rank's flag just after it; reading it live, that
        rank would leave while the others train on into a collective that never ends."""
        return self._agreed_stop

    def agree(self, loss: torch.Tensor, flag: PreemptionFlag, faults: FaultPlan) -> float:
        """One small all-reduce per step: the global loss, and whether any rank was told
        to stop (so every rank stops after the same step and saves together)."""
        import torch.distributed as dist

        t = torch.stack(
            [
                loss.to(torch.float64).reshape(()),
                torch.tensor(
                    1.0 if flag.is_set() else 0.0, dtype=torch.float64, device=loss.device
                ),
            ]
        )
        fault = faults.hit("step.agree")
        if isinstance(fault, Skip):  # injected: this rank leaves the collective out
            return float(loss)
        if isinstance(fault, Extra):  # injected: an additional, mis-shaped collective
            dist.all_reduce(torch.zeros(3, dtype=torch.float64, device=self.device))
        dist.all_reduce(t)
        total, stop = t.tolist()
        self._agreed_stop = stop > 0
        if self._agreed_stop and not flag.is_set():
            flag.set("peer")
        return float(total)

    def share(self, obj: Any) -> Any:
        return broadcast_object(obj)

    def all_agree(self, ok: bool) -> bool:
        """Whether every rank says ``ok``: one all-reduce (min) on the process group."""
        import torch.distributed as dist

        t = torch.tensor(1.0 if ok else 0.0, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item() > 0)

    def barrier(self) -> None:
        barrier()


class DDPStrategy(_Distributed):
    """Every rank holds the whole (LoRA) model; DDP averages the adapters' gradients.
    Rank 0 evaluates alone on the unwrapped model."""

    name: StrategyName = "ddp"

    def wrap(self, model: Any, comm_hook: Any) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [self.device.index] if self.device.type == "cuda" else None
        # Decoder LMs have no running-stat buffers (rotary tables are constants), so
        # skip DDP's per-forward buffer broadcast: one collective less per micro-batch.
        ddp = DDP(model, device_ids=ids, forward_sync_buffers=False)
        if comm_hook is not None:  # the watchdog traces every gradient all-reduce
            ddp.register_comm_hook(None, comm_hook)
        return ddp

    @contextlib.contextmanager
    def grad_sync(self, wrapped: torch.nn.Module, last: bool) -> Iterator[None]:
        with contextlib.nullcontext() if last else wrapped.no_sync():  # type: ignore[operator]
            yield

    def evaluates_here(self) -> bool:
        return self.rank == 0

    def export(self, learner: Learner, tok: Any, out: Path) -> Path:
        return super().export(learner, tok, out) if self.rank == 0 else out / "final"


class FSDPStrategy(_Distributed):
    """Weights, gradients and optimizer state sharded per decoder layer (FSDP2). The
    base loads on the CPU; sharding moves each rank's shards to its device. An nf4
    base (``quantize``) is sharded as its packed bytes viewed in ``dtype``, its quant
    states kept on the modules (:mod:`shoestring.train.shard4bit`). With several ranks,
    rank 0 alone reads the base; the others build it on the meta device and receive
    their shards while wrapping (:mod:`shoestring.train.onereader`; ``one_reader=False``,
    or ``cpu_offload``: every rank reads the whole base)."""

    name: StrategyName = "fsdp"
    whole_model = False

    def __init__(
        self,
        device: torch.device,
        groups: ProcessGroups,
        *,
        dtype: torch.dtype = torch.float32,
        quantize: str = "none",
        cpu_offload: bool = False,
        one_reader: bool = True,
    ) -> None:
        super().__init__(device, groups)
        self.dtype, self.quantize, self.cpu_offload = dtype, quantize, cpu_offload
        # cpu_offload keeps the shards in host memory and the buffers on the GPU: the
        # meta start would need both placed by hand, unverified without GPUs (not built).
        if one_reader and self.world_size > 1 and not cpu_offload:
            from shoestring.train.onereader import READER

            self.base_reader = READER
        self._load_fields: dict[str, Any] = {}

    def load_device(self) -> str:
        return "cpu"

    def load_fields(self) -> dict[str, Any]:
        return self._load_fields

    def wrap(self, model: Any, comm_hook: Any) -> torch.nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        from shoestring.train.onereader import SharedBase

        if self.quantize == "nf4":
            from shoestring.train.shard4bit import make_shardable

            make_shardable(model, self.dtype, self.device)
        shared = None if self.base_reader is None else SharedBase.capture(model, self.all_agree)
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        offload = CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()
        for layer in parallel.decoder_layers(model):
            fully_shard(layer, mesh=mesh, offload_policy=offload)
        fully_shard(model, mesh=mesh, offload_policy=offload)
        if shared is not None:  # the non-readers' shards are still on the meta device
            self._load_fields = shared.fill(model, self.device)
        return model  # type: ignore[no-any-return]  # fully_shard swapped its class in place

    @contextlib.contextmanager
    def grad_sync(self, wrapped: torch.nn.Module, last: bool) -> Iterator[None]:
        wrapped.set_requires_gradient_sync(last)  # type: ignore[operator]
        try:
            yield
        finally:
            wrapped.set_requires_gradient_sync(True)  # type: ignore[operator]

    def _restore_files(self, tensors: Any, docs: Any, learner: Learner) -> S.Progress:
        # A single-process checkpoint: full tensors in, each rank keeps its shard.
        return S.restore_full(tensors, docs, learner)

    def eval_stop(self, flag: PreemptionFlag) -> Callable[[], bool]:
        # Every rank evaluates in lockstep (each forward needs every rank's shards):
        # abort only on the agreed flag, or one rank would leave the others waiting.
        return lambda: self._agreed_stop

    def export(self, learner: Learner, tok: Any, out: Path) -> Path:
        state = parallel.full_adapter_state(learner.wrapped)  # a collective: every rank
        if self.rank != 0:
            return out / "final"
        return export_adapter(learner.model, tok, out, state_dict=state)

    def export_merged(
        self,
        learner: Learner,
        final: Path,
        model_dir: Path,
        cfg: FinetuneConfig,
        tok: Any,
        out: Path,
    ) -> Path:
        # The in-memory model holds only shards: merge onto a freshly loaded base
        # (quantized again, as trained: bnb's quantizer is deterministic on one device kind).
        return export_merged_from(model_dir, final, cfg.model, tok, out, cfg.lora.quantize)


@contextlib.contextmanager
def unloadable_as_corrupt(path: Path) -> Iterator[None]:
    """A verified checkpoint whose bytes are not a state this job can load — a file
    that does not parse, a tensor or key the trainer state lacks, a tensor of another
    shape — is :class:`CorruptCheckpoint` (the resume falls back to an older one), not
    a crash on every rerun. A config that does not match stays a ConfigError, and an
    out-of-memory stays what it is."""
    from safetensors import SafetensorError

    try:
        yield
    except (ConfigError, torch.OutOfMemoryError):
        raise
    except (SafetensorError, KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        raise CorruptCheckpoint(f"{path}: cannot load it: {type(e).__name__}: {e}") from e


def make_strategy(cfg: ResolvedConfig, groups: ProcessGroups | None) -> Strategy:
    """The strategy for this process, on its concrete ``train.device``."""
    device = torch.device(cfg.train.device)
    if groups is None:
        return SingleDevice(device)
    if groups.backend == "nccl" and device.type != "cuda":
        raise ConfigError(
            f"distributed.backend nccl needs train.device cuda, got {cfg.train.device}"
        )
    kind = cfg.distributed.strategy
    check_fsdp_options(cfg, device)
    if kind == "ddp":
        return DDPStrategy(device, groups)
    if kind == "fsdp":
        return FSDPStrategy(
            device,
            groups,
            dtype=getattr(torch, dtype_of(cfg)),
            quantize=cfg.lora.quantize,
            cpu_offload=cfg.distributed.cpu_offload,
        )
    raise ConfigError(f"distributed.strategy: unknown strategy {kind!r} (ddp|fsdp)")


def check_fsdp_options(cfg: FinetuneConfig, device: torch.device) -> None:
    """What FSDP2 cannot do, refused before any weights load."""
    fsdp = cfg.distributed.strategy == "fsdp"
    if fsdp and cfg.lora.quantize == "int8":
        raise ConfigError(
            "lora.quantize: int8 (LLM.int8) weights keep their row scales on the "
            "parameter, which FSDP2 replaces when it shards; use lora.quantize nf4 with "
            "distributed.strategy fsdp, or ddp (each rank holds the int8 base)"
        )
    if fsdp and cfg.train.optimizer != "adamw":
        raise ConfigError(
            f"train.optimizer: {cfg.train.optimizer} (bitsandbytes) cannot step FSDP2's "
            "sharded (DTensor) parameters; use adamw with distributed.strategy fsdp (its "
            "state is sharded over the ranks already)"
        )
    if cfg.distributed.cpu_offload and not fsdp:
        raise ConfigError("distributed.cpu_offload: needs distributed.strategy fsdp")
    if cfg.distributed.cpu_offload and device.type != "cuda":
        raise ConfigError(
            "distributed.cpu_offload: needs train.device cuda (on "
            f"{device.type} the shards already live in host memory)"
        )
