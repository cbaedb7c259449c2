"""Resuming a built trainer from the newest intact checkpoint, or starting fresh.

Rank 0 chooses the checkpoint (it may quarantine a corrupt one or fetch from
``checkpoint.storage``) and every rank gets the same answer; the strategy loads
it in whatever format it was written (files or DCP shards, any world size).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from shoestring.checkpoint import find_resume_point
from shoestring.checkpoint.local import prune_quarantined, quarantine
from shoestring.checkpoint.manifest import CorruptCheckpoint, Manifest, verify_dir
from shoestring.checkpoint.sharded import is_sharded
from shoestring.config import ConfigError, to_flat
from shoestring.events import read_tail
from shoestring.secrets import redact
from shoestring.train import state as S
from shoestring.train.baselayout import changed_versions, check_layout, versions
from shoestring.train.config import RESUME_SAFE_PREFIXES, FinetuneConfig, resume_relevant
from shoestring.train.export import prune_exports
from shoestring.train.trainer import Trainer

log = logging.getLogger("shoestring.finetune")


def check_compatible(saved: Mapping[str, Any], cfg: FinetuneConfig, where: str) -> None:
    """Refuse a resume whose config would break an exact continuation."""
    # Checkpoints store the config redacted (no credentials): compare redacted forms.
    old, new = resume_relevant(redact(dict(saved))), resume_relevant(redact(to_flat(cfg)))
    # A key the checkpoint does not know was added by a later version: it had its default.
    default = resume_relevant(to_flat(FinetuneConfig()))
    old = {**{k: v for k, v in default.items() if k not in old}, **old}
    changed = [
        f"{k}: {old.get(k)!r} -> {new.get(k)!r}"
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k)
    ]
    if changed:
        raise ConfigError(
            f"cannot resume from {where}: the config changed in ways that break "
            f"an exact continuation: {'; '.join(changed)}. Keys that may change on resume: "
            f"{', '.join(p + '*' if p.endswith('.') else p for p in RESUME_SAFE_PREFIXES)}. "
            "Use a new output_dir or --resume never to start over."
        )


def last_logged_step(events_path: Path, elsewhere: Iterable[Path] = ()) -> int | None:
    """The last ``step`` event of the previous attempts (read from the log's tail, across
    a rotation), or a later one in the logs of attempts on other machines (``elsewhere``:
    the run directory's ``attempts/``, copied from the bucket)."""
    last: tuple[float, int] | None = None
    for path in [events_path, *elsewhere]:
        timed = [
            (float(r.get("ts") or 0), int(r["step"]))
            for r in read_tail(path, 1 << 20)
            if r.get("event") == "step"
        ]
        if timed and (last is None or timed[-1][0] > last[0]):
            last = timed[-1]
    return last[1] if last else None


def _choose(t: Trainer, mode: str, exclude: set[int]) -> tuple[int, str, str] | None:
    """Rank 0 chooses (it may quarantine or fetch); every rank gets the same answer."""
    run = t.run
    choice = None
    if run.strategy.rank == 0:
        point = find_resume_point(
            mode,
            run.dir.checkpoints,
            run.remote,
            verify=t.cfg.checkpoint.verify,
            events=run.events,
            complete=S.require_complete,
            exclude=exclude,
        )
        if point is not None:
            if (
                run.remote is not None
                and point.source == "local"
                and point.step not in run.remote.committed_steps()
            ):
                # The previous run died before this checkpoint reached durable storage.
                run.remote.publish(point.path, point.manifest)
            choice = (point.step, str(point.path), point.source)
    return run.strategy.share(choice)  # type: ignore[no-any-return]


def resume(t: Trainer, mode: str) -> S.Progress:
    """The progress to continue from (see :func:`_resume`); then rank 0, which holds the
    run directory's lock, prunes what earlier runs left (:func:`tidy`)."""
    progress = _resume(t, mode)
    if t.run.strategy.rank == 0:
        tidy(t)
    return progress


def tidy(t: Trainer) -> None:
    """Remove export temp dirs of killed runs and all but the newest
    ``checkpoint.keep_quarantined`` quarantined checkpoints (each a full checkpoint);
    one ``pruned`` event names what went."""
    exports = prune_exports(t.run.out)
    quarantined = prune_quarantined(t.run.dir.checkpoints, t.cfg.checkpoint.keep_quarantined)
    if exports or quarantined:
        log.info(
            "pruned %d stale export dir(s), %d quarantined checkpoint(s)",
            len(exports),
            len(quarantined),
        )
        t.run.events.emit("pruned", exports=exports, quarantined=quarantined)


def _resume(t: Trainer, mode: str) -> S.Progress:
    """The progress to continue from (a fresh, seeded start when there is none).

    A checkpoint that verifies but does not load on some rank (its bytes are not a
    state this job can read) is rejected by every rank together: quarantined, logged
    as ``checkpoint_invalid``, and the next older one is loaded — the same fallback
    as a checkpoint that fails verification. Loading the older one overwrites all
    the state the failed load may have half-written."""
    rejected: set[int] = set()
    while True:
        choice = _choose(t, mode, rejected)
        if choice is None:
            S.seed_everything(t.cfg.train.seed)
            return S.Progress()
        failure: CorruptCheckpoint | None = None
        loaded = None
        try:
            loaded = _load(t, choice)
        except CorruptCheckpoint as e:
            failure = e
        if t.run.strategy.all_agree(failure is None) and loaded is not None:
            progress, manifest = loaded
            _report(
                t,
                progress,
                Path(choice[1]),
                choice[2],
                int(manifest.meta.get("world_size", 1)),
                is_sharded(manifest.files),
            )
            t.run.faults.hit("resume.after_load")
            return progress
        _reject(t, choice, failure, mode)  # every rank (a barrier), after the agreement
        rejected.add(choice[0])


def check_base(
    meta: Mapping[str, Any], fp: str, source: Mapping[str, str], where: str, model_dir: Path
) -> None:
    """Refuse a checkpoint trained on another base: the adapter belongs to the weights it
    was trained on. When ``model.path`` is a Hub ref (or a bucket URL) that now resolves
    to another commit (digest) than the checkpoint's, the message names both."""
    saved = meta.get("base_source") or {}
    old = saved.get("commit") or saved.get("digest")
    new = source.get("commit") or source.get("digest")
    if old and new and old != new:
        what = "commit" if source.get("commit") else "content digest"
        ref = source.get("ref", str(model_dir))
        fix = (
            f"pin it (--model.path {ref.partition('@')[0]}@{old})"
            if source.get("source") == "hub"
            else "restore that folder"
        )
        raise ConfigError(
            f"cannot resume from {where}: model.path {ref} now resolves to {what} {new}, "
            f"but this checkpoint was trained on {what} {old} (the adapter belongs to the "
            f"weights it was trained on); {fix}, or start a new output_dir"
        )
    if meta.get("base_fingerprint") != fp:
        raise ConfigError(
            f"cannot resume from {where}: model.path {model_dir} is "
            "not the base model this checkpoint was trained on "
            "(fingerprint differs)"
        )


def _reject(
    t: Trainer, choice: tuple[int, str, str], failure: CorruptCheckpoint | None, mode: str
) -> None:
    """Every rank: this checkpoint did not load somewhere; rank 0 moves it aside."""
    step, path_s, _source = choice
    why = str(failure) if failure is not None else "another rank could not load it"
    if mode != "auto":
        raise CorruptCheckpoint(f"--resume {mode}: {why}")
    if t.run.strategy.rank == 0:
        path = Path(path_s)
        moved = quarantine(path) if path.is_dir() else path
        log.warning("checkpoint step %d does not load (%s); moved to %s", step, why, moved)
        t.run.events.emit(
            "checkpoint_invalid", step=step, path=path_s, error=why, quarantined=str(moved)
        )
    t.run.strategy.barrier()


def _load(t: Trainer, choice: tuple[int, str, str]) -> tuple[S.Progress, Manifest]:
    """Load the chosen checkpoint into the trainer on this rank."""
    path_s = choice[1]
    path = Path(path_s)
    manifest = verify_dir(path, deep=False)  # rank 0 verified the hashes
    check_base(manifest.meta, t.base_fp, t.base_source, str(path), t.model_dir)
    check_layout(manifest.meta, t.base_layout, str(path))
    strategy = t.run.strategy
    progress, own_rng = strategy.restore(
        path, manifest, t.learner, lambda saved: check_compatible(saved, t.cfg, str(path))
    )
    if not own_rng:
        # More ranks than were saved: this rank's streams start from the seed. Training
        # draws dropout per micro-batch from (seed, step, chunk), so this changes nothing.
        S.seed_everything(t.cfg.train.seed + 7919 * strategy.rank + progress.step)
    t.saved_step = progress.step
    t.resumed_meta = dict(manifest.meta)
    return progress, manifest


def _report(
    t: Trainer, progress: S.Progress, path: Path, source: str, saved_world: int, sharded: bool
) -> None:
    rd = t.run.dir
    last = last_logged_step(rd.events, sorted(rd.attempts.glob("*.jsonl")))
    lost = max((last or 0) - progress.step, 0)
    world = t.run.strategy.world_size
    changed = changed_versions(t.resumed_meta.get("versions"), versions())
    t.run.events.emit(
        "resume",
        from_step=progress.step,
        source=source,
        path=str(path),
        steps_lost=lost,
        last_logged_step=last,
        from_world_size=saved_world,
        world_size=world,
        format="dcp" if sharded else "files",
        base_layout="same" if "base_layout" in t.resumed_meta else "unrecorded",
        versions_changed=changed,
        **S.state_digests(t.learner.wrapped, t.learner.optimizer),
    )
    _warn_unverified(t, changed)
    log.info(
        "resumed from step %d (%s, saved by %d rank(s), now %d); %d steps redone",
        progress.step,
        source,
        saved_world,
        world,
        lost,
    )


def _warn_unverified(t: Trainer, changed: dict[str, str]) -> None:
    """What this resume could not promise: the same base form, the same libraries."""
    if "base_layout" not in t.resumed_meta:
        log.warning(
            "this checkpoint predates the record of how its base was held (%s now); "
            "if a version of shoestring that held it otherwise wrote it, the adapter "
            "continues against other weights",
            ", ".join(f"{k} {v}" for k, v in t.base_layout.items()) or "nothing frozen",
        )
    if changed:
        log.warning(
            "resuming under other library versions (%s): the continuation may not be "
            "bit-identical to an uninterrupted run",
            "; ".join(f"{k} {v}" for k, v in changed.items()),
        )
