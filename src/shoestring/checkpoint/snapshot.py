"""A snapshot: the host-memory copy of everything a checkpoint holds.

Copying a snapshot is the only part of a save that blocks training: tensors are
copied to host memory or a shared-memory buffer (so later steps can mutate the
live ones) and small JSON documents are deep-copied. Serialization — safetensors for tensors, JSON
for the rest, never pickle — happens later, off the training thread, and writes the
tensors from the snapshot itself: a save holds the state in host memory once.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from shoestring.stwriter import TensorFile


@dataclass
class Snapshot:
    step: int
    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    documents: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in self.tensors.values() for t in d.values())


def make_snapshot(
    step: int,
    tensors: Mapping[str, Mapping[str, torch.Tensor]],
    documents: Mapping[str, Any],
    meta: Mapping[str, Any],
) -> Snapshot:
    """A snapshot that still references the live tensors; the writer copies them
    (into host memory or shared memory) before training may continue."""
    return Snapshot(
        step=step,
        tensors={f: dict(d) for f, d in tensors.items()},
        documents=copy.deepcopy(dict(documents)),
        meta=copy.deepcopy(dict(meta)),
    )


def serialize(snap: Snapshot) -> dict[str, TensorFile | bytes]:
    """File name → content. ``*.safetensors`` for tensors (written from the snapshot's
    own memory as the file is written), ``*.json`` for documents (bytes)."""
    files: dict[str, TensorFile | bytes] = {}
    for name, tensors in sorted(snap.tensors.items()):
        files[name] = TensorFile.of(tensors)
    for name, doc in sorted(snap.documents.items()):
        files[name] = json.dumps(doc, indent=1, sort_keys=True).encode()
    return files


def load_files(
    ckpt_dir: Path, names: list[str]
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    docs: dict[str, Any] = {}
    for name in names:
        p = ckpt_dir / name
        if name.endswith(".safetensors"):
            tensors[name] = load_file(str(p))
        elif name.endswith(".json"):
            docs[name] = json.loads(p.read_text())
    return tensors, docs
