"""The restart loop of ``shoestring run``.

Each attempt runs the launch command as a child in its own process group. A
clean exit ends the run; any other exit (a crash, a killed rank, a preemption
exit 75 of a job that should continue here) starts the next attempt, up to
``max_restarts``; the job itself resumes from its last committed checkpoint.
A signal to the supervisor (the machine is being taken away) is forwarded to
the job, and the supervisor then exits with the job's code without restarting.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Any

from shoestring import exitcodes
from shoestring.config import ConfigError, Invocation
from shoestring.events import EventLog
from shoestring.proc import parent_death_signal
from shoestring.rundir import RunDir
from shoestring.supervise.config import RunConfig, SlurmRequeue
from shoestring.supervise.jobdir import job_run_dir
from shoestring.supervise.launch import LaunchSpec, Nodes, launch_argv, launch_env
from shoestring.supervise.peers import lost_peers, summary
from shoestring.supervise.slurm import requeue_after_signal
from shoestring.watch.alerts import Alerts, AlertSink, CallbackSink, StderrSink, WebhookSink
from shoestring.watch.degrade import DegradePolicy
from shoestring.watch.exporter import JobState, PrometheusExporter
from shoestring.watch.flight import (
    TracePaths,
    collect_traces,
    flight_recorder_env,
    installed_torch_version,
)
from shoestring.watch.hang import HangPolicy, Verdict
from shoestring.watch.straggler import StragglerPolicy
from shoestring.watch.watchdog import Watchdog

log = logging.getLogger("shoestring.run")

#: The end of the log an attempt's ``preempt`` record is looked for in (it is among the
#: last records a preempted job writes).
PREEMPT_TAIL_BYTES = 4 << 20

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


@dataclass(frozen=True)
class SupervisorConfig:
    max_restarts: int = 3
    backoff_s: float = 1.0
    run_dir: Path | None = None
    watch: bool = True  # needs run_dir: the ranks publish their live state under it
    hang: HangPolicy = HangPolicy()
    stragglers: StragglerPolicy = StragglerPolicy()
    degrade: DegradePolicy = DegradePolicy()
    metrics_interval_s: float = 10.0  # 0: no host/GPU metric samples
    job: str = "job"  # the `job` label of alerts and Prometheus series
    prometheus_port: int | None = None  # None: no endpoint; 0: any free port
    prometheus_addr: str = "127.0.0.1"
    webhook: str | None = None
    slurm_requeue: SlurmRequeue = "auto"  # see slurm.requeue_after_signal
    # On a hang, at most this long for the ranks' NCCL flight-recorder dumps before the kill
    # (0: do not ask; nothing is waited for either when no rank has a dump pipe, e.g. gloo).
    nccl_dump_wait_s: float = 5.0
    keep_verdicts: int = 20  # hang verdicts kept in RUN_DIR/verdicts (older ones deleted)

    @classmethod
    def from_run(cls, cfg: RunConfig, env: Mapping[str, str]) -> SupervisorConfig:
        """The supervisor's settings from ``shoestring run``'s config (the one place)."""
        run_dir = Path(cfg.run_dir) if cfg.run_dir else None
        job = (
            cfg.job_id or env.get("SLURM_JOB_ID") or (run_dir.resolve().name if run_dir else "job")
        )
        return cls(
            max_restarts=cfg.max_restarts,
            run_dir=run_dir,
            watch=cfg.watch,
            hang=HangPolicy(
                multiple=cfg.hang_multiple,
                floor_s=cfg.hang_floor,
                first_timeout_s=cfg.first_phase_timeout,
            ),
            stragglers=StragglerPolicy(threshold=cfg.straggler_threshold),
            degrade=DegradePolicy(
                window_s=cfg.window, comm_rise=cfg.comm_rise, throughput_drop=cfg.throughput_drop
            ),
            metrics_interval_s=cfg.metrics_interval,
            job=job,
            prometheus_port=cfg.prometheus_port,
            prometheus_addr=cfg.prometheus_addr,
            # From the environment, a webhook's token stays out of job scripts and argv.
            webhook=cfg.alert_webhook or env.get("SHOESTRING_ALERT_WEBHOOK") or None,
            slurm_requeue=cfg.slurm_requeue,
            nccl_dump_wait_s=cfg.nccl_dump_wait,
            keep_verdicts=cfg.keep_verdicts,
        )


class Supervisor:
    def __init__(self, argv: list[str], cfg: SupervisorConfig, env: Mapping[str, str]) -> None:
        self.argv, self.cfg, self.env = argv, cfg, dict(env)
        # The ranks' environment: the flight recorder on, dumps and pipes under the run dir.
        self.child_env = (
            dict(env)
            if cfg.run_dir is None
            else flight_recorder_env(env, cfg.run_dir, installed_torch_version())
        )
        self._child: subprocess.Popen[bytes] | None = None
        self._signalled: int | None = None
        self._hung: Verdict | None = None
        self._lost: dict[int, dict[str, Any]] = {}  # ranks of other nodes lost with the attempt
        host = os.uname().nodename
        self.state = JobState(cfg.job, host)
        sinks: list[AlertSink] = [CallbackSink(self._emit_alarm), StderrSink(cfg.job)]
        if cfg.webhook:
            sinks.append(WebhookSink(cfg.webhook, cfg.job, host))
        self.alerts = Alerts(sinks)
        self.exporter: PrometheusExporter | None = None
        self._sampler: Any = None

    def _events(self) -> EventLog | None:
        if self.cfg.run_dir is None:
            return None
        rd = RunDir(self.cfg.run_dir)
        return EventLog(rd.events, run_id=rd.run_id() or "supervisor", rank=-1)

    def _emit(self, event: str, **fields: object) -> None:
        # Opened per record and only between attempts: rank 0 owns the file while a job runs.
        ev = self._events()
        if ev is not None:
            with ev:
                ev.emit(event, **fields)

    def _emit_alarm(self, kind: str, fields: dict[str, Any]) -> None:
        if kind != "hang":  # the hang record is written by _on_hang, with the verdict file
            self._emit(kind, **fields)

    def _on_alarm(self, kind: str, fields: dict[str, Any]) -> None:
        """An alarm that does not stop the job (a straggler, a degradation): every sink."""
        self.state.alarm(fields.get("kind", kind), fields.get("rank"))
        self.alerts(kind, fields)

    def _on_record(self, event: str, fields: dict[str, Any]) -> None:
        """A periodic record (``window``, ``metrics``): event log and the Prometheus view."""
        if event == "window":
            self.state.update(windows=[fields])
        elif event == "metrics":
            self.state.update(metrics=fields)
        self._emit(event, **fields)

    def _on_hang(self, verdict: Verdict) -> None:
        """Record the verdict, then kill the whole job hard (a hung rank cannot take part
        in an orderly emergency save); the restart loop takes it from there."""
        self._hung = verdict
        rec = verdict.to_json()
        assert self.cfg.run_dir is not None
        vdir = RunDir(self.cfg.run_dir).verdicts
        vdir.mkdir(parents=True, exist_ok=True)
        stem = f"hang-{int(time.time() * 1000)}"
        self._attach_nccl_traces(rec, f"{stem}.")
        path = vdir / f"{stem}.json"
        path.write_text(json.dumps(rec, indent=1))
        pruned = prune_verdicts(vdir, self.cfg.keep_verdicts)
        if pruned:
            log.info("deleted %d old hang verdict(s) (--keep-verdicts)", len(pruned))
        ev = self._events()
        if ev is not None:
            with ev:
                ev.emit(
                    "hang",
                    **{k: v for k, v in rec.items() if k != "ranks"},
                    verdict_file=str(path),
                    ranks={
                        r: {k: v for k, v in d.items() if k != "stacks"}
                        for r, d in rec["ranks"].items()
                    },
                )
        log.error("HANG: %s (verdict with stacks: %s); killing the job", verdict.summary, path)
        self.state.alarm("hang", ",".join(map(str, verdict.culprits)))
        self.alerts(
            "hang",
            {
                "summary": verdict.summary,
                "culprits": verdict.culprits,
                "verdict_kind": verdict.kind,
                "collective": verdict.collective,
                "detected_after_s": round(verdict.detected_after_s, 3),
                "verdict_file": str(path),
            },
        )
        self._kill_job(verdict)

    def _kill_job(self, verdict: Verdict) -> None:
        """SIGKILL the verdict's ranks on this host, everything below the launcher, and
        the launcher's process group. Only this host's ranks: with several nodes every
        supervisor watches every rank, and a pid in another node's snapshot names some
        unrelated process here."""
        pids = {
            int(info["pid"])
            for info in verdict.ranks.values()
            if info.get("pid") and info.get("host") == self.state.host
        }
        child = self._child
        if child is not None and child.poll() is None:
            # Every process below the launcher too: torchrun may start ranks in sessions of
            # their own, and a rank the verdict cannot name (one that never started) has no
            # pid in it; killing torchrun alone would orphan those.
            import psutil

            try:
                pids |= {p.pid for p in psutil.Process(child.pid).children(recursive=True)}
            except psutil.Error:
                pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if child is not None and child.poll() is None:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _attach_nccl_traces(self, rec: dict[str, Any], keep_prefix: str) -> None:
        """The ranks' NCCL flight-recorder dumps into the verdict record (``nccl_traces``),
        while the ranks still live; bounded by ``nccl_dump_wait_s``, never raises."""
        t0 = time.monotonic()
        try:
            traces = collect_traces(
                TracePaths.from_env(self.child_env), self.cfg.nccl_dump_wait_s, keep_prefix
            )
        except Exception as e:  # noqa: BLE001 - the verdict and the kill come first
            rec["nccl_trace_error"] = f"{type(e).__name__}: {e}"
            return
        if traces:
            rec["nccl_traces"] = traces
            log.info(
                "NCCL flight recorder: %d of %d rank(s) dumped in %.1fs",
                sum(1 for t in traces.values() if t.get("path")),
                len(traces),
                time.monotonic() - t0,
            )
            for r, t in traces.items():
                log.info("NCCL rank %s: %s", r, t.get("summary") or t.get("nccl_trace_error"))

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        """Pass the signal to the job once per process: its process group, plus ranks
        that torchrun started in sessions of their own (found by their live state)."""
        if self._signalled is None:  # the first signal decides (a warning, then a kill)
            self._signalled = signum
        child = self._child
        if child is None or child.poll() is not None:
            return
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            pass
        if self.cfg.run_dir is None or signum not in (signal.SIGUSR1, signal.SIGUSR2):
            return  # torchrun forwards SIGTERM/SIGINT to its workers itself
        for snap in self.state.copy()["snaps"].values():
            try:
                pid = int(snap["pid"])
                if snap.get("host") == os.uname().nodename and os.getpgid(pid) != child.pid:
                    os.kill(pid, signum)
            except (KeyError, ValueError, ProcessLookupError, PermissionError):
                pass

    def run(self) -> int:
        previous = {s: signal.signal(s, self._forward) for s in FORWARDED}
        if self.cfg.prometheus_port is not None:
            self.exporter = PrometheusExporter(
                self.state, self.cfg.prometheus_port, self.cfg.prometheus_addr
            )
            log.info(
                "Prometheus metrics on http://%s:%d/metrics", self.exporter.addr, self.exporter.port
            )
        try:
            rc = self._loop()
            self._cost_line()
            return rc
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            self.alerts.close()
            if self._sampler is not None:
                self._sampler.close()
            if self.exporter is not None:
                self.exporter.close()

    def _cost_line(self) -> None:
        """The run's cost ledger over all attempts, one line on stderr."""
        if self.cfg.run_dir is None or not (RunDir(self.cfg.run_dir).events).exists():
            return
        from shoestring.report.ledger import stream_ledger

        try:
            log.info("%s", stream_ledger(self.cfg.run_dir).one_line())
        except Exception as e:  # noqa: BLE001 - the ledger must not change the exit code
            log.warning("cost ledger unavailable: %s", e)

    def _job_preempted(self, since: float) -> bool:
        """Did rank 0 of this attempt log a committed emergency checkpoint?"""
        if self.cfg.run_dir is None or not (RunDir(self.cfg.run_dir).events).exists():
            return False
        from shoestring.events import read_events

        return any(
            e.get("event") == "preempt" and e.get("saved") and e.get("ts", 0) >= since
            for e in read_events(RunDir(self.cfg.run_dir).events, tail_bytes=PREEMPT_TAIL_BYTES)
        )

    def _watchdog(self) -> Watchdog:
        from shoestring.watch.metrics import MetricsSampler

        assert self.cfg.run_dir is not None
        if self._sampler is None and self.cfg.metrics_interval_s > 0:
            self._sampler = MetricsSampler()
        return Watchdog(
            self.cfg.run_dir,
            self.cfg.hang,
            self._on_hang,
            on_alarm=self._on_alarm,
            on_record=self._on_record,
            on_snapshots=lambda snaps: self.state.update(snaps=snaps),
            stragglers=self.cfg.stragglers,
            degrade=self.cfg.degrade,
            sampler=self._sampler,
            metrics_interval_s=self.cfg.metrics_interval_s or 1e9,
        )

    def _loop(self) -> int:
        attempt = 0
        while True:
            rc = self._attempt(attempt)
            verdict = self._after_attempt(attempt, rc)
            if verdict is not None:
                return verdict
            attempt += 1
            log.warning(
                "job exited %d; restart %d/%d from the last checkpoint",
                rc,
                attempt,
                self.cfg.max_restarts,
            )
            self._emit(
                "restart",
                attempt=attempt,
                exit_code=rc,
                reason=self._restart_reason(rc),
                host=self.state.host,
            )
            time.sleep(self.cfg.backoff_s)

    def _attempt(self, attempt: int) -> int:
        """Run the job once (watched when there is a run dir); its exit code."""
        t0, started = time.monotonic(), time.time()
        self._emit("attempt_start", attempt=attempt, argv=self.argv, host=self.state.host)
        self.state.new_attempt(attempt)
        self._hung = None
        if self.cfg.run_dir is not None:  # torch needs them for its FIFOs and dump files
            for sub in ("ranks", "verdicts"):
                (self.cfg.run_dir / sub).mkdir(parents=True, exist_ok=True)
        self._child = subprocess.Popen(
            self.argv,
            env=self.child_env,
            start_new_session=True,
            preexec_fn=functools.partial(
                _child_setup, parent_death_signal(os.getpid(), signal.SIGHUP)
            ),
        )
        if self.cfg.watch and self.cfg.run_dir is not None:
            with self._watchdog():
                rc = self._child.wait()
        else:
            rc = self._child.wait()
        self._child = None
        self._lost = self._lost_peers(rc, started)
        if rc not in (0, exitcodes.PREEMPTED, exitcodes.PREEMPTED_HARD) and self._job_preempted(
            started
        ):
            rc = exitcodes.PREEMPTED  # torchrun reports a rank's exit 75 as 1
        wall = round(time.monotonic() - t0, 3)
        self._emit(
            "attempt_end",
            attempt=attempt,
            exit_code=rc,
            wall_s=wall,
            hung=self._hung is not None,
            host=self.state.host,
        )
        return rc

    def _lost_peers(self, rc: int, since: float) -> dict[int, dict[str, Any]]:
        """After a failed attempt: the ranks of other nodes that vanished with it (a node
        killed, gone or frozen), reported as a ``peer_lost`` alarm; nothing on one node."""
        if rc == 0 or self._hung is not None or self._signalled is not None:
            return {}
        if self.cfg.run_dir is None:
            return {}
        lost = lost_peers(self.cfg.run_dir, since, self.state.host)
        if lost:
            self.state.alarm("peer_lost", ",".join(map(str, lost)))
            self.alerts(
                "peer_lost",
                {
                    "summary": summary(lost) + "; a restart resumes once every node "
                    "has rejoined the rendezvous",
                    "ranks": {str(r): v for r, v in lost.items()},
                    "hosts": sorted({str(v["host"]) for v in lost.values()}),
                    "exit_code": rc,
                },
            )
        return lost

    def _restart_reason(self, rc: int) -> str:
        if self._hung is not None:
            return "hang"
        return "peer_lost" if self._lost else _reason(rc)

    def _after_attempt(self, attempt: int, rc: int) -> int | None:
        """The supervisor's exit code when this attempt ends the run; None to restart."""
        if rc == 0:
            return exitcodes.OK
        if self._signalled is not None:
            log.warning(
                "stopped by signal %d; job exited %d; not restarting here", self._signalled, rc
            )
            # Inside a Slurm job the way back is a requeue (same job id), not a restart.
            requeue_after_signal(
                self.cfg.slurm_requeue, self.env, self._signalled, rc, emit=self._emit
            )
            return (
                rc if rc in (exitcodes.PREEMPTED, exitcodes.PREEMPTED_HARD) else exitcodes.PREEMPTED
            )
        if rc == exitcodes.USAGE:
            log.error("the job rejected its config (exit 2); restarting cannot help")
            return rc
        if attempt >= self.cfg.max_restarts:
            log.error("job failed with exit %d after %d restart(s); giving up", rc, attempt)
            self._emit("gave_up", attempts=attempt + 1, exit_code=rc)
            return rc if rc > 0 else exitcodes.FAILED
        return None


