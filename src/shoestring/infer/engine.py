"""The streaming engine: a transformers model built on ``meta``, fed one unit at a time.

The model's own modules (decoder layers, norms, rotary embedding, mask
builders) do the math, so every architecture transformers supports with the
usual ``model.layers`` layout works, and the numbers are the ones the in-memory
model computes. Only the weights are ours: before a unit runs, its parameters
are pointed at views into a streamed buffer.

The schedule is batch-major: each unit (embed, layer i, head) is acquired once
per pass and applied to every micro-batch of the job batch before the next unit
is acquired, so a decode step reads each layer once for all sequences.

A tied ``lm_head`` (the input embedding's tensor) is not a second copy: it belongs
to the embed unit only, so it is read at most once per pass and held once. When
the embed unit is streamed, the head acquires it as the first read of the *next*
pass (the reader's cyclic order already puts it there) and keeps it for that
pass's embedding lookup.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from shoestring.heap import trim_heap
from shoestring.infer.fused import Fused, KeyMap, key_map
from shoestring.infer.kvcache import fill_from_prefix, int8_cache, takes_prefix
from shoestring.infer.shards import (
    ReadPlan,
    ShardError,
    TensorRef,
    generic_key,
    index_model,
    plan_reads,
    same_bytes,
)
from shoestring.infer.stream import LayerStreamer, Prepare, PrepareAt, Slot
from shoestring.infer.textview import has_tower, text_model, text_view


@dataclass
class Unit:
    """A streamed piece of the model: its modules' parameters and where their bytes are."""

    name: str  # "embed", "layers.3", "head"
    params: dict[str, tuple[nn.Module, str]]  # checkpoint key -> (module, attribute)
    refs: list[TensorRef]
    plan: ReadPlan = field(init=False)
    # Params whose tensor is another unit's (a tied lm_head): key -> key in unit 0.
    shared: dict[str, str] = field(default_factory=dict)
    # Params built from several of the unit's tensors (an MoE layer's experts).
    fused: dict[str, Fused] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.plan = plan_reads(self.refs)


class PassStopped(Exception):
    """A pass was abandoned before unit ``args[0]`` because its ``stop`` said so."""


@dataclass
class MicroBatch:
    """State of a group of sequences that go through a layer in one call."""

    input_ids: torch.Tensor  # (b, t) tokens fed this pass
    attention_mask: torch.Tensor  # (b, past + t), 0 on left padding
    cache: Any = None  # transformers DynamicCache, or None when scoring
    hidden: torch.Tensor | None = None
    extras: dict[str, Any] = field(default_factory=dict)  # masks, rotary, position ids
    # Prefill only: a one-row micro-batch of the prompt prefix these rows share; its
    # keys and values start this one's cache, layer by layer (infer/prefix.py).
    prefix: MicroBatch | None = None


def _with_prefixes(batches: list[MicroBatch]) -> list[MicroBatch]:
    """The shared prefixes of ``batches`` (each once, in order), then ``batches``: a
    prefix runs each layer before the micro-batches that continue it."""
    prefixes: list[MicroBatch] = []
    for mb in batches:
        if mb.prefix is not None and all(p is not mb.prefix for p in prefixes):
            prefixes.append(mb.prefix)
    return prefixes + batches


def build_skeleton(model_dir: Path, dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """(config, model on the meta device): structure without any weight memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    if has_tower(config):  # a vision-language checkpoint: its text model (infer.textview)
        return text_model(config, dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    return config, model


def materialize_buffers(model: Any, device: torch.device) -> list[str]:
    """The model's non-persistent buffers, which no checkpoint holds (Gemma's embedding
    scale), made on ``device`` and set by the model's own initializer; the rotary
    tables are the engine's own. Returns their names."""
    made = []
    for name, module in model.named_modules():
        if "rotary" in name:
            continue
        meta = [b for b in module._non_persistent_buffers_set if _is_meta(module._buffers.get(b))]
        for b in meta:
            module._buffers[b] = torch.empty_like(module._buffers[b], device=device)
            made.append(f"{name}.{b}")
        if meta:
            model._init_weights(module)
    return made


def _is_meta(t: torch.Tensor | None) -> bool:
    return t is not None and t.is_meta


