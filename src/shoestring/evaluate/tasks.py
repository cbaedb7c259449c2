"""lm-eval's task index, and task names checked against it before anything loads."""

from __future__ import annotations

from typing import Any

from shoestring.config import ConfigError


def task_manager(names: list[str], include_path: str) -> Any:
    """An lm-eval ``TaskManager`` that knows every name in ``names``. The custom folder
    alone is indexed first (the built-in index takes seconds to build); the built-in
    tasks are added when a name is not among the folder's. Unknown names are refused,
    each named (a ConfigError, exit 2)."""
    from lm_eval.tasks import TaskManager

    if include_path:
        own = TaskManager(include_path=include_path, include_defaults=False)
        if not _unknown(own, names):
            return own
    manager = TaskManager(include_path=include_path or None)
    unknown = _unknown(manager, names)
    if unknown:
        where = f" nor in --include-path {include_path}" if include_path else ""
        raise ConfigError(
            f"--tasks: unknown task(s) {', '.join(unknown)}: not among lm-eval's tasks{where} "
            "(list them with: lm-eval ls tasks)"
        )
    return manager


def _unknown(manager: Any, names: list[str]) -> list[str]:
    """The names that match no task, group or tag (globs may match several)."""
    matched = set(manager.match_tasks(names))
    return [n for n in names if n not in matched and "*" not in n]
