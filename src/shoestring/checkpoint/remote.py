"""Publishing committed checkpoints to durable storage through fsspec.

The local checkpoint root is the cache; this store is the copy that survives
the machine. On object stores there is no rename, so the manifest is uploaded
last: a remote ``step-N/`` without ``manifest.json`` is an unfinished upload
and is never fetched. On a local or mounted path we copy into a temp dir and
rename, like the local protocol.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from shoestring.checkpoint.faults import NO_FAULTS, FaultPlan
from shoestring.checkpoint.local import parse_step, step_dirname
from shoestring.checkpoint.manifest import (
    MANIFEST,
    CorruptCheckpoint,
    Manifest,
    check_name,
    verify_dir,
)
from shoestring.dircommit import publish_dir, replace_dir
from shoestring.fsio import fsync_dir


def _fsspec() -> Any:
    try:
        import fsspec
    except ImportError as e:  # pragma: no cover - fsspec is a core dependency
        raise RuntimeError("checkpoint.storage needs fsspec: pip install fsspec") from e
    return fsspec


class RemoteStore:
    """A checkpoint root on any fsspec filesystem (s3://, gs://, file://, a plain path)."""

    def __init__(self, url: str, **storage_options: Any) -> None:
        fsspec = _fsspec()
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        except ImportError as e:
            proto = url.split("://", 1)[0]
            hint = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
            pkg = hint.get(proto, f"the fsspec backend for {proto}://")
            raise RuntimeError(
                f"checkpoint.storage={url!r} needs {pkg}: "
                f"pip install 'shoestring[s3]' (or pip install {pkg})"
            ) from e
        self.url = url
        self.root = root.rstrip("/")
        self.is_local = "file" in (
            self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        )

    def check(self) -> None:
        """Fail early (before any training) if the storage cannot be reached or written."""
        if self.is_local:
            Path(self.root).mkdir(parents=True, exist_ok=True)
            return
        bucket = self.root.split("/", 1)[0]
        self.fs.invalidate_cache()
        if not self.fs.exists(bucket):
            raise FileNotFoundError(f"bucket {bucket!r} does not exist or is not accessible")

    def _p(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def committed_steps(self) -> list[int]:
        self.fs.invalidate_cache()
        try:
            hits = self.fs.glob(self._p("step-*", MANIFEST))
        except FileNotFoundError:
            return []
        steps = []
        for h in hits:
            step = parse_step(h.rstrip("/").split("/")[-2])
            if step is not None:
                steps.append(step)
        return sorted(set(steps), reverse=True)

    def read_manifest(self, step: int) -> Manifest:
        return self.read_manifest_of(step_dirname(step))

    def read_manifest_of(self, name: str) -> Manifest:
        """The manifest of the committed directory ``name`` (a step's, or any other)."""
        where = self._p(check_name(name, self.url), MANIFEST)
        try:
            with self.fs.open(where, "rb") as f:
                text = f.read().decode()
        except FileNotFoundError as e:
            raise CorruptCheckpoint(f"{where}: missing") from e
        return Manifest.from_json(text, where)

    def has(self, name: str) -> bool:
        """Whether directory ``name`` is committed here (its manifest was uploaded)."""
        self.fs.invalidate_cache()
        return bool(self.fs.exists(self._p(check_name(name, self.url), MANIFEST)))

    def read_bytes(self, step: int, name: str) -> bytes:
        """One file of checkpoint ``step`` (a small one: it is read whole)."""
        where = self._p(step_dirname(step), check_name(name, self.url))
        with self.fs.open(where, "rb") as f:
            return bytes(f.read())

    def put_file(self, rel: str, data: bytes) -> None:
        """Write one small object ``rel`` (a path under the root) whole: on an object
        store a PUT replaces it atomically; on a plain path, temp file and rename."""
        if self.is_local:
            from shoestring.fsio import atomic_write

            target = Path(self._p(rel))
            target.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(target, data)
            return
        self.fs.pipe_file(self._p(rel), data)

    def list_files(self, rel: str) -> list[str]:
        """The names of the files directly under folder ``rel`` (none if it is missing)."""
        self.fs.invalidate_cache()
        try:
            found = self.fs.ls(self._p(rel), detail=False)
        except FileNotFoundError:
            return []
        return sorted(str(p).rstrip("/").rsplit("/", 1)[-1] for p in found)

    def get_file(self, rel: str, dest: Path) -> None:
        """Download object ``rel`` to ``dest``."""
        self.fs.get_file(self._p(rel), str(dest))

    def publish(self, local_dir: Path, manifest: Manifest, faults: FaultPlan = NO_FAULTS) -> None:
        """Upload a locally committed checkpoint; the manifest goes last."""
        self.publish_as(step_dirname(manifest.step), local_dir, manifest, faults)

    def publish_as(
        self, name: str, local_dir: Path, manifest: Manifest, faults: FaultPlan = NO_FAULTS
    ) -> None:
        """Upload a locally committed directory as ``name``; the manifest goes last."""
        if self.is_local:
            self._publish_local(local_dir, name, manifest, faults)
            return
        publish_dir(
            self.fs,
            local_dir,
            self._p(name),
            manifest.files,
            MANIFEST,
            hook=lambda point: faults.hit(f"upload.{point}"),
        )

    def _publish_local(
        self, local_dir: Path, name: str, manifest: Manifest, faults: FaultPlan
    ) -> None:
        root = Path(self.root)
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".tmp-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            for fname in [*manifest.files, MANIFEST]:
                if fname == MANIFEST:
                    faults.hit("upload.before_manifest")
                shutil.copyfile(local_dir / fname, tmp / fname)
                with open(tmp / fname, "rb+") as f:
                    os.fsync(f.fileno())
                if fname != MANIFEST:
                    faults.hit("upload.after_file")
            fsync_dir(tmp)
            replace_dir(tmp, root / name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def fetch(self, step: int, cache_root: Path, *, deep: bool = True) -> Path:
        """Download checkpoint ``step`` into the local cache and verify it; return its dir."""
        return self.fetch_as(step_dirname(step), cache_root, deep=deep)

    def fetch_as(self, name: str, cache_root: Path, *, deep: bool = True) -> Path:
        """Download committed directory ``name`` to ``cache_root/name`` and verify it."""
        manifest = self.read_manifest_of(name)
        cache_root.mkdir(parents=True, exist_ok=True)
        tmp = cache_root / f".fetch-{name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            for fname in manifest.files:
                (tmp / fname).parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(self._p(name, fname), str(tmp / fname))
            self.fs.get_file(self._p(name, MANIFEST), str(tmp / MANIFEST))
            verify_dir(tmp, deep=deep)
            final = cache_root / name
            replace_dir(tmp, final)
            return final
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def delete(self, step: int) -> None:
        """Uncommit (manifest first), then delete the rest."""
        d = self._p(step_dirname(step))
        try:
            self.fs.rm(self._p(step_dirname(step), MANIFEST))
        except FileNotFoundError:
            pass
        try:
            self.fs.rm(d, recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache()

    def _all_steps(self) -> list[int]:
        try:
            names = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        steps = (parse_step(n.rstrip("/").split("/")[-1]) for n in names)
        return sorted({s for s in steps if s is not None}, reverse=True)

    def apply_retention(self, keep: int) -> list[int]:
        """Keep the newest ``keep`` committed steps; also drop unfinished uploads older
        than the newest committed one (a single writer never resumes those)."""
        steps = self.committed_steps()
        doomed = steps[keep:]
        if steps:
            doomed += [s for s in self._all_steps() if s < steps[0] and s not in steps]
            self._prune_staging(steps[0])
        for step in doomed:
            self.delete(step)
        return sorted(set(doomed), reverse=True)

    def _prune_staging(self, newest: int) -> None:
        """A plain-path store's staging folders (``.tmp-step-N-…``, left by a publish that
        was killed) of steps up to the newest committed one: a single writer never
        finishes those. A newer step's staging may be a publish in progress: kept."""
        if not self.is_local or not Path(self.root).is_dir():
            return
        for child in Path(self.root).iterdir():
            name = child.name.removeprefix(".tmp-")
            step = parse_step(name.rsplit("-", 2)[0]) if name != child.name else None
            if step is not None and step <= newest and child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
