"""A Prometheus endpoint for the job, served by ``shoestring run`` (prometheus-client).

The supervisor already reads every rank's live snapshot, window and metric
sample; :class:`JobState` keeps the latest of each and a custom collector turns
them into metric families at scrape time, so ranks that disappear simply stop
being reported. One endpoint per job, bound to 127.0.0.1 unless told
otherwise; the training processes serve nothing.

Metric names are stable (documented in docs/events.md). Every series carries
``job`` and ``host``; per-rank series carry ``rank``; per-GPU series ``gpu``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

RANK_LABELS = ("job", "host", "rank")


class JobState:
    """The latest view of the job, updated by the watchdog thread."""

    def __init__(self, job: str, host: str) -> None:
        self.job, self.host = job, host
        self._lock = threading.Lock()
        self.snaps: dict[int, dict[str, Any]] = {}
        self.windows: dict[int, dict[str, Any]] = {}
        self.metrics: dict[str, Any] = {}
        self.alarms: dict[tuple[str, str], int] = {}
        self.attempt = 0
        self.restarts = 0

    def update(
        self,
        *,
        snaps: dict[int, dict[str, Any]] | None = None,
        windows: list[dict[str, Any]] | None = None,
        metrics: dict[str, Any] | None = None,
    ) -> None:
        with self._lock:
            if snaps is not None:
                self.snaps = dict(snaps)
            for w in windows or ():
                self.windows[int(w["rank"])] = w
            if metrics is not None:
                self.metrics = metrics

    def alarm(self, kind: str, rank: Any) -> None:
        key = (kind, "" if rank is None else str(rank))
        with self._lock:
            self.alarms[key] = self.alarms.get(key, 0) + 1

    def new_attempt(self, attempt: int) -> None:
        with self._lock:
            self.attempt = attempt
            self.restarts = attempt
            self.snaps, self.windows = {}, {}

    def copy(self) -> dict[str, Any]:
        with self._lock:
            return {
                "snaps": dict(self.snaps),
                "windows": dict(self.windows),
                "metrics": dict(self.metrics),
                "alarms": dict(self.alarms),
                "attempt": self.attempt,
                "restarts": self.restarts,
            }


class JobCollector:
    """prometheus-client collector over a :class:`JobState`."""

    def __init__(self, state: JobState, clock: Any = time.time) -> None:
        self.state, self._clock = state, clock

    def collect(self) -> Iterator[Any]:
        st = self.state.copy()
        labels = (self.state.job, self.state.host)
        yield from self._rank_families(st["snaps"], labels, self._clock())
        yield from self._window_families(st["windows"], labels)
        yield from self._process_families(st["metrics"].get("ranks") or {}, labels)
        yield from self._gpu_families(st["metrics"].get("gpus") or (), labels)
        yield from self._counter_families(st, labels)

    @staticmethod
    def _rank_families(snaps: dict[int, Any], labels: tuple[str, str], now: float) -> list[Any]:
        up = _gauge("shoestring_rank_up", "1 while the rank publishes fresh live state")
        step = _gauge("shoestring_step", "Last finished optimizer step of the rank")
        since = _gauge(
            "shoestring_seconds_in_phase",
            "Seconds the rank has been in its current phase",
            RANK_LABELS + ("phase",),
        )
        p50 = _gauge("shoestring_step_seconds_p50", "Median train-step time of the rank")
        p99 = _gauge("shoestring_step_seconds_p99", "p99 train-step time of the rank")
        open_c = _gauge("shoestring_open_collectives", "Collectives the rank is waiting in")
        for r, s in sorted(snaps.items()):
            lab = [*labels, str(r)]
            up.add_metric(lab, 1.0 if now - float(s.get("ts", 0)) < 15 else 0.0)
            step.add_metric(lab, float(s.get("step", 0)))
            since.add_metric(
                lab + [str(s.get("phase", ""))], max(0.0, now - float(s.get("phase_start", now)))
            )
            stats = (s.get("stats") or {}).get("train_step")
            if stats:
                p50.add_metric(lab, float(stats["p50"]))
                p99.add_metric(lab, float(stats["p99"]))
            open_c.add_metric(lab, float(len(s.get("open_collectives") or [])))
        return [up, step, since, p50, p99, open_c]

    @staticmethod
    def _window_families(windows: dict[int, Any], labels: tuple[str, str]) -> list[Any]:
        tps = _gauge(
            "shoestring_tokens_per_second",
            "Training throughput of the rank in the "
            "last window (tokens per second of train-step time)",
        )
        comm = _gauge(
            "shoestring_comm_seconds_per_step", "Time in collectives per step, last window"
        )
        share = _gauge(
            "shoestring_comm_share", "Share of train-step time spent in collectives, last window"
        )
        for r, w in sorted(windows.items()):
            lab = [*labels, str(r)]
            tps.add_metric(lab, float(w["tokens_per_s"]))
            comm.add_metric(lab, float(w["comm_s_per_step"]))
            share.add_metric(lab, float(w["comm_share"]))
        return [tps, comm, share]

    @staticmethod
    def _process_families(ranks: dict[int, Any], labels: tuple[str, str]) -> list[Any]:
        cpu = _gauge("shoestring_process_cpu_percent", "CPU use of the rank's process")
        rss = _gauge("shoestring_process_resident_bytes", "Resident memory of the rank's process")
        rd = _counter(
            "shoestring_process_read_bytes", "Bytes read by the rank's process", RANK_LABELS
        )
        wr = _counter(
            "shoestring_process_written_bytes", "Bytes written by the rank's process", RANK_LABELS
        )
        for r, p in sorted(ranks.items()):
            lab = [*labels, str(r)]
            if "cpu_pct" in p:
                cpu.add_metric(lab, float(p["cpu_pct"]))
            rss.add_metric(lab, float(p["rss_bytes"]))
            if "read_bytes" in p:
                rd.add_metric(lab, float(p["read_bytes"]))
                wr.add_metric(lab, float(p["write_bytes"]))
        return [cpu, rss, rd, wr]

    @staticmethod
    def _gpu_families(gpus: Any, labels: tuple[str, str]) -> list[Any]:
        fams = {
            k: _gauge(f"shoestring_gpu_{k}", doc, ("job", "host", "gpu"))
            for k, doc in (
                ("util_pct", "GPU utilisation %"),
                ("mem_used_bytes", "GPU memory used"),
                ("mem_total_bytes", "GPU memory total"),
                ("sm_clock_mhz", "SM clock"),
                ("clock_event_reasons", "NVML clock event (throttle) reasons bitmask"),
                ("temp_c", "GPU temperature"),
                ("power_w", "GPU power draw"),
            )
        }
        for g in gpus:
            for k, fam in fams.items():
                if k in g:
                    fam.add_metric([*labels, str(g["gpu"])], float(g[k]))
        return list(fams.values())

    @staticmethod
    def _counter_families(st: dict[str, Any], labels: tuple[str, str]) -> list[Any]:
        alarms = _counter(
            "shoestring_alarms", "Alarms raised by the watchdog", ("job", "host", "kind", "rank")
        )
        for (kind, rank), n in sorted(st["alarms"].items()):
            alarms.add_metric([*labels, kind, rank], float(n))
        restarts = _counter("shoestring_restarts", "Restarts of the job", ("job", "host"))
        restarts.add_metric(list(labels), float(st["restarts"]))
        return [alarms, restarts]


def _gauge(name: str, doc: str, labels: tuple[str, ...] = RANK_LABELS) -> Any:
    from prometheus_client.core import GaugeMetricFamily

    return GaugeMetricFamily(name, doc, labels=list(labels))


def _counter(name: str, doc: str, labels: tuple[str, ...]) -> Any:
    from prometheus_client.core import CounterMetricFamily

    return CounterMetricFamily(name, doc, labels=list(labels))


class PrometheusExporter:
    """Serve a :class:`JobState` on ``addr:port`` (port 0: any free port)."""

    def __init__(self, state: JobState, port: int, addr: str = "127.0.0.1") -> None:
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError as e:
            raise ImportError(
                "--prometheus-port needs prometheus-client: pip install 'shoestring[watch]'"
            ) from e
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(JobCollector(state))
        self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        self.addr, self.port = addr, int(self._server.server_port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