def _decoder_layers(model: nn.Module, n_layers: int) -> tuple[str, nn.ModuleList]:
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n_layers and name.endswith("layers"):
            return name, mod
    raise ShardError(
        f"{type(model).__name__}: no decoder-layer list of {n_layers} modules; "
        "this architecture is not supported by the streaming engine"
    )


def stored_dtype(refs: dict[str, TensorRef]) -> torch.dtype:
    floats = [r.dtype for r in refs.values() if r.dtype.is_floating_point]
    return max(set(floats), key=floats.count) if floats else torch.float32


def _module_key(model: nn.Module, module: nn.Module) -> str:
    """The checkpoint key of ``module``'s weight."""
    return next(f"{n}.weight" for n, m in model.named_modules() if m is module)


def tied_keys(model: Any, config: Any, refs: dict[str, TensorRef]) -> dict[str, str]:
    """``{lm_head key: embedding key}`` when the output embedding is the input one's
    tensor: a tied config with no head stored, or a stored head that is the same
    bytes (transformers ties those too; a different one it keeps apart)."""
    head = model.get_output_embeddings()
    embed_key = _module_key(model, model.get_input_embeddings())
    if head is None or embed_key not in refs:
        return {}
    head_key = _module_key(model, head)
    stored, embed = refs.get(head_key), refs[embed_key]
    tie = bool(getattr(config, "tie_word_embeddings", False))
    if head_key == embed_key:
        return {}
    if stored is None:
        return {head_key: embed_key} if tie else {}
    if not tie and (stored.file, stored.offset) != (embed.file, embed.offset):
        return {}  # untied: two tensors, even if equal (transformers keeps them apart)
    return {head_key: embed_key} if same_bytes(stored, embed) else {}


def _param_groups(model: Any, n_layers: int) -> dict[str, dict[str, tuple[nn.Module, str]]]:
    """Every parameter key (tied ones under each name) by unit: embed, layers.i, head."""
    layers_name, _ = _decoder_layers(model, n_layers)
    embed_name = _module_key(model, model.get_input_embeddings()).removesuffix(".weight")
    groups: dict[str, dict[str, tuple[nn.Module, str]]] = {"embed": {}}
    groups.update({f"layers.{i}": {} for i in range(n_layers)})
    groups["head"] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for pname, _p in mod.named_parameters(recurse=False):
            key = f"{mname}.{pname}" if mname else pname
            if key.startswith(embed_name + "."):
                groups["embed"][key] = (mod, pname)
            elif key.startswith(layers_name + "."):
                idx = key[len(layers_name) + 1 :].split(".", 1)[0]
                groups[f"layers.{idx}"][key] = (mod, pname)
            else:
                groups["head"][key] = (mod, pname)
    return groups


def make_units(model: Any, config: Any, refs: dict[str, TensorRef]) -> list[Unit]:
    """Split the model's parameters into embed, one unit per decoder layer, and head.

    A tied lm_head is read with the embed unit only (see :func:`tied_keys`); a
    parameter stored under another name, or as several tensors (an MoE layer's
    experts), is read as the model's conversion mapping says (:mod:`.fused`)."""
    tied = tied_keys(model, config, refs)
    groups = _param_groups(model, config.num_hidden_layers)
    absent = {k for params in groups.values() for k in params if k not in refs and k not in tied}
    mapped = key_map(model, refs, absent) if absent else KeyMap({}, {})
    units = []
    for name, params in groups.items():
        missing = [k for k in params if k in absent and k not in mapped.renamed]
        missing = [k for k in missing if k not in mapped.fused]
        if missing:
            raise ShardError(
                f"checkpoint has no tensor {missing[0]!r} that {type(model).__name__} needs"
            )
        shared = {k: v for k, v in tied.items() if k in params}
        fused = {k: f for k, f in mapped.fused.items() if k in params}
        own = [k for k in params if k not in shared]
        unit_refs = [
            refs[k] if k in refs else refs[mapped.renamed[k]].renamed(k)
            for k in own
            if k not in fused
        ]
        unit_refs += [refs[s] for f in fused.values() for s in f.sources]
        units.append(Unit(name, params, unit_refs, shared, fused))
    return units


def _bind(unit: Unit, tensors: dict[str, torch.Tensor], shared: bool = False) -> None:
    """Point the unit's parameters at ``tensors`` (its own; ``shared``: unit 0's, for the
    params it shares with it)."""
    for key, (mod, pname) in unit.params.items():
        if (key in unit.shared) == shared:
            # a plain tensor: no copy, no autograd
            mod._parameters[pname] = tensors[unit.shared.get(key, key)]  # type: ignore[assignment]


