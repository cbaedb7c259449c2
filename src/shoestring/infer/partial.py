"""A chunk's generation saved between passes, so a stop does not throw the chunk away.

A chunk is one job batch, and batching is what makes streamed inference fast, so
a chunk can be long: a 70B model streamed from an NVMe disk at ~3 GB/s needs
about 45 s per pass, and 256 new tokens are over three hours. When a chunk's time
exceeds the time between preemptions, recomputing it from its prefill after every
stop means the job never ends. So when the job is asked to stop, it finishes the
pass it is in and saves the generation state (:class:`~shoestring.infer.decode.GenState`):
generated tokens, the next input of every micro-batch and its KV cache. The rerun
loads it and continues with the next pass on the same tensors, so the output is
byte-identical to an uninterrupted run.

Layout, committed like a checkpoint (temp dir, fsync, manifest last, rename) as
``partial/step-K`` for chunk K::

    state.json          passes done, groups, tokens, finish reasons, cache kinds
    batch.safetensors   next input ids and attention mask per micro-batch
    kv-NNN.safetensors  layer NNN's cache for every micro-batch (one file per layer:
                        a device cache is copied to the host a layer at a time)
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from shoestring.checkpoint.faults import NO_FAULTS, FaultPlan
from shoestring.checkpoint.local import FileData, seal, write_file_durably
from shoestring.checkpoint.manifest import (
    CorruptCheckpoint,
    FileEntry,
    read_manifest,
    sha256_file,
)
from shoestring.infer.decode import Generated, GenState
from shoestring.infer.engine import MicroBatch, StreamingCausalLM
from shoestring.infer.kvcache import Int8KVLayer
from shoestring.stwriter import TensorFile

STATE = "state.json"
BATCH = "batch.safetensors"


class Unsupported(Exception):
    """A cache layer kind this module cannot save (the chunk is then recomputed)."""


def _layer_tensors(layer: Any) -> tuple[str, dict[str, torch.Tensor], dict[str, int]]:
    if not getattr(layer, "is_initialized", False):
        raise Unsupported("a cache layer was never filled")
    if isinstance(layer, Int8KVLayer):
        assert layer._k is not None and layer._v is not None
        return (
            "int8",
            {"kq": layer._k[0], "ks": layer._k[1], "vq": layer._v[0], "vs": layer._v[1]},
            {"length": layer.length},
        )
    if isinstance(layer, DynamicLayer):  # also the sliding-window layer, a subclass
        ints = (
            {"cumulative_length": layer.cumulative_length}
            if hasattr(layer, "cumulative_length")
            else {}
        )
        assert layer.keys is not None and layer.values is not None  # is_initialized
        return "dense", {"k": layer.keys, "v": layer.values}, ints
    raise Unsupported(f"cache layer {type(layer).__name__}")


def save(
    root: Path, chunk: int, state: GenState, meta: dict[str, Any], faults: FaultPlan = NO_FAULTS
) -> tuple[Path, int]:
    """Commit ``state`` as ``root``/step-``chunk``; returns (path, bytes written).

    Raises :class:`Unsupported` (nothing written) for a cache it cannot save."""
    n_layers = len(state.mbs[0].cache.layers) if state.mbs else 0  # (0: every sequence ended)
    kinds = [
        [_layer_tensors(mb.cache.layers[i])[0] for i in range(n_layers)] for mb in state.mbs
    ]  # checks every layer before anything is written
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-partial-{chunk}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    entries: dict[str, FileEntry] = {}
    try:

        def put(name: str, data: FileData) -> None:
            entries[name] = write_file_durably(tmp / name, data, faults)
            faults.hit("ckpt.after_file")

        _write_state(state, n_layers, kinds, put)
        path, _ = seal(tmp, root, chunk, meta, faults, entries)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path, sum(e.size for e in entries.values())


def _write_state(
    state: GenState, n_layers: int, kinds: list[list[str]], put: Callable[[str, FileData], None]
) -> None:
    """The batch inputs, one safetensors file of K/V per layer, and the JSON document."""
    ints: list[list[dict[str, int]]] = [[] for _ in state.mbs]
    inputs = {
        f"{j}.{name}": getattr(mb, name).contiguous()
        for j, mb in enumerate(state.mbs)
        for name in ("input_ids", "attention_mask")
    }
    put(BATCH, TensorFile.of(inputs))
    for i in range(n_layers):
        tensors: dict[str, torch.Tensor] = {}
        for j, mb in enumerate(state.mbs):
            _, ts, extra = _layer_tensors(mb.cache.layers[i])
            tensors.update({f"{j}.{k}": t.detach().to("cpu").contiguous() for k, t in ts.items()})
            ints[j].append(extra)
        put(f"kv-{i:03d}.safetensors", TensorFile.of(tensors))
    doc = {
        "step": state.step,
        "groups": state.groups,
        "tokens": [g.tokens for g in state.out],
        "finish": [g.finish for g in state.out],
        "logprobs": [g.logprobs for g in state.out],
        "top": [g.top for g in state.out],
        "done": state.done,
        "layers": n_layers,
        "kinds": kinds,
        "ints": ints,
    }
    put(STATE, json.dumps(doc).encode())


def load(path: Path, engine: StreamingCausalLM, n_seqs: int) -> GenState:
    """The state saved in ``path``, its caches rebuilt on ``engine``'s device.

    Raises CorruptCheckpoint when a file does not match the manifest or the state does
    not fit this chunk (another number of sequences or layers)."""
    from safetensors.torch import load_file

    man = read_manifest(path)
    for name, entry in man.files.items():
        if sha256_file(path / name) != entry.sha256:
            raise CorruptCheckpoint(f"{path / name} does not match its manifest")
    st = json.loads((path / STATE).read_text())
    rows = [i for g in st["groups"] for i in g]  # (ended sequences may have left)
    if (
        len(st["tokens"]) != n_seqs
        or len(set(rows)) != len(rows)
        or not all(0 <= i < n_seqs for i in rows)
    ):
        raise CorruptCheckpoint(
            f"{path}: saved for {len(st['tokens'])} sequences, this chunk has {n_seqs}"
        )
    batch = load_file(str(path / BATCH))
    mbs = [
        MicroBatch(batch[f"{j}.input_ids"], batch[f"{j}.attention_mask"], cache=engine.new_cache())
        for j in range(len(st["groups"]))
    ]
    if any(len(mb.cache.layers) != st["layers"] for mb in mbs):
        raise CorruptCheckpoint(f"{path}: saved for {st['layers']} cache layers")
    like = torch.empty(0, dtype=engine.dtype, device=engine.device)
    for i in range(st["layers"]):
        ts = load_file(str(path / f"kv-{i:03d}.safetensors"), device=str(engine.device))
        for j, mb in enumerate(mbs):
            layer, kind, extra = mb.cache.layers[i], st["kinds"][j][i], st["ints"][j][i]
            if kind == "int8":
                layer.lazy_initialization(like, like)
                layer._k, layer._v = (ts[f"{j}.kq"], ts[f"{j}.ks"]), (ts[f"{j}.vq"], ts[f"{j}.vs"])
            else:
                layer.lazy_initialization(ts[f"{j}.k"], ts[f"{j}.v"])
                layer.keys, layer.values = ts[f"{j}.k"], ts[f"{j}.v"]
            for k, v in extra.items():
                setattr(layer, k, v)
    n = len(st["tokens"])
    out = [
        Generated(list(t), f, list(lp), [[(int(a), float(b)) for a, b in alt] for alt in top])
        for t, f, lp, top in zip(
            st["tokens"], st["finish"], st.get("logprobs", [[]] * n), st.get("top", [[]] * n)
        )
    ]
    return GenState(st["groups"], mbs, out, list(st["done"]), st["step"])
