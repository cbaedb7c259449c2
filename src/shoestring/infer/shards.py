"""Safetensors shards read by header offsets, straight into caller-owned buffers.

No split copy of the model is made (AirLLM writes one file per layer, doubling
disk use): the header of each original shard gives every tensor's byte range,
a layer's ranges are coalesced into a few large ``preadv`` calls, and the bytes
land in a preallocated (optionally pinned) buffer that is reused pass after pass.
"""

from __future__ import annotations

import errno
import json
import os
import re
import struct
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
#: Ranges start and end on this boundary, in the file and in the buffer: what O_DIRECT
#: needs (and more than any dtype's alignment). Costs < 8 KiB of extra read per range.
ALIGN = 4096
#: Ranges closer than this in a file are read as one (a few wasted bytes beat a syscall).
MERGE_GAP = 4096
_LAYER_RE = re.compile(r"\.layers\.\d+\.")


class ShardError(ValueError):
    """A model directory whose weights cannot be streamed (names the file)."""


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes are: file, absolute offset, length, dtype, shape."""

    key: str
    file: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def renamed(self, key: str) -> TensorRef:
        """The same bytes under another key (a stored part, a tied or renamed tensor)."""
        return replace(self, key=key)


def same_bytes(a: TensorRef, b: TensorRef, chunk: int = 16 << 20) -> bool:
    """Whether two stored tensors are the same: dtype, shape and every byte (compared a
    ``chunk`` at a time, through the page cache, whose pages are then dropped)."""
    if (a.dtype, a.shape, a.nbytes) != (b.dtype, b.shape, b.nbytes):
        return False
    if (a.file, a.offset) == (b.file, b.offset):
        return True
    with open(a.file, "rb") as fa, open(b.file, "rb") as fb:
        try:
            for pos in range(0, a.nbytes, chunk):
                n = min(chunk, a.nbytes - pos)
                if os.pread(fa.fileno(), n, a.offset + pos) != os.pread(
                    fb.fileno(), n, b.offset + pos
                ):
                    return False
        finally:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fa.fileno(), a.offset, a.nbytes, os.POSIX_FADV_DONTNEED)
                os.posix_fadvise(fb.fileno(), b.offset, b.nbytes, os.POSIX_FADV_DONTNEED)
    return True


def generic_key(key: str) -> str:
    """``key`` without its decoder-layer index: a ring slot holds different layers over
    time, and reuses one scratch buffer per generic name."""
    return _LAYER_RE.sub(".layers.*.", key)


def read_header(path: Path) -> dict[str, TensorRef]:
    """Parse one safetensors file's header into TensorRefs (absolute offsets)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ShardError(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20:
            raise ShardError(f"{path}: header length {n} is not plausible")
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise ShardError(f"{path}: unreadable safetensors header: {e}") from e
    base = 8 + n
    out: dict[str, TensorRef] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise ShardError(f"{path}: tensor {key} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        out[key] = TensorRef(
            key, path, base + begin, end - begin, DTYPES[info["dtype"]], tuple(info["shape"])
        )
    return out


