"""Event records → tracker rows: the ONE place that decides what a tracker shows.

Sinks only render :class:`TrackerRow` s. Events not listed in :data:`EVENTS` produce
nothing. Scalar names: ``train/<field>``, ``eval/<tag>/<metric>``,
``checkpoint/<field>``, ``cost/<field>``, ``system/<field>`` (``shoestring run``'s host
and GPU samples).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: Fields every record carries; not part of any row.
ENVELOPE = frozenset({"v", "ts", "event", "run_id", "rank"})
#: ``run_start`` fields that change on every attempt: not config.
RUN_START_VOLATILE = frozenset({"step", "pid"})
#: Preference tuning's metrics (``train.objective dpo|orpo|simpo``), named as TRL names them.
PREFERENCE_FIELDS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
    "logps/accuracies",
)
#: GRPO's step metrics (``train.objective grpo``), named as TRL names them; each reward
#: function adds ``rewards/<name>/mean`` (:data:`REWARD_PREFIX`).
GRPO_FIELDS = (
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/clipped_ratio",
    "kl",
)
REWARD_PREFIX = "rewards/"
STEP_FIELDS = (
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "cuda_peak_bytes",
    *PREFERENCE_FIELDS,
    *GRPO_FIELDS,
)
EVAL_FIELDS = ("loss", "perplexity", "exact_match", *PREFERENCE_FIELDS, *GRPO_FIELDS)
CHECKPOINT_FIELDS = ("blocking_ms", "bytes", "background_ms")
COST_FIELDS = (
    "usd",
    "on_demand_usd",
    "wall_hours",
    "device_hours",
    "recompute_hours",
    "restart_hours",
    "checkpoint_hours",
    "overhead_hours",
    "steps",
    "steps_recomputed",
    "attempts",
    "preemptions",
    "failures",
)


@dataclass(frozen=True)
class TrackerRow:
    """What one record shows. ``step`` None: "the current step" (the tracker fills it).

    ``scalars``: numeric series at ``step``. ``texts``: notes by tag (``events``,
    ``cost``). ``alarm``: a message worth an alert (kind = ``event``). ``config``: flat
    run configuration (params). ``final``: flat end-of-run summary (``final/...``,
    ``cost/...``). ``rewind``: a resume re-logs from this step on (TensorBoard hides
    what an earlier attempt logged there)."""

    event: str
    step: int | None = None
    ts: float = 0.0
    scalars: dict[str, float] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    alarm: str | None = None
    config: dict[str, Any] | None = None
    final: dict[str, Any] | None = None
    rewind: int | None = None


def number(v: Any) -> float | None:
    """``v`` as a float if it is a real number (not a bool), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def flatten(data: Mapping[str, Any], prefix: str = "", sep: str = "/") -> dict[str, Any]:
    """Nested mappings → one level (``a/b``); lists → JSON text; scalars kept."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + sep, sep))
        elif isinstance(v, (list, tuple)):
            out[key] = json.dumps(v, default=str)
        else:
            out[key] = v
    return out


def _fields(rec: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in rec.items() if k not in ENVELOPE}


def _numbers(rec: Mapping[str, Any], names: tuple[str, ...], prefix: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for name in names:
        v = number(rec.get(name))
        if v is not None:
            out[prefix + name] = v
    return out


def _step_of(rec: Mapping[str, Any]) -> int | None:
    s = rec.get("step")
    return s if isinstance(s, int) and not isinstance(s, bool) else None


def _row(rec: Mapping[str, Any], step: int | None = None, **kw: Any) -> TrackerRow:
    ts = number(rec.get("ts")) or 0.0
    step = _step_of(rec) if step is None else step
    return TrackerRow(event=str(rec["event"]), step=step, ts=ts, **kw)


def _g(rec: Mapping[str, Any], key: str, default: Any = "?") -> Any:
    v = rec.get(key)
    return default if v is None else v


# --------------------------------------------------------------------------- per event


def _run_start(rec: Mapping[str, Any]) -> TrackerRow:
    fields = {k: v for k, v in _fields(rec).items() if k not in RUN_START_VOLATILE}
    return _row(rec, config=flatten(fields, "run.", "."))


def _reward_names(rec: Mapping[str, Any]) -> tuple[str, ...]:
    """GRPO's per-function rewards (``rewards/<name>/mean``) a step record carries."""
    return tuple(k for k in rec if k.startswith(REWARD_PREFIX) and k.endswith("/mean"))


def _step(rec: Mapping[str, Any]) -> TrackerRow:
    return _row(rec, scalars=_numbers(rec, STEP_FIELDS + _reward_names(rec), "train/"))


def _eval(rec: Mapping[str, Any]) -> TrackerRow:
    names = EVAL_FIELDS + _reward_names(rec)
    return _row(rec, scalars=_numbers(rec, names, f"eval/{_g(rec, 'tag', 'eval')}/"))


def _checkpoint(rec: Mapping[str, Any]) -> TrackerRow:
    scalars = _numbers(rec, CHECKPOINT_FIELDS, "checkpoint/")
    step = _step_of(rec)
    if step is not None:  # the true step: W&B may show a late record at a later step
        scalars["checkpoint/step"] = float(step)
    return _row(rec, scalars=scalars)


def _resume(rec: Mapping[str, Any]) -> TrackerRow:
    start = rec.get("from_step")
    step = start if isinstance(start, int) and not isinstance(start, bool) else None
    text = (
        f"resumed from step {_g(rec, 'from_step')} ({_g(rec, 'source')} checkpoint); "
        f"{_g(rec, 'steps_lost', 0)} steps redone"
    )
    return _row(rec, step, texts={"events": text}, rewind=None if step is None else step + 1)


