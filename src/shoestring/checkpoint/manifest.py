"""The manifest: the commit marker of a checkpoint.

A checkpoint directory counts only if ``manifest.json`` exists, parses, and
lists every file with its size and sha256. It is written last, after every
data file is durable, so its presence means the set of files is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT = "shoestring-checkpoint/1"


class CorruptCheckpoint(Exception):
    """A checkpoint failed verification; the message says which file and why."""


@dataclass
class FileEntry:
    size: int
    sha256: str


@dataclass
class Manifest:
    step: int
    files: dict[str, FileEntry]
    meta: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT

    def to_json(self) -> str:
        d = asdict(self)
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> Manifest:
        try:
            d = json.loads(text)
            if d.get("format") != FORMAT:
                raise CorruptCheckpoint(f"{where}: unknown manifest format {d.get('format')!r}")
            files = {
                check_name(k, where): FileEntry(int(v["size"]), str(v["sha256"]))
                for k, v in d["files"].items()
            }
            return cls(step=int(d["step"]), files=files, meta=dict(d.get("meta", {})))
        except CorruptCheckpoint:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptCheckpoint(f"{where}: unreadable manifest ({e})") from e

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())


def check_name(name: str, where: str) -> str:
    """A manifest's file name: a plain relative path inside the checkpoint — not absolute,
    no ``..``, ``.`` or empty part, no backslash or NUL. A bucket (shared, or compromised)
    must not be able to make a fetch or a load touch anything outside the directory."""
    parts = name.split("/") if isinstance(name, str) else [""]
    if (
        not isinstance(name, str)
        or "\\" in name
        or "\0" in name
        or name.startswith("/")
        or any(part in ("", ".", "..") for part in parts)
    ):
        raise CorruptCheckpoint(
            f"{where}: file name {name!r} is not a plain relative path inside the "
            "checkpoint; refused"
        )
    return name


def _no_symlink(ckpt_dir: Path, name: str) -> None:
    """A checkpoint is self-contained: neither it nor any path to one of its files is a
    symlink (one could point at another run's checkpoint, or anywhere)."""
    p = ckpt_dir
    for part in [None, *name.split("/")]:
        p = p if part is None else p / part
        if p.is_symlink():
            raise CorruptCheckpoint(f"{p}: is a symlink; a checkpoint must be self-contained")


def sha256_bytes(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_manifest(ckpt_dir: Path) -> Manifest:
    p = ckpt_dir / MANIFEST
    try:
        text = p.read_text()
    except FileNotFoundError as e:
        raise CorruptCheckpoint(f"{ckpt_dir}: no {MANIFEST} (never committed)") from e
    return Manifest.from_json(text, str(p))


def verify_dir(ckpt_dir: Path, *, deep: bool) -> Manifest:
    """Check a local checkpoint against its manifest. ``deep`` also checks sha256."""
    m = read_manifest(ckpt_dir)
    for name, entry in m.files.items():
        _no_symlink(ckpt_dir, name)
        p = ckpt_dir / name
        try:
            size = os.path.getsize(p)
        except OSError as e:
            raise CorruptCheckpoint(f"{p}: missing") from e
        if size != entry.size:
            raise CorruptCheckpoint(f"{p}: size {size} != {entry.size} in manifest (truncated?)")
        if deep and sha256_file(p) != entry.sha256:
            raise CorruptCheckpoint(f"{p}: sha256 mismatch (corrupted)")
    return m
