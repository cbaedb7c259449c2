"""The tokenized cache: tokenize once, memory-map on every restart and every rank.

A cache is a directory named by a content key (:func:`cache_key` over the data digests,
the tokenizer fingerprint and every option that changes the tokens)::

    tokens.npy    all samples' token ids end to end (uint16 when every id < 65536, else uint32)
    offsets.npy   int64, n + 1: sample i is tokens[offsets[i]:offsets[i + 1]]
    labels.npy    uint8, one bit per token (little bit order): 1 where the label is the
                  token id, 0 where it is IGNORE_INDEX
    manifest.json written LAST: format, dtype, counts, each file's size and sha256, and
                  the builder's meta (stats, formats, key parts)

So the data costs the token bytes × (1 + 1/16 or 1/32) plus 8 bytes per sample, and it is
memory-mapped, never loaded. :func:`build` writes into a temp dir beside the target,
fsyncs, writes the manifest last and renames the dir into place: a reader sees a whole
cache or none. :func:`open_or_build` adds a per-key lock (a second rank or a rerun
waits, then opens what the first built), repairs torn caches, and optionally shares the
cache through an fsspec URL (data files uploaded first, manifest last) so a fresh VM
downloads it instead of tokenizing again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np
import numpy.typing as npt

from shoestring.data.records import IGNORE_INDEX, Example
from shoestring.dircommit import (
    commit_dir,
    held_lock,
    is_stale_staging,
    publish_dir,
    staging_dir,
    uncommit,
)
from shoestring.fsio import fsync_dir

log = logging.getLogger("shoestring.data")

#: Bumped whenever the layout changes; part of every key and checked on open.
CACHE_FORMAT = 1
MANIFEST = "manifest.json"
TOKENS = "tokens.npy"
OFFSETS = "offsets.npy"
LABELS = "labels.npy"
DATA_FILES = (TOKENS, OFFSETS, LABELS)

Outcome = Literal["hit", "remote_hit", "built", "rebuilt"]
Fill = Callable[["CacheWriter"], dict[str, Any]]
TokenDtype = Literal["uint16", "uint32"]

#: Every .npy here has a header of exactly this many bytes (written last, once the length
#: is known), so the data after it is page-friendly and can be streamed before the header.
_NPY_HEADER_BYTES = 128
_FLUSH_TOKENS = 1 << 20  # buffered tokens before a write: memory stays bounded
_FLUSH_SAMPLES = 1 << 16
_COPY_CHUNK = 1 << 22
_UINT16_LIMIT = 1 << 16
_UINT32_LIMIT = 1 << 32


class CorruptCache(Exception):
    """A cache dir that is not a whole, committed cache (missing or mismatching files)."""


def cache_key(parts: Mapping[str, str | int]) -> str:
    """The cache dir name for these inputs: sha256 over the sorted items and CACHE_FORMAT."""
    items = sorted((str(k), v) for k, v in parts.items())
    text = json.dumps({"cache_format": CACHE_FORMAT, "parts": items}, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


# --------------------------------------------------------------------------- write side
class _NpyAppender:
    """A 1-D .npy file written in pieces: a placeholder header, the data, then the header."""

    def __init__(self, path: Path, dtype: npt.DTypeLike) -> None:
        self.path = path
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.count = 0
        self._file: BinaryIO = open(path, "wb")  # closed by finish() or abandon()
        self._file.write(b"\0" * _NPY_HEADER_BYTES)

    def append(self, values: npt.ArrayLike) -> None:
        array = np.ascontiguousarray(values, dtype=self.dtype)
        self._file.write(array.tobytes())
        self.count += int(array.size)

    def finish(self) -> int:
        """Write the real header, fsync, close; the file's size in bytes."""
        self._file.seek(0)
        self._file.write(_npy_header(self.dtype, self.count))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return _NPY_HEADER_BYTES + self.count * int(self.dtype.itemsize)

    def abandon(self) -> None:
        self._file.close()


def _npy_header(dtype: np.dtype[Any], count: int) -> bytes:
    """A .npy v1.0 header for a 1-D array, padded with spaces to _NPY_HEADER_BYTES."""
    descr = np.lib.format.dtype_to_descr(dtype)
    text = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': ({count},), }}"
    room = _NPY_HEADER_BYTES - len(np.lib.format.magic(1, 0)) - 2
    if len(text) + 1 > room:
        raise ValueError(f"array too long for a {_NPY_HEADER_BYTES}-byte .npy header: {count}")
    padded = text.ljust(room - 1) + "\n"
    return np.lib.format.magic(1, 0) + struct.pack("<H", room) + padded.encode("latin1")


