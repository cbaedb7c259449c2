"""One reader of the base under FSDP2 (issue 27 item 2), 2 gloo ranks on a random Llama
written as safetensors: rank 0 reads the base, rank 1 builds it on the meta device and
receives its shards. Rank 1's peak RSS grows by about its shard, not by a model; the
reader's by about one model; and every rank ends with exactly the model it gets when it
reads the base itself (parameters, packed nf4 bytes, quant states, buffers, bit for bit)."""

from __future__ import annotations

import gc
import importlib
import os
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.e2e

#: A Llama of 52 M parameters, 200 MiB of fp32 on disk: big enough that one model stands
#: far above the noise of a process's RSS, small enough to quantize in seconds. Widths are
#: multiples of 64 (bitsandbytes' CPU kernels); the vocabulary is small, so the largest
#: single tensor (the one full tensor a non-reader holds in flight) is a 16 MiB projection.
LLAMA = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 3,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
MIB = 1 << 20
LARGEST = 4096 * 1024 * 4
QUANTIZE = ("nf4", "none")
WARM_IMPORTS = (
    "bitsandbytes",
    "peft",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "transformers.models.llama.modeling_llama",
)
#: What a rank's RSS may grow by beyond the bytes it keeps and the one tensor in flight:
#: the LoRA init on the CPU, peft's and FSDP2's bookkeeping. Measured 2026-12-07 on rank 1,
#: after the warm-up and with a fixed mmap threshold: within the tensor in flight (plain
#: 123.1 MB for 107.1 kept + 16.8 in flight; nf4 25.6 MB for 19.9 + 16.8).
MARGIN = 16 * MIB


def write_random_llama(path: Path, **shape: int) -> int:
    """A random-weight Llama as ``from_pretrained`` reads it (``LLAMA``, with ``shape``'s
    changes); returns its weight bytes."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**(LLAMA | shape))
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(s, generator=gen).mul_(0.05) for k, s in shapes.items()}
    for k in tensors:
        if k.endswith("norm.weight"):
            tensors[k].fill_(1.0)
    path.mkdir(parents=True)
    config.save_pretrained(path)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss() -> tuple[int, int]:
    """(current, peak) resident set of this process, from /proc (bytes)."""
    got = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            got[key] = int(value.split()[0]) * 1024
    return got["VmRSS"], got["VmHWM"]


def _reset_peak() -> None:
    """Start the peak (VmHWM, ru_maxrss) again from the current RSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def _snapshot(model: torch.nn.Module) -> dict[str, Any]:
    """This rank's model, every byte: local shards, buffers, quant states, 4-bit attributes."""
    from shoestring.train.shard4bit import linear4bit_modules

    out: dict[str, Any] = {}
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        out[name] = local.detach().clone()
        out[f"{name}.requires_grad"] = p.requires_grad
    out |= {name: b.clone() for name, b in model.named_buffers()}
    for name, m in linear4bit_modules(model):
        for k, v in m.quant_state.as_dict(packed=True).items():
            out[f"{name}.quant_state.{k}"] = v.clone()
        out[f"{name}.attrs"] = (m.compute_dtype, m.quant_storage, m.weight.requires_grad)
    return out


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    if a.keys() != b.keys():
        return sorted(a.keys() ^ b.keys())
    wrong = []
    for k, x in a.items():
        y = b[k]
        if isinstance(x, torch.Tensor):
            same = x.dtype == y.dtype and x.shape == y.shape
            if same and x.numel():  # bitwise: a float view of packed bytes may hold NaNs
                same = torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
            if not same:
                wrong.append(k)
        elif x != y:
            wrong.append(k)
    return wrong


def _built(cfg: Any, strategy: Any, base: Any) -> torch.nn.Module:
    from shoestring.train.model import apply_lora

    model = apply_lora(base, cfg.lora, cfg.train.seed, gradient_checkpointing=False)
    return strategy.wrap(model, None)  # type: ignore[no-any-return]


def _trimmed() -> None:
    """Garbage collected and the allocator's free pages handed back, so that what was
    freed before a measurement is not silently reused by it."""
    import ctypes

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _warm_up(cfg: Any, pg: Any) -> None:
    """A first load of a tiny Llama, unmeasured: what a process imports and allocates
    once, on its first load (modeling code, peft's and FSDP2's lazily imported modules),
    is not what the load holds, and its size depends on what the process ran before
    (rank 1 grew 20-27 MB beyond its shard here without it, 51 MB in one CI run)."""
    from shoestring.train.baseload import load_base
    from shoestring.train.strategy import FSDPStrategy

    strategy = FSDPStrategy(torch.device("cpu"), pg, quantize=cfg.lora.quantize)
    run = SimpleNamespace(strategy=strategy)
    _built(cfg, strategy, load_base(cfg, run, Path(cfg.model.path), "").model)


