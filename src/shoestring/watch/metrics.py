"""GPU and host metrics of the ranks, sampled from outside the training processes.

``shoestring run`` samples at a fixed interval, so the training loop pays
nothing for it: per rank process (found by the pid in its live snapshot) CPU
use, resident memory and I/O bytes through psutil; per GPU, when NVML is
available (``pip install nvidia-ml-py`` and an NVIDIA driver), utilisation,
memory used/total, SM clock, clock-event (throttle) reasons, temperature and
power, and which rank's process holds memory on it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("shoestring.watch")


def _psutil() -> Any:
    try:
        import psutil
    except ImportError as e:  # pragma: no cover - psutil is a dependency
        raise ImportError("host metrics need psutil: pip install psutil") from e
    return psutil


class ProcessSampler:
    """CPU %, RSS and I/O counters of each rank's process (psutil)."""

    def __init__(self) -> None:
        self._ps = _psutil()
        self._procs: dict[int, Any] = {}
        self._ps.cpu_percent(None)  # start the host CPU interval

    def sample(self, pids: Mapping[int, int]) -> dict[int, dict[str, Any]]:
        """``{rank: {...}}`` for the given ``{rank: pid}``; ranks whose process is gone
        are left out."""
        ps = self._ps
        out: dict[int, dict[str, Any]] = {}
        for rank, pid in pids.items():
            proc = self._procs.get(pid)
            try:
                first = proc is None
                if proc is None:
                    proc = self._procs[pid] = ps.Process(pid)
                with proc.oneshot():
                    rec: dict[str, Any] = {
                        "pid": pid,
                        "rss_bytes": proc.memory_info().rss,
                        "threads": proc.num_threads(),
                    }
                    cpu = proc.cpu_percent(None)
                    if not first:  # the first call only starts psutil's interval
                        rec["cpu_pct"] = cpu
                    try:
                        io = proc.io_counters()
                        rec.update(read_bytes=io.read_bytes, write_bytes=io.write_bytes)
                    except (ps.AccessDenied, AttributeError, NotImplementedError):
                        pass
                out[rank] = rec
            except (ps.NoSuchProcess, ps.ZombieProcess, ps.AccessDenied):
                self._procs.pop(pid, None)
        for pid in set(self._procs) - set(pids.values()):
            del self._procs[pid]
        return out

    def host(self) -> dict[str, Any]:
        ps = self._ps
        vm = ps.virtual_memory()
        return {
            "cpu_pct": ps.cpu_percent(None),
            "mem_used_bytes": vm.total - vm.available,
            "mem_total_bytes": vm.total,
            "load1": ps.getloadavg()[0],
        }


class GpuSampler:
    """NVML device metrics. ``available`` is False without the library or a driver."""

    def __init__(self) -> None:
        self.available = False
        self._nv: Any = None
        self._handles: list[Any] = []
        try:
            import pynvml
        except ImportError:
            return
        try:
            pynvml.nvmlInit()
            self._handles = [
                pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
            ]
        except pynvml.NVMLError as e:
            log.debug("NVML unavailable: %s", e)
            return
        self._nv, self.available = pynvml, bool(self._handles)

    def sample(self, pid_rank: Mapping[int, int]) -> list[dict[str, Any]]:
        """One record per GPU; ``ranks`` lists the ranks whose process uses it."""
        nv = self._nv
        out: list[dict[str, Any]] = []
        for i, h in enumerate(self._handles):
            rec: dict[str, Any] = {"gpu": i}
            for key, fn in (
                ("util_pct", lambda h=h: nv.nvmlDeviceGetUtilizationRates(h).gpu),
                ("mem_util_pct", lambda h=h: nv.nvmlDeviceGetUtilizationRates(h).memory),
                ("mem_used_bytes", lambda h=h: nv.nvmlDeviceGetMemoryInfo(h).used),
                ("mem_total_bytes", lambda h=h: nv.nvmlDeviceGetMemoryInfo(h).total),
                ("sm_clock_mhz", lambda h=h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
                ("clock_event_reasons", lambda h=h: _clock_reasons(nv, h)),
                ("temp_c", lambda h=h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
                ("power_w", lambda h=h: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
            ):
                try:
                    rec[key] = fn()
                except nv.NVMLError:
                    pass  # not every board reports every field
            try:
                procs = nv.nvmlDeviceGetComputeRunningProcesses(h)
                rec["ranks"] = sorted(pid_rank[p.pid] for p in procs if p.pid in pid_rank)
            except nv.NVMLError:
                pass
            out.append(rec)
        return out

    def close(self) -> None:
        if self.available:
            try:
                self._nv.nvmlShutdown()
            except self._nv.NVMLError:
                pass
            self.available = False


def _clock_reasons(nv: Any, h: Any) -> int:
    fn = (
        getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
        or nv.nvmlDeviceGetCurrentClocksThrottleReasons
    )
    return int(fn(h))


class MetricsSampler:
    """Both samplers behind one call: the watchdog's periodic ``metrics`` record."""

    def __init__(self) -> None:
        self.procs = ProcessSampler()
        self.gpus = GpuSampler()

    def sample(self, pids: Mapping[int, int]) -> dict[str, Any]:
        rec: dict[str, Any] = {
            "host": self.procs.host(),
            "ranks": {str(r): v for r, v in self.procs.sample(pids).items()},
        }
        if self.gpus.available:
            rec["gpus"] = self.gpus.sample({pid: r for r, pid in pids.items()})
        return rec

    def close(self) -> None:
        self.gpus.close()
