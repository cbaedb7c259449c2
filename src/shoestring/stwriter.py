"""Writing sharded safetensors a tensor (and a block of rows) at a time.

``safetensors.torch.save_file`` needs every tensor of a file in memory at once; a
7B model's merged export or a random-init real-shape model would then need its
whole 13.5 GB in RAM. Here the header (names, dtypes, shapes, offsets) is laid
out first from the tensors' specs, and each tensor's bytes are streamed after it,
so peak memory is one block. The files follow the format (8-byte little-endian
header length, JSON header padded to 8 bytes, data in header order) and the
Hub's sharding convention (``model-0000k-of-0000n.safetensors`` plus
``model.safetensors.index.json``); ``safetensors.safe_open`` and
``from_pretrained`` read them.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

INDEX_NAME = "model.safetensors.index.json"
_ST_DTYPES = {
    torch.float64: "F64",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e8m0fnu: "F8_E8M0",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.bool: "BOOL",
}

#: safetensors' own order of dtypes (its ``Dtype`` enum). ``safetensors.torch.save``
#: lays a file's tensors out by dtype, this order reversed, then by name, so each
#: tensor's data is aligned to its element size.
_ST_ORDER = (
    "BOOL F4 F6_E2M3 F6_E3M2 U8 I8 F8_E5M2 F8_E4M3 F8_E8M0 I16 U16 F16 BF16 I32 U32 F32 C64 "
    "F64 I64 U64"
).split()


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return (
            int(torch.Size(self.shape).numel()) * torch.empty((), dtype=self.dtype).element_size()
        )


#: Yields a tensor's values as blocks of leading rows, in order (their concatenation
#: along dim 0 is the tensor; a 0-d tensor is one block).
BlockSource = Callable[[TensorSpec], Iterable[torch.Tensor]]


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Greedy split in order; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def header_bytes(specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    return _header(specs, metadata or {"format": "pt"})


def _header(specs: list[TensorSpec], metadata: dict[str, str] | None) -> bytes:
    """The JSON header, padded; no ``__metadata__`` entry when ``metadata`` is None."""
    meta: dict[str, object] = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for s in specs:
        meta[s.name] = {
            "dtype": _ST_DTYPES[s.dtype],
            "shape": list(s.shape),
            "data_offsets": [offset, offset + s.nbytes],
        }
        offset += s.nbytes
    raw = json.dumps(meta, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes


def _checked_blocks(spec: TensorSpec, blocks: Iterable[torch.Tensor]) -> Iterator[bytes]:
    written = 0
    for block in blocks:
        if block.dtype != spec.dtype:
            raise ValueError(f"{spec.name}: block dtype {block.dtype} != {spec.dtype}")
        data = block.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        written += data.nbytes
        yield data.tobytes()
    if written != spec.nbytes:
        raise ValueError(f"{spec.name}: wrote {written} bytes, its shape needs {spec.nbytes}")


def write_file(path: Path, specs: list[TensorSpec], source: BlockSource) -> int:
    """One safetensors file, fsynced; returns its data bytes."""
    header = header_bytes(specs)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for spec in specs:
            for chunk in _checked_blocks(spec, source(spec)):
                f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    return sum(s.nbytes for s in specs)


def write_sharded(
    target: Path, specs: list[TensorSpec], source: BlockSource, max_shard_bytes: int = 2 << 30
) -> list[str]:
    """``target/model-*.safetensors`` and the index; returns the shard file names.

    One shard is written as ``model.safetensors`` with no index, as
    ``save_pretrained`` does."""
    target.mkdir(parents=True, exist_ok=True)
    shards = plan_shards(specs, max_shard_bytes)
    if len(shards) == 1:
        write_file(target / "model.safetensors", shards[0], source)
        return ["model.safetensors"]
    names: list[str] = []
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        write_file(target / fname, shard, source)
        names.append(fname)
        weight_map.update({s.name: fname for s in shard})
    index = {"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": weight_map}
    (target / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return names


@dataclass(frozen=True)
class TensorFile:
    """A safetensors file of host tensors, written from their own memory as it goes:
    the bytes ``safetensors.torch.save`` returns (a test checks equality), never built
    whole. ``save`` holds the file twice (its buffer, then the ``bytes``), and
    ``save_file``, which streams, reports a full disk as text with no ``errno``
    and leaves the hash to a second read. A checkpoint's snapshot written this way
    costs host memory once; its sha256 is taken from the same chunks as written.

    A contiguous tensor is written from its own memory, any other is made
    contiguous alone, one at a time."""

    header: bytes  # the 8-byte length, then the JSON header padded to 8 bytes
    tensors: tuple[torch.Tensor, ...]  # in file order

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> TensorFile:
        def rank(item: tuple[str, torch.Tensor]) -> tuple[int, str]:
            return (-_ST_ORDER.index(_ST_DTYPES[item[1].dtype]), item[0])

        ordered = sorted(tensors.items(), key=rank)
        header = _header([TensorSpec(n, tuple(t.shape), t.dtype) for n, t in ordered], None)
        return cls(struct.pack("<Q", len(header)) + header, tuple(t for _, t in ordered))

    @property
    def nbytes(self) -> int:
        return len(self.header) + sum(t.numel() * t.element_size() for t in self.tensors)

    def chunks(self) -> Iterator[memoryview]:
        yield memoryview(self.header)
        for t in self.tensors:
            flat = t.detach().cpu().contiguous().reshape(-1)
            yield flat.view(torch.uint8).numpy().data