class StreamingCausalLM:
    """Runs passes of a causal LM over micro-batches, streaming units from disk."""

    def __init__(
        self,
        model_dir: Path,
        *,
        device: torch.device,
        refs: dict[str, TensorRef] | None = None,
        kv_bits: int = 16,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.device = device
        self.kv_bits = kv_bits  # 8: caches from new_cache() hold int8 K/V (infer.kvcache)
        self.refs = refs if refs is not None else index_model(self.model_dir)
        # Compute dtype (weights, activations, KV cache). When it differs from the
        # checkpoint's, each unit's float tensors are cast into slot scratch after
        # ``prepare``, in the reader thread (see :meth:`cast_bytes`).
        self.dtype = dtype or stored_dtype(self.refs)
        self.config, self.model = build_skeleton(self.model_dir, self.dtype)
        # a vision-language checkpoint: its decoder's tensors, named as the text model's
        self.view = text_view(self.model_dir, self.model)
        if self.view is not None:
            self.refs = self.view.refs(self.refs)
        self.units = make_units(self.model, self.config, self.refs)
        base = self.model.base_model
        self.norm = getattr(base, "norm", None)
        self.lm_head = self.model.get_output_embeddings()
        self.embed = self.model.get_input_embeddings()
        _, self.layers = _decoder_layers(self.model, self.config.num_hidden_layers)
        rotary = getattr(base, "rotary_emb", None)
        self.rotary = type(rotary)(config=self.config).to(device) if rotary is not None else None
        # Gemma 3's rotary module takes the layer type: a table per kind of layer
        self.rotary_by_kind = self.rotary is not None and (
            "layer_type" in inspect.signature(self.rotary.forward).parameters
        )
        materialize_buffers(self.model, device)
        self.streamer: LayerStreamer | None = None
        # Keys whose tensors keep their dtype (see add_param); every other float is cast.
        self.own_dtype: set[str] = set()
        # Unit 0's tensors, acquired by the last pass's head (a tied lm_head) for the
        # next pass's embedding lookup; None: the embed unit acquires them itself.
        self._kept: dict[str, torch.Tensor] | None = None
        self.passes = 0

    def start(
        self,
        resident: int | set[int] = 0,
        depth: int = 2,
        prepare: Prepare | None = None,
        direct_io: bool = True,
        prepare_at: PrepareAt = "ahead",
    ) -> StreamingCausalLM:
        """Read the resident units and start the read-ahead thread; ``prepare`` (and the
        casts to the compute dtype) run where ``prepare_at`` says (:mod:`.stream`)."""
        chosen = resident if isinstance(resident, set) else self.pick_resident(resident)
        user = prepare or (lambda i, t, s: t)
        self._kept = None
        self.streamer = LayerStreamer(
            [u.plan for u in self.units],
            chosen,
            depth=depth,
            device=self.device,
            prepare=lambda i, t, s: self.prepared(i, t, s, user),
            direct_io=direct_io,
            drop_raw={i for i in chosen if not self.raw_kept(i)},
            prepare_at=prepare_at,
        )
        return self

    def prepared(
        self, i: int, tensors: dict[str, torch.Tensor], slot: Slot, user: Prepare
    ) -> dict[str, torch.Tensor]:
        """Unit ``i``'s tensors as read made what its modules compute with: ``user``'s
        hook (dequantizing, merging an adapter), then the casts to the compute dtype,
        then the fused parameters, all into ``slot``'s scratch."""
        return self._fuse(i, self._cast(user(i, tensors, slot), slot), slot)

    def raw_kept(self, i: int) -> bool:
        """Whether unit ``i``'s tensors, once prepared, still point into its raw bytes.

        Not when every tensor is rebuilt in scratch (compressed parts dequantized,
        other floats cast to the compute dtype): a resident unit then frees its raw
        buffer and costs only its prepared tensors. On CUDA the raw copy is kept."""
        fused = {s for f in self.units[i].fused.values() for s in f.sources}
        return self.device.type == "cuda" or any(
            "::" not in r.key
            and r.key not in fused
            and not (
                r.dtype.is_floating_point and r.dtype != self.dtype and r.key not in self.own_dtype
            )
            for r in self.units[i].refs
        )

    def _cast(self, tensors: dict[str, torch.Tensor], slot: Slot) -> dict[str, torch.Tensor]:
        """Float tensors not in the compute dtype, cast into the slot's scratch buffers."""
        out = tensors
        for key, t in tensors.items():
            if not t.is_floating_point() or t.dtype == self.dtype or key in self.own_dtype:
                continue
            if out is tensors:
                out = dict(tensors)
            buf = slot.buffer("cast:" + generic_key(key), tuple(t.shape), self.dtype, t.device)
            out[key] = buf.copy_(t)
        return out

    def _fuse(
        self, i: int, tensors: dict[str, torch.Tensor], slot: Slot
    ) -> dict[str, torch.Tensor]:
        """Unit ``i``'s fused parameters built from its prepared tensors (:mod:`.fused`),
        into the slot's scratch buffers: the model's modules keep pointing at a unit's
        tensors after it ran, so a fresh tensor per pass would stay alive per layer."""
        fused = self.units[i].fused
        if not fused:
            return tensors
        out = dict(tensors)
        for key, f in fused.items():
            out[key] = self._fused_tensor(key, f, out, slot)
            for source in f.sources:
                del out[source]
        return out

    def _fused_tensor(
        self, key: str, f: Fused, tensors: dict[str, torch.Tensor], slot: Slot
    ) -> torch.Tensor:
        """``f`` in the slot's scratch buffer for it: written there expert by expert, or
        built by transformers' converter and copied."""
        built = None if f.in_place else f.build(tensors, self.model, self.config)
        shape = f.shape(self.refs) if built is None else tuple(built.shape)
        device = tensors[f.sources[0]].device
        buf = slot.buffer("fuse:" + generic_key(key), shape, self.dtype, device)
        return f.build_into(tensors, buf) if built is None else buf.copy_(built)

    def fuse_bytes(self, i: int) -> tuple[int, int]:
        """(held, transient) bytes of unit ``i``'s fused parameters in the compute dtype:
        all of them in scratch, and the most that building one of them takes beside
        (:meth:`Fused.temps`)."""
        fused = self.units[i].fused.values()
        held = sum(f.nbytes(self.refs, self.dtype) for f in fused)
        return held, max((f.temps(self.refs, self.dtype) for f in fused), default=0)

    def cast_bytes(self, i: int) -> int:
        """Scratch bytes unit ``i`` needs for casts to the compute dtype (plain float
        tensors only: compressed parts are dequantized straight into it)."""
        return sum(
            self.dtype.itemsize * (r.nbytes // r.dtype.itemsize)
            for r in self.units[i].refs
            if r.dtype.is_floating_point
            and r.dtype != self.dtype
            and "::" not in r.key
            and r.key not in self.own_dtype
        )

    def untie(self, keys: set[str]) -> None:
        """Give the tied params among ``keys`` their own bytes in their unit again (an
        adapter merged into a tied lm_head must not change the embedding)."""
        for unit in self.units:
            for key in [k for k in unit.shared if k in keys]:
                embed_key = unit.shared.pop(key)
                source = self.refs.get(key) or self.refs[embed_key]
                unit.refs.append(source.renamed(key))
                unit.plan = plan_reads(unit.refs)

    def replace_refs(self, i: int, refs: list[TensorRef]) -> None:
        """Stream unit ``i`` from other tensors (a compressed copy); ``prepare`` maps them back."""
        self.units[i].refs = refs
        self.units[i].plan = plan_reads(refs)

    def add_param(
        self, i: int, key: str, module: nn.Module, name: str, own_dtype: bool = False
    ) -> None:
        """Give unit ``i`` parameter ``key``, which ``module`` does not declare (a static
        input scale a checkpoint stores beside a weight); the unit's ``prepare`` makes it.
        ``own_dtype``: it computes in its own dtype, not cast to the compute dtype."""
        module.register_parameter(name, None)
        self.units[i].params[key] = (module, name)
        if own_dtype:
            self.own_dtype.add(key)

    @property
    def unit_bytes(self) -> list[int]:
        return [u.plan.nbytes for u in self.units]

    def pick_resident(self, n: int) -> set[int]:
        """The ``n`` largest units (ties: later first): most bytes saved per resident slot."""
        order = sorted(range(len(self.units)), key=lambda i: (-self.units[i].plan.nbytes, -i))
        return set(order[: max(n, 0)])

    # ------------------------------------------------------------------ masks and positions

    def _mask_kind(self, i: int) -> str:
        types = getattr(self.config, "layer_types", None)
        if types:
            return str(types[i])
        return (
            "sliding_attention"
            if getattr(self.config, "sliding_window", None)
            else "full_attention"
        )

    def _prepare(self, mb: MicroBatch) -> None:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        t = mb.input_ids.shape[1]
        # The micro-batch's mask is host bookkeeping (decode appends to it); the
        # positions, masks and rotary tables are built from a copy on the compute device.
        mask = mb.attention_mask.to(self.device, non_blocking=True)
        pos = (mask.long().cumsum(-1) - 1).clamp_(min=0)[:, -t:]
        kinds = {self._mask_kind(i) for i in range(len(self.layers))}
        kw = dict(
            config=self.config,
            inputs_embeds=mb.hidden,
            attention_mask=mask,
            cache=mb.cache,
            position_ids=pos,
        )
        masks = {}
        if "full_attention" in kinds:
            masks["full_attention"] = create_causal_mask(**kw)
        if "sliding_attention" in kinds:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kw)
        assert mb.hidden is not None  # embedded before its masks
        mb.extras = {"pos": pos, "masks": masks, "rot": self._rotary(mb.hidden, pos, kinds)}

    def _rotary(self, hidden: torch.Tensor, pos: torch.Tensor, kinds: set[str]) -> dict[str, Any]:
        """cos/sin by layer kind: one table for all, or (Gemma 3: ``forward(x, pos,
        layer_type)``) one per kind of layer, each with its own base."""
        if self.rotary is None:
            return {}
        if not self.rotary_by_kind:
            table = self.rotary(hidden, pos)
            return dict.fromkeys(kinds, table)
        return {kind: self.rotary(hidden, pos, kind) for kind in kinds}

    # ------------------------------------------------------------------ the pass

    @torch.inference_mode()
    def forward_pass(
        self,
        batches: list[MicroBatch],
        head: Callable[[MicroBatch, torch.Tensor], Any],
        stop: Callable[[], bool] | None = None,
    ) -> list[Any]:
        """One pass of every unit over every micro-batch; ``head(mb, final_hidden)`` is
        called per micro-batch after the final norm, with the lm_head bound (call
        :meth:`logits`). Returns the head results in micro-batch order.

        ``stop`` is asked before each unit after the first: when it says yes the pass
        is abandoned with :class:`PassStopped` (the caches then hold this pass's tokens
        for the layers already run; the engine must be closed, its reader is mid-cycle).

        A micro-batch with a ``prefix`` (a prefill sharing a prompt prefix) gets that
        prefix's keys and values at each layer before it runs the layer on its own
        tokens; the prefix runs every layer first, and is not given to ``head``. The pass
        consumes the prefixes: once it is complete, no micro-batch has one."""
        assert self.streamer is not None, "call start() first"
        results: list[Any] = []
        for i, unit in enumerate(self.units):
            if stop is not None and i > 0 and stop():
                raise PassStopped(i)
            if unit.name == "embed":
                self._run_embed(i, batches)
            elif unit.name == "head":
                results = self._run_head(i, batches, head)
            else:
                self._run_layer(i, batches)
        for mb in batches:
            mb.prefix = None
        self.passes += 1
        trim_heap()
        return results

    def _run_embed(self, i: int, batches: list[MicroBatch]) -> None:
        assert self.streamer is not None
        kept, self._kept = self._kept, None
        _bind(self.units[i], kept if kept is not None else self.streamer.acquire(i))
        try:
            for mb in _with_prefixes(batches):
                mb.hidden = self.embed(mb.input_ids.to(self.device))
                if mb.prefix is None:  # else: once its cache holds the prefix (first layer)
                    self._prepare(mb)
        finally:
            self.streamer.release(i)

    def _run_layer(self, i: int, batches: list[MicroBatch]) -> None:
        assert self.streamer is not None
        _bind(self.units[i], self.streamer.acquire(i))
        try:
            li = i - 1
            layer = self.layers[li]
            order = _with_prefixes(batches)
            for mb in order:
                if mb.prefix is not None:
                    self._continue_prefix(mb, li)
                mb.hidden = layer(
                    mb.hidden,
                    attention_mask=mb.extras["masks"][self._mask_kind(li)],
                    position_ids=mb.extras["pos"],
                    cache=mb.cache,
                    use_cache=mb.cache is not None,
                    position_embeddings=mb.extras["rot"].get(self._mask_kind(li)),
                )
            for mb in order[: len(order) - len(batches)]:  # the prefixes: copied, done
                mb.cache.layers[li].reset()
        finally:
            self.streamer.release(i)

    def _continue_prefix(self, mb: MicroBatch, li: int) -> None:
        """Start layer ``li``'s cache of ``mb`` with its prefix's keys and values; at the
        first layer, build its masks and positions, now that the cache says how many
        tokens come before its own (every layer holds the same: all are full attention)."""
        assert mb.prefix is not None
        fill_from_prefix(mb.prefix.cache.layers[li], mb.cache.layers[li], mb.input_ids.shape[0])
        if li == 0:
            self._prepare(mb)

    def _run_head(
        self, i: int, batches: list[MicroBatch], head: Callable[[MicroBatch, torch.Tensor], Any]
    ) -> list[Any]:
        """Final norm, then ``head`` per micro-batch. A tied lm_head is unit 0's tensor:
        acquired here (once the norm's slot is free: it is the next read in the cyclic
        order) and kept for the next pass's embedding lookup."""
        assert self.streamer is not None
        unit = self.units[i]
        _bind(unit, self.streamer.acquire(i))
        try:
            for mb in batches:
                assert mb.hidden is not None  # the embed unit ran first
                mb.hidden = self.norm(mb.hidden) if self.norm is not None else mb.hidden
            if unit.shared:
                self.streamer.release(i)
                self._kept = self.streamer.acquire(0)
                _bind(unit, self._kept, shared=True)
            results = []
            for mb in batches:
                assert mb.hidden is not None
                results.append(head(mb, mb.hidden))
                mb.hidden = None
            return results
        finally:
            self.streamer.release(i)  # a no-op when released above

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """lm_head on final hidden states, as fp32 (only valid inside a ``head`` callback)."""
        logits: torch.Tensor = self.lm_head(h).float()
        return logits

    def new_cache(self) -> Any:
        """A KV cache for one micro-batch. On CPU it is host RAM already; on CUDA it is
        transformers' offloaded cache: K/V live in host RAM and each layer's are
        prefetched to the GPU just before that layer runs (not yet measured on a GPU)."""
        offloading = self.device.type == "cuda"
        if self.kv_bits == 8:
            return int8_cache(self.config, offloading=offloading)
        return DynamicCache(config=self.config, offloading=offloading)

    def shares_prefix(self) -> bool:
        """Whether a prefill here can compute a shared prompt prefix once: on CPU, with
        caches of full-attention layers only (:func:`~shoestring.infer.kvcache.takes_prefix`;
        not a sliding window, not CUDA's offloaded cache)."""
        return self.device.type == "cpu" and takes_prefix(self.new_cache())

    def close(self) -> None:
        self._kept = None
        if self.streamer is not None:
            self.streamer.close()


def kv_bytes_per_token(config: Any, dtype: torch.dtype, bits: int = 16) -> int:
    """K and V bytes per token over all layers; ``bits`` 8: int8 values plus one fp32
    scale per head (infer.kvcache)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    per_head = head_dim + 4 if bits == 8 else head_dim * dtype.itemsize
    return int(2 * config.num_hidden_layers * kv_heads * per_head)


def kv_scratch_per_token(config: Any, dtype: torch.dtype, bits: int = 16) -> int:
    """Bytes per token (and sequence) of one layer's KV cache handled at once, on top
    of the cache: a 16-bit layer's update concatenates into a new copy (and stacking
    the micro-batches' caches after the prefill pads and concatenates one layer: two
    copies); an 8-bit one concatenates its int8 codes and hands attention a
    dequantized K and V in the compute dtype."""
    layers = int(config.num_hidden_layers)
    stored = kv_bytes_per_token(config, dtype, bits) // layers
    full = kv_bytes_per_token(config, dtype, 16) // layers
    return stored + (full if bits == 8 else stored)


def read_config_json(model_dir: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((Path(model_dir) / "config.json").read_text())
    return doc