class _TokenColumn:
    """tokens.npy, uint16 until an id ≥ 65536 arrives, then widened to uint32 once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = _NpyAppender(path, np.uint16)

    @property
    def dtype_name(self) -> TokenDtype:
        return "uint16" if self.file.dtype == np.uint16 else "uint32"

    def widen(self) -> None:
        """Rewrite what was written so far as uint32 (a streamed copy, chunk by chunk)."""
        narrow = self.path.with_name(self.path.name + ".narrow")
        count = self.file.count
        self.file.finish()
        os.replace(self.path, narrow)
        self.file = _NpyAppender(self.path, np.uint32)
        if count:
            old = np.load(narrow, mmap_mode="r")
            for start in range(0, count, _COPY_CHUNK):
                self.file.append(old[start : start + _COPY_CHUNK])
            del old
        narrow.unlink()


class CacheWriter:
    """Streams examples into a cache dir; memory stays bounded however many are added."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._tokens = _TokenColumn(directory / TOKENS)
        self._offsets = _NpyAppender(directory / OFFSETS, np.int64)
        self._labels = _NpyAppender(directory / LABELS, np.uint8)
        self._pending_ids: list[npt.NDArray[np.int64]] = []
        self._pending_bits: list[npt.NDArray[np.bool_]] = []
        self._pending_ends: list[int] = []
        self._pending_tokens = 0
        self._carry_bits = np.zeros(0, dtype=np.bool_)  # < 8 label bits not yet packed
        self.n_samples = 0
        self.n_tokens = 0
        self._offsets.append([0])

    def add(self, ex: Example) -> None:
        """Append one example; ValueError if a label is neither its token id nor IGNORE_INDEX."""
        ids, bits = _checked_arrays(ex, self.n_samples)
        if ids.size and int(ids.max()) >= _UINT16_LIMIT and self._tokens.dtype_name == "uint16":
            self._flush()
            self._tokens.widen()
        self.n_samples += 1
        self.n_tokens += int(ids.size)
        self._pending_ids.append(ids)
        self._pending_bits.append(bits)
        self._pending_ends.append(self.n_tokens)
        self._pending_tokens += int(ids.size)
        if self._pending_tokens >= _FLUSH_TOKENS or len(self._pending_ends) >= _FLUSH_SAMPLES:
            self._flush()

    def add_many(self, exs: Iterable[Example]) -> None:
        for ex in exs:
            self.add(ex)

    def _flush(self) -> None:
        if self._pending_ids:
            self._tokens.file.append(np.concatenate(self._pending_ids))
            bits = np.concatenate([self._carry_bits, *self._pending_bits])
            whole = bits.size - bits.size % 8
            self._labels.append(np.packbits(bits[:whole], bitorder="little"))
            self._carry_bits = bits[whole:].copy()
        if self._pending_ends:
            self._offsets.append(self._pending_ends)
        self._pending_ids, self._pending_bits, self._pending_ends = [], [], []
        self._pending_tokens = 0

    def finish(self) -> dict[str, int]:
        """Flush, write headers, fsync; each data file's size in bytes."""
        self._flush()
        if self._carry_bits.size:
            self._labels.append(np.packbits(self._carry_bits, bitorder="little"))
            self._carry_bits = np.zeros(0, dtype=np.bool_)
        sizes = {
            TOKENS: self._tokens.file.finish(),
            OFFSETS: self._offsets.finish(),
            LABELS: self._labels.finish(),
        }
        fsync_dir(self.directory)
        return sizes

    def abandon(self) -> None:
        for appender in (self._tokens.file, self._offsets, self._labels):
            appender.abandon()

    @property
    def dtype_name(self) -> TokenDtype:
        return self._tokens.dtype_name