def index_model(model_dir: Path) -> dict[str, TensorRef]:
    """Every tensor of a model directory: ``model.safetensors`` or a sharded index."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ShardError(
            f"{model_dir}: no model.safetensors(.index.json); only safetensors "
            "checkpoints can be streamed (convert .bin files with "
            "transformers' save_pretrained)"
        )
    refs: dict[str, TensorRef] = {}
    for name in files:
        refs.update(read_header(model_dir / name))
    return refs


@dataclass
class _Range:
    file: Path
    start: int
    end: int
    members: list[TensorRef] = field(default_factory=list)


@dataclass(frozen=True)
class ReadPlan:
    """How a group of tensors is laid out in a buffer and read from disk."""

    # (file, aligned file offset, aligned length, buffer offset, bytes that must be read)
    ranges: tuple[tuple[Path, int, int, int, int], ...]
    slots: dict[str, tuple[int, torch.dtype, tuple[int, ...]]]  # key -> (buffer offset, ...)
    nbytes: int  # buffer bytes needed
    read_bytes: int  # bytes read from disk (>= tensor bytes: merged gaps)


def plan_reads(refs: list[TensorRef]) -> ReadPlan:
    """Coalesce tensor byte ranges per file; place each range at an aligned buffer offset."""
    ranges: list[_Range] = []
    for ref in sorted(refs, key=lambda r: (str(r.file), r.offset)):
        last = ranges[-1] if ranges else None
        item = ref.dtype.itemsize
        if (
            last is not None
            and last.file == ref.file
            and ref.offset - last.end <= MERGE_GAP
            and (ref.offset - last.start) % item == 0
            and ref.offset >= last.end
        ):
            last.end = max(last.end, ref.offset + ref.nbytes)
            last.members.append(ref)
        else:
            ranges.append(_Range(ref.file, ref.offset, ref.offset + ref.nbytes, [ref]))
    pos = 0
    out_ranges = []
    slots: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
    read = 0
    for r in ranges:
        start = r.start - r.start % ALIGN
        length = -(-(r.end - start) // ALIGN) * ALIGN
        out_ranges.append((r.file, start, length, pos, r.end - start))
        for m in r.members:
            slots[m.key] = (pos + m.offset - start, m.dtype, m.shape)
        read += length
        pos += length
    return ReadPlan(tuple(out_ranges), slots, pos, read)


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 buffer whose first byte is ALIGN-aligned (O_DIRECT reads land in it)."""
    raw = torch.empty(max(nbytes, 1) + ALIGN, dtype=torch.uint8, pin_memory=pin)
    off = -raw.data_ptr() % ALIGN
    return raw[off : off + max(nbytes, 1)]


class ShardReader:
    """Keeps shard files open and reads :class:`ReadPlan` ranges into aligned buffers.

    ``direct`` reads with ``O_DIRECT``: the disk DMAs straight into our buffer, with
    no copy through the page cache (which costs CPU that compute needs, and fills
    memory with pages a model larger than memory cannot reuse). Where O_DIRECT is
    refused (tmpfs, some network file systems) it falls back to buffered reads and
    drops the pages it read (``POSIX_FADV_DONTNEED``).
    """

    def __init__(self, direct: bool = True) -> None:
        self._fds: dict[tuple[Path, bool], int] = {}
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.bytes_read = 0
        self.read_s = 0.0

    def _fd(self, path: Path, direct: bool) -> int:
        fd = self._fds.get((path, direct))
        if fd is None:
            flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
            fd = self._fds[(path, direct)] = os.open(path, flags)
        return fd

    def _pread(self, path: Path, view: memoryview, offset: int, need: int) -> None:
        direct = self.direct
        done = 0
        while done < need:
            try:
                n = os.preadv(self._fd(path, direct), [view[done:]], offset + done)
            except OSError as e:
                if not direct or e.errno != errno.EINVAL:
                    raise
                self.direct = direct = False  # this file system refuses O_DIRECT
                continue
            if n <= 0:
                raise ShardError(f"{path}: unexpected end of file at {offset + done}")
            done += n
        if not direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd(path, False), offset, len(view), os.POSIX_FADV_DONTNEED)

    def read(self, plan: ReadPlan, buf: torch.Tensor) -> None:
        t0 = time.perf_counter()
        view = memoryview(buf.numpy()).cast("B")  # type: ignore[arg-type]  # numpy exports the buffer protocol
        for path, offset, length, at, need in plan.ranges:
            # The aligned tail may run past the end of the file: only `need` must arrive.
            self._pread(path, view[at : at + length], offset, need)
            self.bytes_read += length
        self.read_s += time.perf_counter() - t0

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def views(plan: ReadPlan, buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """Typed tensor views of ``plan``'s tensors inside ``buf`` (no copy)."""
    out = {}
    for key, (at, dtype, shape) in plan.slots.items():
        n = 1
        for s in shape:
            n *= s
        raw = buf[at : at + n * dtype.itemsize]
        out[key] = raw.view(dtype).view(shape)
    return out
