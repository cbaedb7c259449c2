"""This process's host heap: what glibc and oneDNN keep besides the tensors a job holds.

Shared by the streaming engine (``infer``) and the trainer on a CPU: both allocate and
free blocks of many sizes, and both compute bf16 matmuls of many shapes (a pass's
growing KV cache; a mixture-of-experts layer's routed tokens, a different count per
expert and step), which glibc's and oneDNN's defaults turn into resident memory that
no tensor holds.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
from collections.abc import Iterator
from typing import Any


def trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc ``malloc_trim``; elsewhere a no-op).

    Every decode pass frees each layer's KV cache and allocates one a token longer;
    glibc keeps the holes, so without a trim RSS creeps past the plan pass after pass
    (measured: benchmarks/README.md). Trimming after each pass costs a few ms."""
    libc = _libc_with_malloc_trim()
    if libc is not None:
        libc.malloc_trim(0)


#: Allocations from this size up get their own mapping, returned to the OS when freed.
MMAP_THRESHOLD = 4 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
#: Entries of oneDNN's primitive cache and of ideep's (torch's oneDNN wrapper) own
#: cache: enough for every weight shape of a decode pass to hit.
ONEDNN_CACHE_ENTRIES = 8


def steady_memory() -> None:
    """Keep what the process holds besides the plan's buffers small and bounded.

    - glibc's mmap threshold fixed at :data:`MMAP_THRESHOLD` (elsewhere a no-op): by
      default glibc raises it to the size of each large block freed (up to 32 MB), so
      after the first layer every activation, KV-cache copy and dequantization buffer
      of a pass comes from the heap, whose holes stay resident until the pass ends
      (measured 18-31 MB over the plan on a 122 MB model; docs/inference.md). Fixed, a
      large block is unmapped when freed, at the cost of a page fault per fresh page
      (measured: fp32 decode unchanged, a resident bf16 decode ~3 % slower).
    - oneDNN's primitive cache and ideep's cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``,
      ``LRU_CACHE_CAPACITY``; default 1024 each) cut to :data:`ONEDNN_CACHE_ENTRIES`
      unless set: a bf16 matmul on CPU caches a primitive per shape, and every
      micro-batch length and running-row count is a new shape (measured: 2.3 GB for
      1280 shapes of a 2048x5632 weight; 8 entries: under 50 MB, no measurable
      slowdown). Read when oneDNN first runs, so this must come before any bf16
      matmul; set in the environment, so child processes get them too.
    """
    bounded_primitive_cache()
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(ONEDNN_CACHE_ENTRIES))
    _mmap_threshold(MMAP_THRESHOLD)


def bounded_primitive_cache() -> None:
    """oneDNN's primitive cache cut to :data:`ONEDNN_CACHE_ENTRIES` unless set (read when
    oneDNN first runs: call before any bf16 matmul). A mixture of experts multiplies a
    new shape per expert and step; at an OLMoE-1B-7B shape a CPU QLoRA step's second
    step then peaked at 6.1-6.2 GB instead of 8.9-9.4 GB, in 19-20 s instead of 24-26 s
    (``benchmarks/results/moe-heap-olmoe-1b-7b-primitives-2026-12-07.txt``)."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_ENTRIES))


#: glibc's ceiling for its dynamic mmap threshold (64-bit): where its defaults settle.
MMAP_THRESHOLD_MAX = 32 << 20
#: The threshold while a base loads: under the smallest 16-bit expert matrix of the MoE
#: families trained here (Qwen3-30B-A3B's, 768 x 2048: 3 MB; OLMoE's 4 MB).
LOAD_MMAP_THRESHOLD = 1 << 20


@contextlib.contextmanager
def unmapped_when_freed() -> Iterator[None]:
    """Within: blocks from :data:`LOAD_MMAP_THRESHOLD` up are mappings of their own,
    returned to the OS when freed; after: the threshold at :data:`MMAP_THRESHOLD_MAX`,
    where glibc's dynamic one settles, and the heap trimmed (elsewhere a no-op).

    For a load that passes a model through blocks of a few MB (a 16-bit expert read,
    stacked, quantized, freed; the NF4 scales kept between them): with glibc's
    defaults its peak varied from 7.1 to 11.5 GB between identical runs at an
    OLMoE-1B-7B shape, once 24 GB (killed). The steps after keep glibc's usual
    behaviour: the threshold fixed at 4 MB made them 2x slower
    (``benchmarks/results/moe-heap-olmoe-1b-7b-2026-12-07.txt``). At 4 MB, a
    Qwen3-30B-A3B shape's 3 MB experts still passed through the heap: its load peaked at
    22.2 GB for 17.1 GB held after it (benchmarks/README.md)."""
    _mmap_threshold(LOAD_MMAP_THRESHOLD)
    try:
        yield
    finally:
        _mmap_threshold(MMAP_THRESHOLD_MAX)
        trim_heap()


def _mmap_threshold(nbytes: int) -> None:
    """glibc's mmap threshold fixed at ``nbytes`` (elsewhere a no-op)."""
    libc = _libc_with_malloc_trim()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(_M_MMAP_THRESHOLD, nbytes)


@functools.cache
def _libc_with_malloc_trim() -> Any:
    """The C library, if it is glibc (has ``malloc_trim``); None elsewhere."""
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "malloc_trim") else None