def _checked_arrays(ex: Example, index: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """The example's ids and its label bits (label == id), refusing anything else."""
    ids = np.asarray(ex.input_ids, dtype=np.int64).reshape(-1)
    labels = np.asarray(ex.labels, dtype=np.int64).reshape(-1)
    if ids.shape != labels.shape:
        raise ValueError(
            f"example {index}: {ids.size} input_ids but {labels.size} labels (must be equal)"
        )
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= _UINT32_LIMIT):
        raise ValueError(f"example {index}: token ids must be in [0, 2**32)")
    bits = labels == ids
    bad = np.flatnonzero(~bits & (labels != IGNORE_INDEX))
    if bad.size:
        at = int(bad[0])
        raise ValueError(
            f"example {index}: label {int(labels[at])} at position {at} is neither the "
            f"token id {int(ids[at])} nor IGNORE_INDEX ({IGNORE_INDEX})"
        )
    return ids, bits


# --------------------------------------------------------------------------- manifest
@dataclass(frozen=True)
class _FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True)
class _Manifest:
    dtype: TokenDtype
    n_samples: int
    n_tokens: int
    files: dict[str, _FileEntry]
    meta: dict[str, Any]

    def to_json(self) -> bytes:
        doc = {
            "format": CACHE_FORMAT,
            "dtype": self.dtype,
            "n_samples": self.n_samples,
            "n_tokens": self.n_tokens,
            "files": {n: {"size": e.size, "sha256": e.sha256} for n, e in self.files.items()},
            "meta": self.meta,
        }
        return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