_VERDICT_RE = re.compile(r"^(hang-\d+)\.")


def prune_verdicts(vdir: Path, keep: int) -> list[str]:
    """Keep the newest ``keep`` hang verdicts: ``hang-<ms>.json`` and every file that
    shares its ``hang-<ms>.`` prefix (the NCCL dumps kept with it). Returns the stems
    deleted."""
    groups: dict[str, list[Path]] = {}
    for p in vdir.iterdir() if vdir.is_dir() else ():
        m = _VERDICT_RE.match(p.name)
        if m and p.is_file():
            groups.setdefault(m.group(1), []).append(p)
    stems = sorted(groups, key=lambda s: int(s.split("-", 1)[1]), reverse=True)
    doomed = stems[max(keep, 0) :]
    for stem in doomed:
        for p in groups[stem]:
            p.unlink(missing_ok=True)
    return doomed


def _reason(rc: int) -> str:
    if rc == exitcodes.PREEMPTED:
        return "preempted"
    if rc < 0:
        return f"killed by {signal.Signals(-rc).name}"
    return "failed"


def _child_setup(arm_death_signal: Callable[[], None]) -> None:
    """In the child before exec (both survive it):

    * SIGUSR1/SIGUSR2 ignored. torchrun has no handler for them and would die of a
      forwarded warning, orphaning its ranks; a shoestring rank installs its own
      handler, which replaces the inherited disposition. The supervisor forwards the
      warning to the ranks itself.
    * SIGHUP when the supervisor dies (a SIGKILL, the OOM killer): the job is
      preempted as by a cloud notice instead of training on, unwatched, holding the
      run directory. A shoestring rank saves and exits 75; torchrun stops its ranks
      with SIGTERM, and they do the same. (Not SIGTERM: the kernel sends the signal
      once per thread the dead supervisor had, and a second SIGTERM means "exit now,
      without saving".)
    """
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    # Heard even under a `nohup shoestring run`: the job has a session of its own, so no
    # terminal hangs up on it; its only SIGHUP is this one.
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    arm_death_signal()


def supervise(cfg: RunConfig, call: Invocation) -> int:
    """``shoestring run``: launch ``cfg.command`` (through torchrun for several ranks) and
    restart it on failure."""
    if not cfg.command:
        raise ConfigError("run: no COMMAND given (usage: shoestring run [options] -- COMMAND ...)")
    nodes = Nodes.resolve(cfg, call.env)
    argv = launch_argv(LaunchSpec(tuple(cfg.command), cfg.nproc_per_node, nodes))
    env = launch_env(nodes, call.env)
    if not cfg.run_dir and cfg.watch:
        found = job_run_dir(cfg.command, Path.cwd())
        if found is None:
            log.warning(
                "not watching: COMMAND is not `shoestring finetune`; give --run-dir (where "
                "its ranks publish) to watch it, or --no-watch to silence this"
            )
        else:
            cfg = replace(cfg, run_dir=str(found))
    return Supervisor(argv, SupervisorConfig.from_run(cfg, env), env).run()
