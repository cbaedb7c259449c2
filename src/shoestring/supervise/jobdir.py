"""Where ``shoestring run`` watches a job when no ``--run-dir`` is given.

The watchdog, hang verdicts and straggler alarms need the ranks' run directory:
they read the live state each rank publishes there. For a ``shoestring finetune``
command that directory is the job's ``output_dir``, so it is read from the
command itself — its flags, its ``--config`` file and the defaults, parsed exactly
as ``finetune`` will parse them. Any other command publishes nothing a watchdog
could read, so it runs unwatched unless ``--run-dir`` names where it writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

_PYTHONS = ("python", "python3")


def finetune_args(command: Sequence[str]) -> list[str] | None:
    """The arguments after ``finetune`` when COMMAND runs ``shoestring finetune``
    (``shoestring finetune ...``, ``/path/to/shoestring finetune ...``,
    ``python -m shoestring finetune ...``); None for any other command."""
    cmd = list(command)
    if len(cmd) >= 2 and Path(cmd[0]).name == "shoestring" and cmd[1] == "finetune":
        return cmd[2:]
    is_python = Path(cmd[0]).name.startswith(_PYTHONS) if cmd else False
    if is_python and cmd[1:4] == ["-m", "shoestring", "finetune"]:
        return cmd[4:]
    return None


def job_run_dir(command: Sequence[str], cwd: Path) -> Path | None:
    """The ``output_dir`` a ``shoestring finetune`` COMMAND will write (absolute), or
    None for another command. A finetune command with bad flags is left to fail
    in ``finetune`` itself, with its own message: it is not watched here."""
    from shoestring.config import ConfigError, build, iter_fields, parse_command_line, read_yaml
    from shoestring.train.config import FinetuneConfig, FinetuneOptions

    args = finetune_args(command)
    if args is None:
        return None
    try:
        parsed = parse_command_line(args, FinetuneConfig, also=FinetuneOptions)
        layers = read_yaml(parsed.config_file) if parsed.config_file else []
        option_keys = {key for key, _f, _tp in iter_fields(FinetuneOptions)}
        layers += [layer for layer in parsed.layers if layer[0] not in option_keys]
        cfg = build(FinetuneConfig, layers)
    except (ConfigError, OSError):
        return None
    return (cwd / cfg.output_dir).resolve()
