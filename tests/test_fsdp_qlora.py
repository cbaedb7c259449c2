"""FSDP2 over a 4-bit (bitsandbytes nf4) base on CPU: the packed bytes survive sharding
and all-gather bit for bit, the sharded model computes what the unsharded one does, and
under ``shoestring run`` (2 gloo ranks) it trains like single-process QLoRA, resumes
byte-identically after a SIGKILL, and across world sizes (2 -> 1, 1 -> 2)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import CLI, FAST, read_events, run_job, sha256

pytest.importorskip("bitsandbytes")

#: Global batch 8 in micro-batches of 2 (as the DDP/FSDP tests), 8 steps, a checkpoint
#: at 4 and 8, an nf4 base. The only difference between runs is the world size.
QLORA = [
    *FAST,
    "--train.max_steps",
    "8",
    "--train.batch_size",
    "8",
    "--train.micro_batch_size",
    "2",
    "--lora.quantize",
    "nf4",
]
FSDP = [*QLORA, "--distributed.strategy", "fsdp"]


def _tiny_nf4(cache_dir: Path, dtype: str) -> Any:
    from shoestring.train.builtin import materialize_tiny_model
    from shoestring.train.config import LoraSection, ModelConfig
    from shoestring.train.model import apply_lora, load_base_model

    d = materialize_tiny_model(cache_dir)
    base = load_base_model(d, ModelConfig(path=str(d), dtype=dtype), "nf4")
    return apply_lora(base, LoraSection(dropout=0.0), seed=0, gradient_checkpointing=False)


def _packed(model: Any) -> dict[str, torch.Tensor]:
    from shoestring.train.shard4bit import linear4bit_modules, packed_bytes

    return {n: packed_bytes(m).clone() for n, m in linear4bit_modules(model)}


@pytest.fixture
def one_rank_fsdp(tmp_path: Path) -> Any:
    from shoestring.distributed import DistEnv, ProcessGroups
    from shoestring.train.strategy import FSDPStrategy

    env = DistEnv(init_method=f"file://{tmp_path / 'pg'}", source="torchrun")
    with ProcessGroups(env, "gloo", 60) as groups:

        def make(dtype: torch.dtype) -> FSDPStrategy:
            return FSDPStrategy(torch.device("cpu"), groups, dtype=dtype, quantize="nf4")

        yield make


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_nf4_bytes_survive_fully_shard_and_forward_matches(
    cache_dir: Path, one_rank_fsdp: Any, dtype: str
) -> None:
    from shoestring.train.parallel import decoder_layers
    from shoestring.train.shard4bit import linear4bit_modules

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 24))
    model = _tiny_nf4(cache_dir, dtype)
    ref = copy.deepcopy(model)  # the unsharded reference (quant states copied too)
    original, layers = _packed(model), decoder_layers(model)
    assert len(original) == 28  # 4 layers x 7 projections, all 4-bit
    wrapped = one_rank_fsdp(getattr(torch, dtype)).wrap(model, None)
    sharded = dict(linear4bit_modules(model))
    assert all(type(m.weight).__name__ == "DTensor" for m in sharded.values())
    if dtype == "bfloat16":  # some packed byte pairs read as NaN: a cast would rewrite them
        assert any(torch.isnan(m.weight.to_local()).any() for m in sharded.values())

    for layer in layers:
        layer.unshard()  # FSDP2's all-gather into the unsharded parameters
    gathered = _packed(model)
    assert gathered.keys() == original.keys()
    for name, packed in original.items():
        assert torch.equal(gathered[name], packed), name  # bit for bit
    for layer in layers:
        layer.reshard()  # type: ignore[operator]

    out, expect = wrapped(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    assert torch.equal(out.logits, expect.logits)
    out.loss.backward()
    expect.loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert grads.keys() == want.keys() and len(want) == 56  # every LoRA A and B
    for name, g in want.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=name)
    assert any(bool(g.ne(0).any()) for n, g in want.items() if "lora_B" in n)


def steps(out: Path) -> dict[int, float]:
    """Rank 0's loss per step (the last record of a step that was redone)."""
    return {e["step"]: e["loss"] for e in read_events(out) if e["event"] == "step"}


#: Sharding changes the reduction order (reduce-scatter of the gradients instead of one
#: process's accumulation), not the math: the measured gap is ~1e-6 relative on CPU.
LOSS_RTOL = 1e-4


