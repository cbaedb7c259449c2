"""The planner's per-rank FSDP2 terms against the shards two gloo ranks really hold.

One 2-rank launch (``torch.multiprocessing``, spawn) shards a tiny random Llama the way
``FSDPStrategy.wrap`` does (LoRA on an fp32 base, on a bf16 base, and on an nf4 base
through ``shard4bit``), runs a forward, a backward and an AdamW step, and records each
rank's bytes: the sharded weights and adapters (the local shards' storages, padding
included), the replicated quant states, the gradients (FSDP2's reduce-scatter outputs),
the optimizer state, and the root group's unsharded weights after the forward. The
shapes are chosen so that sharding pads: an odd vocabulary and an odd LoRA rank, so the
two ranks hold different optimizer bytes.
"""

from __future__ import annotations

import json
import os
import socket
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from shoestring.plan import memory as M
from shoestring.plan import sharding as S
from shoestring.plan.arch import LINEARS, from_hf_config
from shoestring.plan.estimate import breakdown

pytest.importorskip("bitsandbytes")

SHAPE = dict(
    vocab_size=333,  # odd: the embedding and head shard with padding
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    tie_word_embeddings=False,
    max_position_embeddings=128,
)
RANK = 5  # odd: each lora_A (5, d_in) shards as 3 + 2 rows (rank 1 pads one)
CASES = [("none", "float32"), ("none", "bfloat16"), ("nf4", "bfloat16")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _key(t: torch.Tensor) -> tuple[int, int]:
    local = t.to_local() if hasattr(t, "to_local") else t
    st = local.untyped_storage()
    return st.data_ptr(), st.nbytes()


def _distinct(tensors: list[torch.Tensor]) -> int:
    return sum(n for _, n in {_key(t) for t in tensors})


def _quant_states(model: torch.nn.Module) -> list[torch.Tensor]:
    from shoestring.train.shard4bit import linear4bit_modules

    out = []
    for _, m in linear4bit_modules(model):
        qs = m.quant_state
        for s in (qs, getattr(qs, "state2", None)):
            for name in ("absmax", "code", "offset"):
                v = getattr(s, name, None)
                if torch.is_tensor(v):
                    out.append(v)
    return out


def _lora(model_dir: Path, quantize: str, dtype: str) -> Any:
    from shoestring.train.config import LoraSection, ModelConfig
    from shoestring.train.model import apply_lora, load_base_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = load_base_model(model_dir, ModelConfig(path=str(model_dir), dtype=dtype), quantize)
        return apply_lora(
            base, LoraSection(r=RANK, alpha=2 * RANK, dropout=0.0), seed=0,
            gradient_checkpointing=False,
        )  # fmt: skip


def _unsharded_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    """The gradients FSDP2 keeps unsharded between micro-batches (no gradient sync)."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for m in model.modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        for fp in group.fsdp_params if group else []:
            if fp._unsharded_param.grad is not None:
                out.append(fp._unsharded_param.grad)
    return out


def _measure(model_dir: Path, quantize: str, dtype: str, groups: Any) -> dict[str, int]:
    from shoestring.train.model import build_optimizer
    from shoestring.train.parallel import decoder_layers
    from shoestring.train.strategy import FSDPStrategy

    model = _lora(model_dir, quantize, dtype)
    layer = decoder_layers(model)[0]
    fsdp = FSDPStrategy(torch.device("cpu"), groups, dtype=getattr(torch, dtype), quantize=quantize)
    wrapped = fsdp.wrap(model, None)
    params = list(model.parameters())
    got = {
        "frozen": _distinct([p for p in params if not p.requires_grad] + list(model.buffers())),
        "adapters": _distinct([p for p in params if p.requires_grad]),
        "quant_state": _distinct(_quant_states(model)),
    }
    opt = build_optimizer([p for p in params if p.requires_grad], "adamw", 1e-3, 0.0)
    # Inside a layer's forward its parameters are all-gathered (padded, whole).
    layer.self_attn.register_forward_pre_hook(
        lambda *_: got.__setitem__("layer_unsharded", _distinct(list(layer.parameters())))
    )
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    wrapped.set_requires_gradient_sync(False)  # a first micro-batch of two
    out = wrapped(input_ids=ids, labels=ids)
    # After the forward the root (embeddings, final norm, head) stays whole; layers are sharded.
    root = [p for n, p in model.named_parameters() if ".layers." not in n]
    got["root_unsharded"] = _distinct(root)
    got["root_is_whole"] = int(not any(type(p).__name__ == "DTensor" for p in root))
    out.loss.backward()
    got["accumulated"] = _distinct(_unsharded_grads(model))
    wrapped.set_requires_gradient_sync(True)
    wrapped(input_ids=ids, labels=ids).loss.backward()
    got["gradients"] = _distinct([p.grad for p in params if p.grad is not None])
    opt.step()
    got["optimizer"] = _distinct(
        [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    )
    return got


def _ddp_buckets(model_dir: Path, groups: Any) -> int:
    """Bytes of DDP's gradient buckets for the fp32 LoRA model."""
    from shoestring.train.strategy import DDPStrategy

    ddp = DDPStrategy(torch.device("cpu"), groups).wrap(_lora(model_dir, "none", "float32"), None)
    sizes = ddp._get_ddp_logging_data()["bucket_sizes"]  # type: ignore[operator]
    return sum(int(n) for n in str(sizes).split(", "))


def _worker(rank: int, port: int, out: str, model_dir: str) -> None:
    from shoestring.distributed import DistEnv, ProcessGroups

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    env = DistEnv(rank=rank, world_size=2, source="torchrun")
    with ProcessGroups(env, "gloo", 120) as groups:
        results: dict[str, Any] = {
            f"{q}/{d}": _measure(Path(model_dir), q, d, groups) for q, d in CASES
        }
        results["ddp_buckets"] = _ddp_buckets(Path(model_dir), groups)
    torch.save(results, Path(out) / f"rank{rank}.pt")


def _workload(quantize: str, dtype: str) -> M.Workload:
    from transformers import LlamaConfig

    return M.Workload(
        arch=from_hf_config(LlamaConfig(**SHAPE).to_dict()),
        method="qlora" if quantize != "none" else "lora",
        quantize=quantize,  # type: ignore[arg-type]
        dtype=dtype,  # type: ignore[arg-type]
        lora_r=RANK,
        lora_targets=LINEARS,
        lora_dropout=0.0,
        device="cpu",
        parallelism="fsdp",
        world_size=2,
        grad_accum=2,
    )


@pytest.mark.e2e
def test_fsdp_per_rank_terms_equal_the_shards_bytes(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model_dir = tmp_path / "model"
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(model_dir)
    mp.start_processes(
        _worker,
        args=(_free_port(), str(tmp_path), str(model_dir)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for quantize, dtype in CASES:
        w = _workload(quantize, dtype)
        for rank, results in enumerate(ranks):
            got = results[f"{quantize}/{dtype}"]
            want = S.fsdp_static(w, world_size=2, rank=rank)
            case = (quantize, dtype, rank)
            assert got["frozen"] == want["weights"], case
            assert got["adapters"] == want["adapters"], case
            assert got["quant_state"] == want["quant_state"], case
            assert got["gradients"] == want["gradients"], case
            assert got["optimizer"] == want["optimizer"], case
            assert got["root_is_whole"] == 1, case
            root = sum(S.padded_full_bytes(p, 2) for p in S.root_params(w))
            assert got["root_unsharded"] == root, case
            layer = sum(S.padded_full_bytes(p, 2) for p in S.layer_params(w))
            assert got["layer_unsharded"] == layer, case
            assert got["accumulated"] == S.fsdp_accumulated_grads(w), case
        if quantize == "nf4":
            assert ranks[0][f"{quantize}/{dtype}"]["quant_state"] > 0
    # DDP: the reducer's buckets are a second copy of every trainable gradient.
    ddp = replace(_workload("none", "float32"), parallelism="ddp")
    parts, _ = breakdown(ddp)
    assert ranks[0]["ddp_buckets"] == parts["gradient_buckets"] == M.grad_bytes(ddp)
    # The odd rank and vocabulary make the ranks differ: rank 1's chunks are partly padding.
    fp32 = "none/float32"
    assert ranks[0][fp32]["optimizer"] > ranks[1][fp32]["optimizer"]
    assert ranks[0][fp32]["gradients"] == ranks[1][fp32]["gradients"]


def _resolve(*flags: str) -> Any:
    from shoestring.config import load
    from shoestring.plan.cli import PlanConfig
    from shoestring.plan.workload import resolve_request

    return resolve_request(load(PlanConfig, None, list(flags)).request())


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--world-size", "2", "--strategy", "single"], "--strategy"),
        (["--world-size", "4", "--gpus-per-host", "3", "--strategy", "fsdp"], "--gpus-per-host"),
        (["--world-size", "2", "--strategy", "fsdp", "--quantize", "int8"], "--quantize"),
        (["--world-size", "2", "--strategy", "fsdp", "--optimizer", "adamw8bit"], "--optimizer"),
        (["--world-size", "2", "--strategy", "ddp", "--cpu-offload"], "--cpu-offload"),
        (["--world-size", "2", "--device", "cpu"], "--world-size"),
    ],
)
def test_impossible_layouts_are_refused_naming_the_flag(flags: list[str], needle: str) -> None:
    from shoestring.config import ConfigError

    with pytest.raises(ConfigError, match=needle):
        _resolve("--model", "llama-3-8b", *flags)


def test_a_70b_qlora_plan_per_rank_and_per_host() -> None:
    from shoestring.gpus import CATALOG, find_gpu
    from shoestring.plan.estimate import CPU_RUNTIME_BYTES, make_plan
    from shoestring.plan.report import to_json, to_text

    def plan(n: int, *extra: str, per_host: int | None = None) -> Any:
        flags = ["--model", "llama-3-70b", "--method", "qlora", "--strategy", "fsdp"]
        r = _resolve(*flags, "--world-size", str(n), *extra)
        return make_plan(r.workload, find_gpu("L4"), gpus_per_host=per_host)

    two, eight = plan(2), plan(8)
    # Shards shrink with the world size; the replicated quant states and the gathered
    # (whole) root and layers do not.
    w2, w8 = two.breakdown, eight.breakdown
    assert 3.9 < w2["weights"] / w8["weights"] < 4.1
    assert w2["quant_state"] == w8["quant_state"] > 0
    assert w2["gathered_weights"] == w8["gathered_weights"] > 0
    assert not two.fits and eight.fits and eight.catalog_fits.keys() == CATALOG.keys()
    # Rank 0 alone reads the base (train/onereader.py); the other ranks hold a runtime.
    h = eight.host_ram
    reader = sum(h.load_per_rank.values())
    assert h.loader == "rank0_broadcast" and h.load_total == reader + 7 * CPU_RUNTIME_BYTES
    assert plan(8, per_host=4).host_ram.load_total == reader + 3 * CPU_RUNTIME_BYTES
    text, doc = to_text(eight), json.loads(to_json(eight))
    assert "rank 0 of 8" in text and "all-gathered weights" in text and "8 ranks" in text
    assert all(f"\n  {name} " in text for name in CATALOG)
    assert doc["host_ram"]["peak"] == h.peak and doc["catalog_fits"]["T4"] is False
    assert sum(doc["breakdown"].values()) == doc["peak_bytes"]
    # Offload moves the shards, gradients and optimizer state to host RAM.
    off = plan(2, "--cpu-offload")
    assert off.peak_bytes < two.peak_bytes and off.fits
    assert off.host_bytes["sharded_optimizer"] == w2["optimizer"]
    # ... and every rank reads the base again (one reader is not built for offload).
    assert off.host_ram.loader == "every_rank"


def test_one_reader_per_host_counts_the_base_once() -> None:
    from shoestring.plan.arch import PRESETS
    from shoestring.plan.estimate import CPU_RUNTIME_BYTES
    from shoestring.plan.memory import Workload

    w = Workload(arch=PRESETS["llama-3-8b"], method="qlora", parallelism="fsdp", world_size=4)
    every = S.host_ram(w, 4, "every_rank", True, CPU_RUNTIME_BYTES, 0, {})
    one = S.host_ram(w, 4, "rank0_broadcast", True, CPU_RUNTIME_BYTES, 0, {})
    base = sum(every.load_per_rank.values())
    assert every.load_total == 4 * base
    assert one.load_total == base + 3 * CPU_RUNTIME_BYTES
