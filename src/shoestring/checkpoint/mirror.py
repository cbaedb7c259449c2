"""A model folder in a bucket (any fsspec URL), copied into the local cache.

``model.path s3://bucket/models/llama-8b`` on a fresh VM: the files a model needs are
copied once under ``<cache>/models/<key>/`` with the checkpoint commit protocol (a
staging folder, each file fsynced, ``manifest.json`` with sizes and sha256 last, a
rename) under a lock, so ranks on one host copy it once and a kill leaves no half copy.
A folder that carries a shoestring ``manifest.json`` itself (a published checkpoint or
export) has every copied file's sha256 checked against it. A later start reuses the
copy while the bucket's listing (names, sizes, ETags or mtimes) is unchanged and the
copy's files still have their committed sizes. The digest returned is the sha256 of
the copy's (name, size, sha256) table: the model's version in run.json and manifests.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from shoestring.checkpoint.local import seal
from shoestring.checkpoint.manifest import (
    MANIFEST,
    CorruptCheckpoint,
    FileEntry,
    Manifest,
    check_name,
    sha256_file,
    verify_dir,
)
from shoestring.checkpoint.remote import RemoteStore
from shoestring.dircommit import held_lock, staging_dir


def fetch_model_folder(url: str, cache_root: Path, patterns: tuple[str, ...]) -> tuple[Path, str]:
    """Copy the files of the folder at ``url`` that match ``patterns`` (top level only)
    into ``cache_root``; returns the local folder and its content digest."""
    store = RemoteStore(url)
    listing = _listing(store)
    wanted = {n: e for n, e in listing.items() if any(fnmatch.fnmatch(n, p) for p in patterns)}
    if not wanted:
        raise FileNotFoundError(f"no {', '.join(patterns[:3])}... in it")
    seen = sorted(wanted.items()) + [(MANIFEST, listing.get(MANIFEST))]  # its own manifest too
    signature = hashlib.sha256(json.dumps(seen).encode()).hexdigest()
    key = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    cache_root.mkdir(parents=True, exist_ok=True)
    final = cache_root / key
    with held_lock(cache_root / f".{key}.lock"):
        manifest = _reusable(final, signature)
        if manifest is None:
            published = _published(store) if MANIFEST in listing else None
            meta = {"url": url, "sig": signature}
            manifest = _copy(store, sorted(wanted), cache_root, key, meta, published)
    return final, digest(manifest)


def digest(manifest: Manifest) -> str:
    rows = sorted((n, e.size, e.sha256) for n, e in manifest.files.items())
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def _listing(store: RemoteStore) -> dict[str, list[Any]]:
    """``{name: [size, version]}`` of the folder's top-level files."""
    store.fs.invalidate_cache()
    found = store.fs.ls(store.root, detail=True)
    out: dict[str, list[Any]] = {}
    for info in found:
        if info.get("type") != "file":
            continue
        name = str(info["name"]).rstrip("/").rsplit("/", 1)[-1]
        version = info.get("ETag") or info.get("etag") or info.get("mtime") or ""
        out[name] = [int(info.get("size") or 0), str(version)]
    if not out:
        raise FileNotFoundError("no such folder, or it is empty")
    return out


def _reusable(final: Path, signature: str) -> Manifest | None:
    try:
        manifest = verify_dir(final, deep=False)
    except CorruptCheckpoint:
        return None
    return manifest if manifest.meta.get("sig") == signature else None


def _published(store: RemoteStore) -> Manifest:
    with store.fs.open(f"{store.root}/{MANIFEST}", "rb") as f:
        return Manifest.from_json(f.read().decode(), f"{store.url}/{MANIFEST}")


def _copy(
    store: RemoteStore,
    names: list[str],
    root: Path,
    key: str,
    meta: dict[str, Any],
    published: Manifest | None,
) -> Manifest:
    """Each file into a staging folder, fsynced and hashed (checked against the folder's
    own manifest when it has one), then committed with the checkpoint protocol."""
    with staging_dir(root, key) as tmp:
        entries: dict[str, FileEntry] = {}
        for name in names:
            check_name(name, store.url)
            store.fs.get_file(f"{store.root}/{name}", str(tmp / name))
            with open(tmp / name, "rb+") as f:
                os.fsync(f.fileno())
            entries[name] = FileEntry((tmp / name).stat().st_size, sha256_file(tmp / name))
            want = published.files.get(name) if published is not None else None
            if want is not None and want.sha256 != entries[name].sha256:
                raise CorruptCheckpoint(f"{name}: sha256 differs from the folder's {MANIFEST}")
        return seal(tmp, root, 0, meta, entries=entries, name=key)[1]