def _fixed_mmap_threshold() -> None:
    """glibc serves a large block from mmap, and returns it to the system when freed,
    until the first such free: then it raises its mmap threshold to that block's size
    (up to 32 MiB), and later blocks come from the heap and stay there once freed. A rank
    that receives 16 MiB tensors one at a time would then keep up to two of them cached,
    more or less by the order of its frees (rank 1 grew 22-26 MB beyond its shard here,
    51 MB in one CI run). A fixed threshold turns that off (mallopt(3)), so that the RSS
    measures what the load holds."""
    import ctypes

    m_mmap_threshold = -3
    ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, 128 * 1024)


def _load_twice(cfg: Any, pg: Any) -> dict[str, Any]:
    """One rank: the base through one reader (RSS measured around it), then read alone
    (today's way) for the comparison."""
    from shoestring.train.baseload import load_base
    from shoestring.train.model import load_base_model
    from shoestring.train.strategy import FSDPStrategy

    quantize, model_dir = cfg.lora.quantize, Path(cfg.model.path)
    strategy = FSDPStrategy(torch.device("cpu"), pg, quantize=quantize)
    run = SimpleNamespace(strategy=strategy)  # what load_base reads of a Run, uncached
    _trimmed()
    _reset_peak()
    before, _ = _rss()
    loaded = load_base(cfg, run, model_dir, "")  # type: ignore[arg-type]
    model = _built(cfg, strategy, loaded.model)
    after, peak = _rss()
    result = {"growth": peak - before, "kept": after - before}
    result["fields"] = loaded.fields | strategy.load_fields()
    mine = _snapshot(model)
    del loaded, model
    alone = FSDPStrategy(torch.device("cpu"), pg, quantize=quantize, one_reader=False)
    base = load_base_model(model_dir, cfg.model, quantize)
    result["differences"] = _differences(mine, _snapshot(_built(cfg, alone, base)))
    result["compared"] = len(mine)
    return result


def _worker(rank: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    _fixed_mmap_threshold()
    for name in WARM_IMPORTS:  # what the load imports, before measuring it
        importlib.import_module(name)
    from shoestring.config import load
    from shoestring.distributed import DistEnv, ProcessGroups
    from shoestring.train.config import FinetuneConfig

    flags = ["--model.path", model_dir, "--model.dtype", "float32", "--lora.dropout", "0"]
    flags += ["--distributed.strategy", "fsdp", "--lora.cache_quantized", "false"]
    tiny = ["--model.path", str(Path(model_dir).parent / "tiny")]
    results = {}
    with ProcessGroups(DistEnv(rank=rank, world_size=2, source="torchrun"), "gloo", 120) as pg:
        for quantize in QUANTIZE:
            _warm_up(load(FinetuneConfig, None, [*flags, *tiny, "--lora.quantize", quantize]), pg)
            cfg = load(FinetuneConfig, None, [*flags, "--lora.quantize", quantize])
            results[quantize] = _load_twice(cfg, pg)
    torch.save(results, Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    path = tmp_path_factory.mktemp("llama") / "model"
    write_random_llama(
        path.parent / "tiny",
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_hidden_layers=1,
    )
    return path, write_random_llama(path)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_one_reader_holds_the_model_and_the_other_rank_only_its_shard(
    tmp_path: Path, random_llama: tuple[Path, int]
) -> None:
    pytest.importorskip("bitsandbytes")
    model_dir, model_bytes = random_llama
    mp.start_processes(
        _worker, args=(_free_port(), str(model_dir), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for quantize in QUANTIZE:
        reader, other = (r[quantize] for r in ranks)
        print(f"\n{quantize}: model {model_bytes / MIB:.0f} MiB; reader {reader}; other {other}")
        for r in (reader, other):  # the same model as reading the base itself, bit for bit
            assert r["differences"] == [] and r["compared"] > 100
        assert reader["fields"]["source"] == "model_dir"
        assert other["fields"]["source"] == "broadcast"
        assert reader["fields"]["base_readers"] == other["fields"]["base_readers"] == [0]
        assert reader["fields"]["received_bytes"] == 0
        # Rank 1 received the whole base, a tensor at a time, and kept about half of it.
        kept, received = other["fields"]["kept_bytes"], other["fields"]["received_bytes"]
        assert received >= (model_bytes if quantize == "none" else model_bytes // 8)
        assert kept < 0.6 * received
        # Its RSS grew by its shard plus the one tensor in flight, not by a model...
        assert other["growth"] <= kept + LARGEST + MARGIN, (other["growth"], kept)
        assert other["growth"] < 0.75 * model_bytes
        # ...while the reader's grew by at least one model (the measurement can see one),
        # and by no more than two (a read copy beside the mapped file) and its shard.
        assert reader["growth"] >= 0.9 * model_bytes
        assert reader["growth"] <= 2 * model_bytes + kept + MARGIN
