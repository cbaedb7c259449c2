"""The ``report`` and ``top`` verbs of the ``shoestring`` command: their configs and
runners (registered in :data:`shoestring.cli.VERBS`)."""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from shoestring.config import ConfigError, Invocation, knob, positive

Color = Literal["auto", "always", "never"]


@dataclass
class ReportConfig:
    """``shoestring report RUN_DIR``."""

    run_dir: str = knob(
        "",
        "The run's output_dir (the positional RUN_DIR), or its checkpoint.storage URL: the "
        "event logs every attempt left there (a managed spot job's, shoestring launch) are "
        "copied into ./<last part of the URL>.report/ and reported from there.",
    )
    output: str = knob("", "Where to write the HTML (-o; empty: RUN_DIR/report.html).")


@dataclass
class TopConfig:
    """``shoestring top RUN_DIR``."""

    run_dir: str = knob("", "The run's output_dir (the positional RUN_DIR).")
    once: bool = knob(False, "Print one frame and exit (for scripts and pipes).")
    interval: float = knob(1.0, "Seconds between refreshes.", check=positive)
    color: Color = knob("auto", "ANSI colours ('auto': when writing to a terminal).")


def run_report(cfg: ReportConfig, call: Invocation) -> int:
    from shoestring.report.html import write_report
    from shoestring.report.timeline import event_files, load

    run_dir = _from_bucket(cfg.run_dir) if "://" in cfg.run_dir else _run_dir(cfg.run_dir, "report")
    if not event_files(run_dir):
        raise ConfigError(f"{run_dir}: no events.jsonl here (is it a run's output_dir?)")
    tl = load(run_dir)
    out = write_report(run_dir, cfg.output or None, timeline=tl)
    skipped = f"; {tl.skipped_lines} unreadable line(s) skipped" if tl.skipped_lines else ""
    print(f"report: {out} ({len(tl.events)} events from {len(tl.sources)} file(s){skipped})")
    return 0


def run_top(cfg: TopConfig, call: Invocation) -> int:
    from shoestring.report.top import run_top as loop

    run_dir = _run_dir(cfg.run_dir, "top")
    tty = sys.stdout.isatty()
    env = call.env
    color = cfg.color == "always" or (
        cfg.color == "auto" and tty and env.get("NO_COLOR") is None and env.get("TERM") != "dumb"
    )
    return loop(
        run_dir,
        once=cfg.once,
        interval_s=cfg.interval,
        color=color,
        width=lambda: shutil.get_terminal_size((120, 40)).columns,
    )


def _from_bucket(url: str) -> Path:
    """A local run directory holding the attempts' event logs found under ``url``."""
    from shoestring.checkpoint.attemptlog import fetch_attempts
    from shoestring.secrets import redact_url

    local = Path(f"{url.rstrip('/').rsplit('/', 1)[-1] or 'bucket'}.report")
    try:
        got = fetch_attempts(url, local)
    except (OSError, ValueError, RuntimeError) as e:
        raise ConfigError(f"RUN_DIR: cannot read {redact_url(url)}: {e}") from None
    if not got:
        raise ConfigError(f"RUN_DIR: no event logs under {redact_url(url)}/events/")
    print(f"report: {len(got)} attempt log(s) from {redact_url(url)} in {local}/attempts/")
    return local


def _run_dir(arg: str, verb: str) -> Path:
    if not arg:
        raise ConfigError(f"RUN_DIR: missing (usage: shoestring {verb} RUN_DIR [options])")
    d = Path(arg)
    if not d.is_dir():
        raise ConfigError(f"{d}: not a directory")
    return d