def _notice(rec: Mapping[str, Any]) -> TrackerRow:
    text = (
        f"{_g(rec, 'provider')} notice: {_g(rec, 'action')} ({_g(rec, 'reason', '')}); "
        f"preempting={_g(rec, 'preempting')}, deadline in {_g(rec, 'deadline_in_s')} s"
    )
    return _row(rec, texts={"events": text})


def _preempt(rec: Mapping[str, Any]) -> TrackerRow:
    saved = "saved" if rec.get("saved") else "not saved"
    msg = f"preempted at step {_g(rec, 'step')} ({_g(rec, 'reason')}); emergency checkpoint {saved}"
    return _row(rec, alarm=msg)


def _restart(rec: Mapping[str, Any]) -> TrackerRow:
    msg = (
        f"restart: attempt {_g(rec, 'attempt')} after exit {_g(rec, 'exit_code')} "
        f"({_g(rec, 'reason')})"
    )
    return _row(rec, alarm=msg)


def _straggler(rec: Mapping[str, Any]) -> TrackerRow:
    slower = number(rec.get("slower_by"))
    by = "?" if slower is None else f"{slower:.0%}"
    msg = (
        f"straggler: rank {_g(rec, 'rank')} {_g(rec, 'part')} slower by {by} "
        f"since step {_g(rec, 'slower_since_step')}"
    )
    return _row(rec, alarm=msg)


def _hang(rec: Mapping[str, Any]) -> TrackerRow:
    msg = f"hang ({_g(rec, 'kind')}): {_g(rec, 'summary', '')} culprits {_g(rec, 'culprits')}"
    return _row(rec, alarm=msg)


def _checkpoint_failed(rec: Mapping[str, Any]) -> TrackerRow:
    msg = f"checkpoint at step {_g(rec, 'step')} ({_g(rec, 'reason')}) failed: {_g(rec, 'error')}"
    return _row(rec, alarm=msg)


def _run_end(rec: Mapping[str, Any]) -> TrackerRow:
    text = f"run {_g(rec, 'status')} at step {_g(rec, 'step')}"
    return _row(rec, texts={"events": text}, final=flatten(_fields(rec), "final/"))


def _cost(rec: Mapping[str, Any]) -> TrackerRow:
    final = flatten(_fields(rec), "cost/")
    return _row(
        rec,
        scalars=_numbers(rec, COST_FIELDS, "cost/"),
        texts={"cost": render_table(final)},
        final=final,
    )


SYSTEM_HOST_FIELDS = ("cpu_pct", "mem_used_bytes", "load1")
SYSTEM_GPU_FIELDS = ("util_pct", "mem_used_bytes", "power_w", "temp_c", "sm_clock_mhz")


def _system(rec: Mapping[str, Any]) -> TrackerRow:
    """``shoestring run``'s host and GPU sample (``metrics``): ``system/...`` scalars at
    the current step; per GPU ``system/gpu<N>/...``."""
    host = rec.get("host")
    scalars = _numbers(host, SYSTEM_HOST_FIELDS, "system/") if isinstance(host, Mapping) else {}
    for gpu in rec.get("gpus") or ():
        if isinstance(gpu, Mapping):
            scalars.update(_numbers(gpu, SYSTEM_GPU_FIELDS, f"system/gpu{_g(gpu, 'gpu')}/"))
    return _row(rec, scalars=scalars)


def _degraded(rec: Mapping[str, Any]) -> TrackerRow:
    change = number(rec.get("change"))
    by = "?" if change is None else f"{change:+.0%}"
    msg = f"{_g(rec, 'kind')}: rank {_g(rec, 'rank')} {by} vs its baseline"
    return _row(rec, alarm=msg)


_BUILDERS: Mapping[str, Callable[[Mapping[str, Any]], TrackerRow]] = {
    "run_start": _run_start,
    "step": _step,
    "eval": _eval,
    "checkpoint": _checkpoint,
    "preempt": _preempt,
    "resume": _resume,
    "restart": _restart,
    "straggler": _straggler,
    "hang": _hang,
    "alarm": _degraded,
    "metrics": _system,
    "checkpoint_failed": _checkpoint_failed,
    "notice": _notice,
    "run_end": _run_end,
    "cost": _cost,
}
#: The events that reach trackers; every other record is ignored.
EVENTS = frozenset(_BUILDERS)


def to_row(rec: Mapping[str, Any]) -> TrackerRow | None:
    """The row a record shows, or None for events trackers do not show."""
    build = _BUILDERS.get(str(rec.get("event")))
    return None if build is None else build(rec)


# --------------------------------------------------------------------------- rendering


def _cell(v: Any) -> str:
    if isinstance(v, float) and math.isfinite(v):
        return f"{v:.6g}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def render_table(data: Mapping[str, Any]) -> str:
    """A two-column Markdown table (TensorBoard's text plugin renders Markdown)."""
    lines = ["| key | value |", "|---|---|"]
    lines += [f"| {k} | {_cell(v)} |" for k, v in data.items()]
    return "\n".join(lines)


def render_config(config: Mapping[str, Any]) -> str:
    """The flat config as an indented ``key: value`` block (Markdown code)."""
    return "\n".join(f"    {k}: {json.dumps(v, default=str)}" for k, v in sorted(config.items()))
