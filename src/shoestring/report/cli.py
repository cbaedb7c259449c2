"""The ``report`` and ``top`` verbs of the ``shoestring`` command (parsers and runners
registered in :data:`shoestring.cli.COMMANDS`)."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from shoestring.config import ConfigError


def report_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "report", help="write one self-contained HTML report of a run directory",
        description="Merge the event logs of every rank and attempt in RUN_DIR and write one "
                    "HTML file (inline SVG plots, no network needed to view it): summary, "
                    "timeline of attempts, restarts, preemptions, checkpoints and alarms, "
                    "step time per rank, communication share, loss, alarms and hang "
                    "verdicts, checkpoints, host/GPU metrics when sampled.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's output_dir")
    p.add_argument("--output", "-o", metavar="PATH",
                   help="where to write the HTML (default: RUN_DIR/report.html)")
    return p


def run_report(args: argparse.Namespace, rest: list[str], env: dict[str, str]) -> int:
    from shoestring.report.html import write_report
    from shoestring.report.timeline import event_files, load

    run_dir = _run_dir(args.run_dir, rest)
    if not event_files(run_dir):
        raise ConfigError(f"{run_dir}: no events.jsonl here (is it a run's output_dir?)")
    tl = load(run_dir)
    out = write_report(run_dir, args.output, timeline=tl)
    skipped = f"; {tl.skipped_lines} unreadable line(s) skipped" if tl.skipped_lines else ""
    print(f"report: {out} ({len(tl.events)} events from {len(tl.sources)} file(s){skipped})")
    return 0


def top_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "top", help="live terminal view of a run: ranks, phases, step times, alarms",
        description="Follow RUN_DIR (events.jsonl and the ranks' live.json) and redraw every "
                    "INTERVAL seconds: per rank its status, phase, step, step time (last and "
                    "median), time since its last step, the collective it waits in and its "
                    "alarms; the job's attempt, restarts and last checkpoint. Reads files "
                    "only; never touches the training processes. Ctrl-C to leave.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's output_dir")
    p.add_argument("--once", action="store_true",
                   help="print one frame and exit (for scripts and pipes)")
    p.add_argument("--interval", type=float, default=1.0, metavar="S",
                   help="seconds between refreshes (default 1)")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="ANSI colours (default: when writing to a terminal)")
    return p


def run_top(args: argparse.Namespace, rest: list[str], env: dict[str, str]) -> int:
    from shoestring.report.top import run_top as loop

    run_dir = _run_dir(args.run_dir, rest)
    if args.interval <= 0:
        raise ConfigError(f"--interval: must be > 0, got {args.interval}")
    tty = sys.stdout.isatty()
    color = args.color == "always" or (args.color == "auto" and tty and env.get("NO_COLOR") is None
                                       and env.get("TERM") != "dumb")
    return loop(run_dir, once=args.once,
                interval_s=args.interval, color=color,
                width=lambda: shutil.get_terminal_size((120, 40)).columns)


def _run_dir(arg: str, rest: list[str]) -> Path:
    if rest:
        raise ConfigError(f"unexpected arguments: {' '.join(rest)}")
    d = Path(arg)
    if not d.is_dir():
        raise ConfigError(f"{d}: not a directory")
    return d
