"""The tokenized cache: exact roundtrip, hits without tokenizing, torn caches repaired,
remote publish/fetch, one build across processes, and memory mapping."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest

from s3server import S3Server
from shoestring.data import cache as cache_mod
from shoestring.data.cache import (
    CACHE_FORMAT,
    CacheWriter,
    CorruptCache,
    TokenCache,
    build,
    cache_key,
    open_or_build,
)
from shoestring.data.records import IGNORE_INDEX, Example

X = IGNORE_INDEX  # short, so label lists line up with their ids


def mixed_examples() -> list[Example]:
    """Lengths that straddle bytes of the label mask; every label pattern; an empty one."""
    return [
        Example([5, 6, 7], [5, 6, 7]),
        Example([1, 2, 3, 4, 5, 6, 7, 8, 9], [X, X, X, 4, 5, X, 7, X, 9]),
        Example([], []),
        Example([0], [X]),
        Example([65535, 0, 12], [X, 0, 12]),
        Example(list(range(100, 117)), [X] * 8 + list(range(108, 117))),
    ]


def wide_examples() -> list[Example]:
    """uint16-sized samples first, then ids ≥ 65536: the writer widens to uint32 midway."""
    return [
        *mixed_examples(),
        Example([65536, 3, 1_000_000], [65536, X, 1_000_000]),
        Example([2**32 - 1, 7], [X, 7]),
        Example([9, 8], [9, 8]),
    ]


class Fill:
    """A fill function that counts its calls (and appends a line to ``log`` when given)."""

    def __init__(
        self, examples: list[Example], log: Path | None = None, delay: float = 0.0
    ) -> None:
        self.examples = examples
        self.log = log
        self.delay = delay
        self.calls = 0

    def __call__(self, writer: CacheWriter) -> dict[str, Any]:
        self.calls += 1
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write(f"{os.getpid()}\n")
        writer.add_many(self.examples)
        time.sleep(self.delay)
        return {"n_samples": len(self.examples), "source": "unit"}


def read_all(cache: TokenCache) -> list[Example]:
    return [cache[i] for i in range(len(cache))]


# --------------------------------------------------------------------------- keys
def test_cache_key_is_order_free_and_sensitive_to_every_part() -> None:
    parts: dict[str, str | int] = {
        "data": "abc",
        "tokenizer": "tok1",
        "max_length": 512,
        "packing": 0,
    }
    assert cache_key(parts) == cache_key(dict(reversed(list(parts.items()))))
    assert len(cache_key(parts)) == 24
    assert all(c in "0123456789abcdef" for c in cache_key(parts))
    changed = [
        {**parts, "max_length": 1024},
        {**parts, "tokenizer": "tok2"},
        {**parts, "loss_on": "all"},
        {k: v for k, v in parts.items() if k != "packing"},
    ]
    assert len({cache_key(parts), *(cache_key(p) for p in changed)}) == 5


# --------------------------------------------------------------------------- roundtrip
@pytest.mark.parametrize(
    ("examples", "dtype"), [(mixed_examples(), "uint16"), (wide_examples(), "uint32")]
)
def test_roundtrip_is_exact(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    examples: list[Example],
    dtype: str,
) -> None:
    # Tiny buffers: flushes split samples and the label mask across writes and chunks.
    monkeypatch.setattr(cache_mod, "_FLUSH_TOKENS", 5)
    monkeypatch.setattr(cache_mod, "_COPY_CHUNK", 3)
    built = build(tmp_path / "c", Fill(examples))
    reopened = TokenCache.open(tmp_path / "c", verify=True)
    for cache in (built, reopened):
        assert read_all(cache) == examples
        assert len(cache) == len(examples)
        assert cache.dtype == dtype and cache.tokens.dtype == np.dtype(dtype)
        assert cache.n_tokens == sum(len(e.input_ids) for e in examples)
        assert cache.lengths.dtype == np.int32
        assert cache.lengths.tolist() == [len(e.input_ids) for e in examples]
        assert cache.meta == {"n_samples": len(examples), "source": "unit"}
        assert cache[-1] == examples[-1]
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert manifest["format"] == CACHE_FORMAT and manifest["dtype"] == dtype
    assert sorted(manifest["files"]) == ["labels.npy", "offsets.npy", "tokens.npy"]


def test_storage_is_tokens_plus_one_bit_per_label_plus_offsets(tmp_path: Path) -> None:
    n, length = 200, 50
    examples = [Example([i % 300] * length, [X] * length) for i in range(n)]
    cache = build(tmp_path / "c", Fill(examples))
    data = {p.name: p.stat().st_size - 128 for p in (tmp_path / "c").glob("*.npy")}
    assert data == {
        "tokens.npy": n * length * 2,
        "labels.npy": n * length // 8,
        "offsets.npy": (n + 1) * 8,
    }
    assert read_all(cache) == examples


def test_empty_cache_opens(tmp_path: Path) -> None:
    cache = build(tmp_path / "c", Fill([]))
    again = TokenCache.open(tmp_path / "c", verify=True)
    assert len(cache) == len(again) == 0 and again.n_tokens == 0
    assert again.lengths.tolist() == []
    with pytest.raises(IndexError):
        again[0]


@pytest.mark.parametrize(
    "bad",
    [
        Example([1, 2, 3], [1, 5, 3]),  # label neither the id nor IGNORE_INDEX
        Example([1, 2, 3], [1, 2]),  # lengths differ
        Example([1, -2], [1, X]),  # negative id
        Example([2**32], [X]),  # beyond uint32
    ],
)
def test_add_refuses_labels_and_ids_it_cannot_store(tmp_path: Path, bad: Example) -> None:
    with pytest.raises(ValueError, match="example 1"):
        build(tmp_path / "c", Fill([Example([1], [1]), bad]))
    # Nothing half-written is left behind.
    assert list(tmp_path.iterdir()) == []


def test_writer_streams_to_disk_while_filling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cache_mod, "_FLUSH_TOKENS", 64)
    monkeypatch.setattr(cache_mod, "_FLUSH_SAMPLES", 16)
    seen: list[int] = []

    def fill(writer: CacheWriter) -> dict[str, Any]:
        for i in range(2000):  # 64 KiB of tokens: well past the file object's own buffer
            writer.add(Example([i % 50] * 16, [i % 50] * 16))
            if i % 500 == 499:
                seen.append((writer.directory / "tokens.npy").stat().st_size)
        return {}

    cache = build(tmp_path / "c", fill)
    # The file grows during fill (buffers are flushed), not only at the end.
    assert seen == sorted(seen) and seen[0] > 128 and seen[-1] > seen[0]
    assert len(cache) == 2000


# --------------------------------------------------------------------------- hits
def test_second_open_is_a_hit_without_tokenizing(tmp_path: Path) -> None:
    fill = Fill(mixed_examples())
    key = cache_key({"data": "d1", "max_length": 64})
    first, how = open_or_build(tmp_path, key, fill)
    assert how == "built" and fill.calls == 1
    second, how = open_or_build(tmp_path, key, fill)
    assert how == "hit" and fill.calls == 1
    assert read_all(second) == read_all(first) == mixed_examples()

    other = cache_key({"data": "d1", "max_length": 128})
    _, how = open_or_build(tmp_path, other, fill)
    assert how == "built" and fill.calls == 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == sorted([key, other])


def test_mapped_not_loaded(tmp_path: Path) -> None:
    cache, _ = open_or_build(tmp_path, "k", Fill(wide_examples()))
    for array in (cache.tokens, cache.offsets, cache.label_bits):
        assert isinstance(array, np.memmap)
        assert Path(str(array.filename)).parent == tmp_path / "k"
        assert not array.flags.writeable


# --------------------------------------------------------------------------- torn caches
def _remove_manifest(d: Path) -> None:
    (d / "manifest.json").unlink()


def _truncate_tokens(d: Path) -> None:
    with open(d / "tokens.npy", "r+b") as f:
        f.truncate((d / "tokens.npy").stat().st_size - 2)


def _leave_only_a_temp_dir(d: Path) -> None:
    (d / "labels.npy").unlink()


@pytest.mark.parametrize("tear", [_remove_manifest, _truncate_tokens, _leave_only_a_temp_dir])
def test_torn_cache_is_rebuilt(tmp_path: Path, tear: Callable[[Path], None]) -> None:
    fill = Fill(mixed_examples())
    open_or_build(tmp_path, "k", fill)
    tear(tmp_path / "k")
    with pytest.raises(CorruptCache):
        TokenCache.open(tmp_path / "k")
    cache, how = open_or_build(tmp_path, "k", fill)
    assert how == "rebuilt" and fill.calls == 2
    assert read_all(cache) == mixed_examples()
    assert open_or_build(tmp_path, "k", fill)[1] == "hit"
    # Nothing aside (temp or torn dirs) is left next to the cache.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k", "k.lock"]


def test_flipped_byte_is_caught_by_verify(tmp_path: Path) -> None:
    fill = Fill(mixed_examples())
    open_or_build(tmp_path, "k", fill)
    tokens = tmp_path / "k" / "tokens.npy"
    data = bytearray(tokens.read_bytes())
    data[128] ^= 0x01  # first token id: 5 -> 4
    tokens.write_bytes(bytes(data))

    unverified, how = open_or_build(tmp_path, "k", fill)  # sizes match: a plain open trusts it
    assert how == "hit" and unverified[0].input_ids[0] == 4
    with pytest.raises(CorruptCache, match="sha256"):
        TokenCache.open(tmp_path / "k", verify=True)
    cache, how = open_or_build(tmp_path, "k", fill, verify=True)
    assert how == "rebuilt" and fill.calls == 2
    assert read_all(cache) == mixed_examples()


def test_other_format_is_not_opened(tmp_path: Path) -> None:
    build(tmp_path / "k", Fill(mixed_examples()))
    manifest = tmp_path / "k" / "manifest.json"
    doc = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**doc, "format": CACHE_FORMAT + 1}))
    with pytest.raises(CorruptCache, match="format"):
        TokenCache.open(tmp_path / "k")


# --------------------------------------------------------------------------- remote
def _remote_url(kind: str, tmp_path: Path) -> str:
    if kind == "memory":
        return f"memory://cache-test-{uuid.uuid4().hex[:8]}/data-cache"
    return (tmp_path / "bucket" / "data-cache").as_uri()


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_publish_then_remote_hit_on_a_fresh_machine(tmp_path: Path, kind: str) -> None:
    remote = _remote_url(kind, tmp_path)
    fill = Fill(wide_examples())
    _, how = open_or_build(tmp_path / "vm1", "k", fill, remote=remote)
    assert how == "built" and fill.calls == 1
    fs, root = fsspec.core.url_to_fs(remote)
    published = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/k", detail=False))
    assert published == ["labels.npy", "manifest.json", "offsets.npy", "tokens.npy"]

    cache, how = open_or_build(tmp_path / "vm2", "k", fill, remote=remote)
    assert how == "remote_hit" and fill.calls == 1
    assert read_all(cache) == wide_examples()
    assert (tmp_path / "vm2" / "k" / "manifest.json").exists()
    assert open_or_build(tmp_path / "vm2", "k", fill, remote=remote)[1] == "hit"


def test_a_local_hit_publishes_a_cache_the_bucket_lacks(tmp_path: Path) -> None:
    """Built before ``data.cache_storage`` was set (or its upload failed): the next start
    that has a bucket uploads it, so a fresh machine downloads instead of tokenizing."""
    remote = _remote_url("memory", tmp_path)
    fill = Fill(wide_examples())
    assert open_or_build(tmp_path / "vm1", "k", fill)[1] == "built"
    fs, root = fsspec.core.url_to_fs(remote)
    assert not fs.exists(f"{root}/k/manifest.json")
    assert open_or_build(tmp_path / "vm1", "k", fill, remote=remote)[1] == "hit"
    assert fs.exists(f"{root}/k/manifest.json")
    cache, how = open_or_build(tmp_path / "vm2", "k", fill, remote=remote)
    assert how == "remote_hit" and fill.calls == 1
    assert read_all(cache) == wide_examples()


def test_publish_uploads_the_manifest_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fsspec.implementations.memory import MemoryFileSystem

    uploads: list[str] = []
    real_put = MemoryFileSystem.put_file

    def recording_put(self: Any, lpath: str, rpath: str, *args: Any, **kw: Any) -> Any:
        uploads.append(rpath.rsplit("/", 1)[-1])
        return real_put(self, lpath, rpath, *args, **kw)

    monkeypatch.setattr(MemoryFileSystem, "put_file", recording_put)
    open_or_build(tmp_path, "k", Fill(mixed_examples()), remote=_remote_url("memory", tmp_path))
    assert sorted(uploads) == ["labels.npy", "manifest.json", "offsets.npy", "tokens.npy"]
    assert uploads[-1] == "manifest.json"


@pytest.mark.parametrize("damage", ["no_manifest", "flipped_byte"])
def test_unfinished_or_damaged_remote_is_treated_as_absent(tmp_path: Path, damage: str) -> None:
    remote = _remote_url("memory", tmp_path)
    fill = Fill(mixed_examples())
    open_or_build(tmp_path / "vm1", "k", fill, remote=remote)
    fs, root = fsspec.core.url_to_fs(remote)
    if damage == "no_manifest":  # an upload that died before its manifest
        fs.rm(f"{root}/k/manifest.json")
    else:
        data = bytearray(fs.cat_file(f"{root}/k/tokens.npy"))
        data[130] ^= 0xFF
        fs.pipe_file(f"{root}/k/tokens.npy", bytes(data))

    cache, how = open_or_build(tmp_path / "vm2", "k", fill, remote=remote)
    assert how == "built" and fill.calls == 2
    assert read_all(cache) == mixed_examples()
    assert sorted(p.name for p in (tmp_path / "vm2").iterdir()) == ["k", "k.lock"]
    # The rebuild republished a whole copy: a third machine downloads it.
    _, how = open_or_build(tmp_path / "vm3", "k", fill, remote=remote)
    assert how == "remote_hit" and fill.calls == 2


def test_s3_publish_and_fetch(
    tmp_path: Path, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    remote = s3_server.url(f"token-cache-{uuid.uuid4().hex[:8]}")
    options = {"endpoint_url": s3_server.endpoint_url, "skip_instance_cache": True}
    fill = Fill(wide_examples())
    assert (
        open_or_build(tmp_path / "vm1", "k", fill, remote=remote, storage_options=options)[1]
        == "built"
    )
    prefix = remote.split("/", 3)[3]
    assert sorted(s3_server.list_keys(prefix)) == [
        f"{prefix}/k/{n}" for n in ("labels.npy", "manifest.json", "offsets.npy", "tokens.npy")
    ]
    cache, how = open_or_build(tmp_path / "vm2", "k", fill, remote=remote, storage_options=options)
    assert how == "remote_hit" and fill.calls == 1
    assert read_all(cache) == wide_examples()


# --------------------------------------------------------------------------- processes
def _rank(root: str, log: str, barrier: Any, results: Any) -> None:
    barrier.wait()
    try:
        cache, how = open_or_build(Path(root), "shared", Fill(mixed_examples(), Path(log), 0.3))
        results.put((how, read_all(cache) == mixed_examples()))
    except Exception as e:  # reported, so the test fails at once rather than timing out
        results.put(("error", repr(e)))


def test_two_processes_build_once(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    log = tmp_path / "builds.log"
    procs = [
        ctx.Process(target=_rank, args=(str(tmp_path / "root"), str(log), barrier, results))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    outcomes = sorted(results.get(timeout=30) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert outcomes == [("built", True), ("hit", True)]
    assert len(log.read_text().splitlines()) == 1