def assert_losses_close(a: Path, b: Path, which: range) -> None:
    la, lb = steps(a), steps(b)
    for s in which:
        assert abs(la[s] - lb[s]) <= LOSS_RTOL * abs(lb[s]) + 1e-6, (s, la[s], lb[s])


#: The collectives FSDP2 issues (as the flight recorder names them).
FSDP2_COLLECTIVES = (
    "all_gather_single",
    "reduce_scatter_single",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
)


def resumes(out: Path) -> list[dict[str, Any]]:
    return [e for e in read_events(out) if e["event"] == "resume"]


@pytest.fixture(scope="module")
def single_qlora(cli: CLI, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Single-process QLoRA on the same global batch: the reference curve."""
    out = tmp_path_factory.mktemp("qlora") / "single"
    r = cli.run(out, *QLORA)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def fsdp_qlora(cli: CLI, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 2-rank FSDP2 + nf4 run (also evaluating through the sharded
    4-bit model: loss and greedy exact match)."""
    out = tmp_path_factory.mktemp("fsdp-qlora") / "ref"
    evals = ["--data.eval", "builtin:reverse", "--eval.max_samples", "8"]
    r = run_job(cli, out, 2, *FSDP, *evals, "--export.merged", "true")
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.e2e
def test_fsdp_qlora_trains_like_single_process_and_resumes_byte_identically(
    cli: CLI, tmp_path: Path, single_qlora: Path, fsdp_qlora: Path
) -> None:
    ev = read_events(fsdp_qlora)
    assert [e["strategy"] for e in ev if e["event"] == "run_start"] == ["fsdp"]
    assert {e["tag"] for e in ev if e["event"] == "eval"} == {"before", "after"}
    assert steps(fsdp_qlora)[8] < steps(fsdp_qlora)[1]
    assert_losses_close(fsdp_qlora, single_qlora, range(1, 9))
    # One reader: rank 0 read (and quantized) the base; rank 1 built it on the meta
    # device and received its quant states and shards (tests/test_one_reader.py measures
    # the memory and compares the bytes).
    rank1 = read_events(fsdp_qlora / "ranks" / "rank1")
    (load1,) = [e for e in rank1 if e["event"] == "load" and e["phase"] == "model"]
    assert (load1["source"], load1["base_readers"]) == ("broadcast", [0])
    assert load1["received_bytes"] > load1["kept_bytes"] > load1["quant_state_bytes"] > 0
    # The checkpoint is DCP shards of the adapter and its optimizer state: no base weight
    # and no quant-state tensor of the frozen nf4 layers.
    from torch.distributed.checkpoint import FileSystemReader

    ck = fsdp_qlora / "checkpoints" / "step-00000008"
    keys = FileSystemReader(str(ck)).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert len(model_keys) == 56 and all(".lora_" in k for k in model_keys)
    # The merged export folds the gathered adapter into the nf4 base it trained on
    # (dequantized), as single-process QLoRA does; fp32 compute: drift is rounding only.
    report = json.loads((fsdp_qlora / "merged" / "merge_report.json").read_text())
    assert report["base"] == "dequantized 4/8-bit"
    assert report["max_abs"] < 1e-3 * max(report["ref_std"], 1.0)
    assert report["top1_agreement"] == 1.0

    # Rank 1 hangs after step 6 (step 4 committed): the watchdog names it and the FSDP2
    # collective rank 0 waits in (FSDP2's own all-gathers/reduce-scatters are traced),
    # kills the job, and the restarted ranks reshard the step-4 checkpoint and finish
    # byte-identically.
    out = tmp_path / "run"
    r = run_job(
        cli, out, 2, *FSDP, restarts=1, env={"SHOESTRING_FAULTS": "step.end@6:hang:rank1:once"}
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (hang,) = [e for e in read_events(out) if e["event"] == "hang"]
    assert hang["kind"] == "stuck_rank" and hang["culprits"] == [1], hang["summary"]
    waiting = hang["ranks"]["0"]["waiting_in"]
    assert waiting is not None and waiting.split(" #")[0] in FSDP2_COLLECTIVES, hang["summary"]
    (res,) = resumes(out)
    assert (res["from_step"], res["world_size"], res["format"]) == (4, 2, "dcp")
    assert sha256(out / "final" / "adapter_model.safetensors") == sha256(
        fsdp_qlora / "final" / "adapter_model.safetensors"
    )
    # Every later start read the quantized base the first one cached (the uint8 format
    # single-process QLoRA caches too: one cache for every strategy).
    loads = [e for e in read_events(out) if e["event"] == "load" and e.get("phase") == "model"]
    assert loads and all(e["source"] == "qbase-local" for e in loads)


@pytest.mark.e2e
def test_fsdp_qlora_checkpoint_resumes_in_one_process(
    cli: CLI, tmp_path: Path, single_qlora: Path, fsdp_qlora: Path
) -> None:
    """2 -> 1: one process loads the 2-rank DCP checkpoint of step 4 and continues."""
    out = tmp_path / "run"
    ck = fsdp_qlora / "checkpoints" / "step-00000004"
    r = cli.run(out, *QLORA, "--resume", str(ck))
    assert r.returncode == 0, r.stderr[-3000:]
    (res,) = resumes(out)
    assert (res["from_step"], res["from_world_size"], res["world_size"]) == (4, 2, 1)
    assert_losses_close(out, single_qlora, range(5, 9))
    assert_losses_close(out, fsdp_qlora, range(5, 9))


@pytest.mark.e2e
@pytest.mark.slow  # the 2-rank test shards the same way; one process resumes its checkpoint
def test_one_process_shards_over_a_mesh_of_one(
    cli: CLI, tmp_path: Path, single_qlora: Path, fsdp_qlora: Path
) -> None:
    """``distributed.strategy fsdp`` in a plain process (no launcher): FSDP2 over a mesh
    of one (what one GPU with ``distributed.cpu_offload`` needs), here resuming the
    2-rank checkpoint of step 4: the same losses, a DCP checkpoint of its own."""
    out = tmp_path / "run"
    ck = fsdp_qlora / "checkpoints" / "step-00000004"
    r = cli.run(out, *FSDP, "--resume", str(ck))
    assert r.returncode == 0, r.stderr[-3000:]
    ev = read_events(out)
    assert [e["strategy"] for e in ev if e["event"] == "run_start"] == ["fsdp"]
    (res,) = resumes(out)
    assert (res["from_step"], res["from_world_size"], res["world_size"]) == (4, 2, 1)
    assert_losses_close(out, single_qlora, range(5, 9))
    assert (out / "checkpoints" / "step-00000008" / "__0_0.distcp").is_file()


@pytest.mark.e2e
@pytest.mark.slow  # 2 -> 1 runs in CI
def test_single_process_qlora_checkpoint_resumes_under_fsdp(
    cli: CLI, tmp_path: Path, single_qlora: Path, fsdp_qlora: Path
) -> None:
    """1 -> 2: two FSDP2 ranks load a single-process QLoRA checkpoint, each its shard."""
    out = tmp_path / "run"
    ck = single_qlora / "checkpoints" / "step-00000004"
    r = run_job(cli, out, 2, *FSDP, "--resume", str(ck))
    assert r.returncode == 0, r.stderr[-3000:]
    recs = resumes(out) + [e for p in (out / "ranks").glob("rank*") for e in resumes(p)]
    assert sorted(e["rank"] for e in recs) == [0, 1]
    for res in recs:
        assert (res["from_step"], res["from_world_size"], res["world_size"]) == (4, 1, 2)
    assert_losses_close(out, single_qlora, range(5, 9))
    assert_losses_close(out, fsdp_qlora, range(5, 9))


@pytest.mark.parametrize(
    ("flags", "key"),
    [
        (["--lora.quantize", "int8", "--distributed.strategy", "fsdp"], "lora.quantize"),
        (["--train.optimizer", "paged_adamw8bit", *FSDP[len(QLORA) :]], "train.optimizer"),
        (["--distributed.cpu_offload", "true"], "distributed.cpu_offload"),
        (
            ["--distributed.strategy", "fsdp", "--distributed.cpu_offload"],
            "distributed.cpu_offload",
        ),
    ],
)
def test_what_fsdp_cannot_do_is_refused_naming_the_key(flags: list[str], key: str) -> None:
    from shoestring.config import ConfigError, load
    from shoestring.train.config import FinetuneConfig
    from shoestring.train.strategy import check_fsdp_options

    cfg = load(FinetuneConfig, None, flags)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_fsdp_options(cfg, torch.device("cpu"))
    check_fsdp_options(
        load(FinetuneConfig, None, [*QLORA, *FSDP[len(QLORA) :]]), torch.device("cpu")
    )