def _parse_manifest(text: bytes, where: str) -> _Manifest:
    try:
        doc = json.loads(text)
        if doc["format"] != CACHE_FORMAT:
            raise CorruptCache(f"{where}: format {doc['format']}, expected {CACHE_FORMAT}")
        files = {
            str(n): _FileEntry(int(e["size"]), str(e["sha256"])) for n, e in doc["files"].items()
        }
        manifest = _Manifest(
            dtype=doc["dtype"],
            n_samples=int(doc["n_samples"]),
            n_tokens=int(doc["n_tokens"]),
            files=files,
            meta=dict(doc["meta"]),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptCache(f"{where}: unreadable manifest ({e})") from e
    if manifest.dtype not in ("uint16", "uint32") or set(files) != set(DATA_FILES):
        raise CorruptCache(f"{where}: manifest lists {sorted(files)} as {manifest.dtype!r}")
    return manifest


def _read_manifest(directory: Path) -> _Manifest:
    where = directory / MANIFEST
    try:
        text = where.read_bytes()
    except FileNotFoundError as e:
        raise CorruptCache(f"{where}: missing (an unfinished or torn cache)") from e
    return _parse_manifest(text, str(where))


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_files(directory: Path, manifest: _Manifest, *, verify: bool) -> None:
    """CorruptCache unless every file exists with its size (and sha256 when ``verify``)."""
    for name, entry in manifest.files.items():
        path = directory / name
        try:
            size = path.stat().st_size
        except FileNotFoundError as e:
            raise CorruptCache(f"{path}: missing") from e
        if size != entry.size:
            raise CorruptCache(f"{path}: {size} bytes, manifest says {entry.size}")
        if verify and _sha256_file(path) != entry.sha256:
            raise CorruptCache(f"{path}: sha256 differs from the manifest")


# --------------------------------------------------------------------------- read side
def _mapped(path: Path, dtype: str, count: int) -> npt.NDArray[Any]:
    """The .npy at ``path`` memory-mapped read-only (an empty array has nothing to map)."""
    if count == 0:
        return np.zeros(0, dtype=dtype)
    try:
        array: npt.NDArray[Any] = np.load(path, mmap_mode="r")
    except (ValueError, OSError) as e:
        raise CorruptCache(f"{path}: unreadable ({e})") from e
    if array.dtype != np.dtype(dtype) or array.shape != (count,):
        raise CorruptCache(f"{path}: {array.dtype}{array.shape}, expected {dtype}({count},)")
    return array


class TokenCache:
    """A committed cache, memory-mapped: ``cache[i]`` is an :class:`Example`."""

    def __init__(self, path: Path, manifest: _Manifest) -> None:
        self.path = path
        self.meta: dict[str, Any] = manifest.meta
        self.n_tokens: int = manifest.n_tokens
        self.dtype: TokenDtype = manifest.dtype
        self.tokens = _mapped(path / TOKENS, manifest.dtype, manifest.n_tokens)
        self.offsets = _mapped(path / OFFSETS, "int64", manifest.n_samples + 1)
        self.label_bits = _mapped(path / LABELS, "uint8", (manifest.n_tokens + 7) // 8)
        if int(self.offsets[0]) != 0 or int(self.offsets[-1]) != manifest.n_tokens:
            raise CorruptCache(f"{path / OFFSETS}: does not span {manifest.n_tokens} tokens")

    @classmethod
    def open(cls, path: Path, *, verify: bool = False) -> TokenCache:
        """Open a committed cache; CorruptCache on any missing or mismatching file."""
        path = Path(path)
        manifest = _read_manifest(path)
        _check_files(path, manifest, verify=verify)
        try:
            return cls(path, manifest)
        except FileNotFoundError as e:  # removed under us (a concurrent repair)
            raise CorruptCache(f"{path}: {e}") from e

    def __len__(self) -> int:
        return int(self.offsets.shape[0]) - 1

    @cached_property
    def lengths(self) -> npt.NDArray[np.int32]:
        """Per-sample token counts."""
        return np.diff(self.offsets).astype(np.int32)

    def sample_arrays(self, i: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Sample ``i``'s input ids and labels as int64 arrays."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for a cache of {n}")
        i = i % n
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        ids = np.asarray(self.tokens[start:end], dtype=np.int64)
        packed = self.label_bits[start // 8 : (end + 7) // 8]
        bits = np.unpackbits(packed, bitorder="little")[start % 8 : start % 8 + end - start]
        return ids, np.where(bits.astype(np.bool_), ids, IGNORE_INDEX)

    def __getitem__(self, i: int) -> Example:
        ids, labels = self.sample_arrays(i)
        return Example(input_ids=ids.tolist(), labels=labels.tolist())

    def __iter__(self) -> Iterator[Example]:
        for i in range(len(self)):
            yield self[i]


# --------------------------------------------------------------------------- commit
def _write_cache(tmp: Path, fill: Fill) -> bytes:
    """Fill ``tmp`` with the data files (durable); return the manifest to commit them."""
    writer = CacheWriter(tmp)
    try:
        meta = fill(writer)
        sizes = writer.finish()
    except BaseException:
        writer.abandon()
        raise
    files = {name: _FileEntry(size, _sha256_file(tmp / name)) for name, size in sizes.items()}
    return _Manifest(writer.dtype_name, writer.n_samples, writer.n_tokens, files, meta).to_json()


def build(path: Path, fill: Fill) -> TokenCache:
    """Build the cache at ``path``: ``fill`` adds the examples and returns the meta.

    Written into a temp dir beside ``path``, fsynced, manifest last, renamed into place
    (:mod:`shoestring.dircommit`).
    """
    path = Path(path)
    with staging_dir(path.parent, path.name) as tmp:
        commit_dir(tmp, path, MANIFEST, _write_cache(tmp, fill))
    return TokenCache.open(path)


# --------------------------------------------------------------------------- remote
class _RemoteDir:
    """``remote``/``key`` on an fsspec filesystem: data files first, manifest last."""

    def __init__(self, url: str, key: str, storage_options: dict[str, Any] | None) -> None:
        import fsspec

        try:
            self.fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except ImportError as e:
            proto = url.split("://", 1)[0]
            raise RuntimeError(
                f"data.cache_storage={url!r} needs the fsspec backend for {proto}:// "
                "(for s3: pip install 'shoestring[s3]')"
            ) from e
        self.url = f"{url.rstrip('/')}/{key}"
        self.dir = f"{root.rstrip('/')}/{key}"

    def _p(self, name: str) -> str:
        return f"{self.dir}/{name}"

    def read_manifest(self) -> bytes | None:
        """The remote manifest's bytes; None when there is none (absent or unfinished)."""
        self.fs.invalidate_cache()
        try:
            data: bytes = self.fs.cat_file(self._p(MANIFEST))
        except FileNotFoundError:
            return None
        return data

    def download(self, name: str, dest: Path) -> None:
        try:
            self.fs.get_file(self._p(name), str(dest))
        except FileNotFoundError as e:
            raise CorruptCache(f"{self.url}/{name}: missing") from e
        with open(dest, "rb+") as f:
            os.fsync(f.fileno())

    def publish(self, local: Path) -> None:
        """Upload a committed cache: uncommit any old manifest, data files, manifest last."""
        publish_dir(self.fs, local, self.dir, DATA_FILES, MANIFEST)


def _fetch(remote: _RemoteDir, path: Path) -> TokenCache | None:
    """Download ``remote`` into ``path`` (verified, manifest last); None when it has none."""
    manifest_bytes = remote.read_manifest()
    if manifest_bytes is None:
        return None
    manifest = _parse_manifest(manifest_bytes, f"{remote.url}/{MANIFEST}")
    with staging_dir(path.parent, path.name) as tmp:
        for name in DATA_FILES:
            remote.download(name, tmp / name)
        _check_files(tmp, manifest, verify=True)
        commit_dir(tmp, path, MANIFEST, manifest_bytes)
    return TokenCache.open(path)


def _try_fetch(remote: _RemoteDir, path: Path) -> TokenCache | None:
    """:func:`_fetch`, treating a torn or unreachable remote copy as absent (logged)."""
    try:
        return _fetch(remote, path)
    except (CorruptCache, OSError) as e:
        log.warning("tokenized cache at %s not usable, tokenizing instead: %s", remote.url, e)
        return None


def _try_publish(remote: _RemoteDir, path: Path) -> None:
    """Publish, logging (not raising) a failure: the local cache is what training needs."""
    try:
        remote.publish(path)
    except OSError as e:
        log.warning("could not publish the tokenized cache to %s: %s", remote.url, e)


def _publish_if_missing(remote: _RemoteDir, path: Path) -> None:
    """Publish a local cache the bucket does not hold yet (logged, never raised)."""
    try:
        if remote.read_manifest() is None:
            remote.publish(path)
    except OSError as e:
        log.warning("could not publish the tokenized cache to %s: %s", remote.url, e)


# --------------------------------------------------------------------------- open_or_build
def _try_open(path: Path, verify: bool) -> TokenCache | None:
    try:
        return TokenCache.open(path, verify=verify)
    except CorruptCache as e:
        log.warning("tokenized cache %s is torn, rebuilding: %s", path, e)
        return None


def _remove_stale_temps(root: Path, key: str) -> None:
    """Temp dirs of builds or fetches that died (only call with the key's lock held)."""
    for stale in root.iterdir():
        if is_stale_staging(stale.name, key):
            shutil.rmtree(stale, ignore_errors=True)


def open_or_build(
    root: Path,
    key: str,
    fill: Fill,
    *,
    remote: str | None = None,
    storage_options: dict[str, Any] | None = None,
    verify: bool = False,
) -> tuple[TokenCache, Outcome]:
    """The cache ``root/key``: opened if committed, else fetched from ``remote/key``,
    else built with ``fill`` (and published to ``remote/key``). One process at a time
    fetches or builds a key (``root/key.lock``); the others wait and open its result.
    ``verify`` also checks each file's sha256 before trusting a local cache."""
    if not key or "/" in key or key.startswith("."):
        raise ValueError(f"cache key {key!r} must be a plain name")
    root = Path(root)
    path = root / key
    if (path / MANIFEST).exists():
        cache = _try_open(path, verify)
        if cache is not None:
            if remote:  # a cache built before the bucket was set, or whose upload failed
                _publish_if_missing(_RemoteDir(remote, key, storage_options), path)
            return cache, "hit"
    root.mkdir(parents=True, exist_ok=True)
    with held_lock(root / f"{key}.lock"):
        return _open_or_build_locked(root, key, fill, remote, storage_options, verify)


def _open_or_build_locked(
    root: Path,
    key: str,
    fill: Fill,
    remote_url: str | None,
    storage_options: dict[str, Any] | None,
    verify: bool,
) -> tuple[TokenCache, Outcome]:
    path = root / key
    torn = path.exists()
    if torn:
        cache = _try_open(path, verify)
        if cache is not None:
            return cache, "hit"  # another process finished it while we waited
        uncommit(path, MANIFEST)
    _remove_stale_temps(root, key)
    remote = _RemoteDir(remote_url, key, storage_options) if remote_url else None
    if remote is not None:
        cache = _try_fetch(remote, path)
        if cache is not None:
            return cache, "remote_hit"
    cache = build(path, fill)
    if remote is not None:
        _try_publish(remote, path)
    return cache, "rebuilt" if torn else "built"
