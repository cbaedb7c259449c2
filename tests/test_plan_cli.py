"""``shoestring plan`` and the finetune pre-flight: verdicts, search, advice, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import CLI, REPO
from shoestring.config import ConfigError, load
from shoestring.plan import CATALOG, PRESETS, Workload, find_gpu, make_plan
from shoestring.plan.estimate import peak_bytes
from shoestring.train.config import FinetuneConfig


def plan_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shoestring", "plan", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"},
    )


@pytest.mark.parametrize(
    "name,params",
    [
        ("llama-2-7b", 6_738_415_616),
        ("llama-3-8b", 8_030_261_248),
        ("mistral-7b", 7_248_023_552),
        ("qwen2.5-7b", 7_615_616_512),
        ("llama-3-70b", 70_553_706_496),
    ],
)
def test_presets_have_the_published_parameter_counts(name: str, params: int) -> None:
    assert PRESETS[name].params == params


def test_json_plan_is_consistent_and_exit_code_is_the_verdict() -> None:
    r = plan_cli(
        "--model", "llama-3-8b", "--method", "qlora", "--seq-len", "2048", "--gpu", "T4", "--json"
    )
    doc = json.loads(r.stdout)
    for key in (
        "fits",
        "peak_bytes",
        "breakdown",
        "hours",
        "cost_usd",
        "cost_spot_usd",
        "max_micro_batch",
        "max_seq_len",
    ):
        assert key in doc
    assert sum(doc["breakdown"].values()) == doc["peak_bytes"]
    assert r.returncode == (0 if doc["fits"] else 1)
    # Independent arithmetic from the research notes: 8B NF4 weights ~ 5.7 GB.
    assert 5.4e9 < doc["breakdown"]["weights"] + doc["breakdown"]["quant_state"] < 6.0e9
    assert doc["cost_spot_usd"] < doc["cost_usd"]
    full = plan_cli("--model", "llama-3-8b", "--method", "full", "--gpu", "T4", "--json")
    assert full.returncode == 1 and json.loads(full.stdout)["fits"] is False


def test_largest_micro_batch_and_sequence_are_tight() -> None:
    gpu = find_gpu("L4")
    w = Workload(arch=PRESETS["llama-3-8b"], method="qlora", seq_len=1024, micro_batch=1)
    plan = make_plan(w, gpu)
    mb, seq = plan.max_micro_batch, plan.max_seq_len
    assert mb and seq
    assert peak_bytes(replace(w, micro_batch=mb)) <= gpu.memory_bytes
    assert peak_bytes(replace(w, micro_batch=mb + 1)) > gpu.memory_bytes
    assert peak_bytes(replace(w, seq_len=seq)) <= gpu.memory_bytes
    assert peak_bytes(replace(w, seq_len=seq + 64)) > gpu.memory_bytes


def test_advice_for_a_config_that_does_not_fit_helps() -> None:
    w = Workload(
        arch=PRESETS["llama-2-7b"],
        method="lora",
        seq_len=4096,
        micro_batch=4,
        gradient_checkpointing=False,
    )
    plan = make_plan(w, find_gpu("A10G"))
    assert not plan.fits and plan.advice
    assert all(
        a["peak_bytes"] < plan.peak_bytes
        for a in plan.advice
        if not a["change"].startswith("a larger GPU")
    )
    assert plan.advice[0]["fits"]  # fitting changes come first
    text = plan_cli(
        "--model",
        "llama-2-7b",
        "--seq-len",
        "4096",
        "--micro-batch",
        "4",
        "--no-gradient-checkpointing",
        "--gpu",
        "A10G",
    ).stdout
    assert "DOES NOT FIT" in text and "what to change" in text


def test_the_first_line_says_which_config_was_planned() -> None:
    # plan's defaults (a realistic fine-tune) are not finetune's (a short demo): said.
    first = plan_cli("--model", "llama-2-7b", "--gpu", "L4").stdout.splitlines()[0]
    d = FinetuneConfig()
    assert first.startswith("planned  plan's defaults (micro-batch 1, seq 2048, gradient")
    assert f"data.max_length {d.data.max_length}" in first and "--config FILE.yaml" in first
    spot = REPO / "configs" / "llama-7b-lora-spot.yaml"
    r = plan_cli("--config", str(spot), "--model", "llama-2-7b", "--gpu", "L4")
    assert (
        r.stdout.splitlines()[0]
        == f"planned  {spot} (finetune's config), with the flags given here"
    )


def test_plan_stays_light_and_quiet_in_a_pipe() -> None:
    """A plan loads nothing heavy (torch took 6-8 s of a 0.5 s plan, imported through the
    checkpoint package's names), and a reader that leaves early (`plan | head -1`) ends it
    without a traceback."""
    probe = (
        "import sys; from shoestring.cli import main; "
        "code = main(['plan', '--model', 'llama-2-7b', '--gpu', 'L4']); "
        "print('torch loaded:', 'torch' in sys.modules, file=sys.stderr); sys.exit(code)"
    )
    env = {"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "torch loaded: False" in r.stderr, r.stderr[-2000:]
    plan = f"{sys.executable} -m shoestring plan --model llama-2-7b --gpu L4"
    r = subprocess.run(["bash", "-c", f"{plan} | true"], capture_output=True, text=True, env=env)
    assert r.stderr == "", r.stderr[-2000:]  # `true` left before the plan was written


def test_plan_from_a_finetune_config_and_a_model_dir(tmp_path: Path) -> None:
    r = plan_cli(
        "--config",
        str(REPO / "configs" / "llama-7b-lora-spot.yaml"),
        "--model",
        "llama-2-7b",
        "--gpu",
        "L4",
        "--json",
    )
    doc = json.loads(r.stdout)
    assert doc["workload"]["micro_batch"] == 4 and doc["workload"]["seq_len"] == 1024
    assert doc["workload"]["grad_accum"] == 4 and doc["tokens"] == 2000 * 16 * 1024
    cfg = {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 320,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = plan_cli("--model", str(tmp_path), "--gpu", "T4", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["workload"]["arch"]["hidden"] == 256


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "llama-3-8b", "--gpu", "X100"], "--gpu"),
        (["--model", "llama-3-8b", "--seq-len", "0"], "--seq-len"),
        (["--model", "nope"], "--model"),
        (["--model", "llama-3-8b", "--targets", "q_proj,qkv"], "--targets"),
        (["--model", "llama-3-8b", "--method", "full", "--quantize", "nf4"], "--quantize"),
    ],
)
def test_bad_input_names_the_flag(args: list[str], needle: str) -> None:
    r = plan_cli(*args)
    assert r.returncode == 2 and needle in r.stderr


def test_bad_config_value_names_file_and_line(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  path: builtin:tiny\nlora:\n  quantize: nf5\n")
    r = plan_cli("--config", str(cfg))
    assert r.returncode == 2 and f"{cfg}:4" in r.stderr and "lora.quantize" in r.stderr


def test_catalog_prices_have_source_and_date() -> None:
    for g in CATALOG.values():
        assert g.price_source and len(g.price_date) >= 7 and g.memory_bytes > 10 << 30
        assert 0 < g.spot_usd_h <= g.on_demand_usd_h


@pytest.mark.parametrize(
    "device,name",
    [
        ("Tesla T4", "T4"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", None),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA GeForce RTX 4090", "RTX4090"),
    ],
)
def test_detected_device_names_map_to_the_catalog(device: str, name: str | None) -> None:
    from shoestring.gpus import detect_gpu_name

    assert detect_gpu_name(device) == name


def test_finetune_refuses_a_config_that_will_not_fit(cli: CLI, tmp_path: Path) -> None:
    out = tmp_path / "run"
    big = [
        "--plan.gpu",
        "T4",
        "--data.max_length",
        "65536",
        "--train.batch_size",
        "64",
        "--train.max_steps",
        "2",
        "--data.eval",
        "",
    ]
    r = cli.run(out, *big)
    assert r.returncode == 2, r.stderr
    assert "T4" in r.stderr and "micro-batch" in r.stderr and "plan.enforce" in r.stderr
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())


def test_preflight_warns_instead_when_not_enforced(cache_dir: Path) -> None:
    from shoestring.plan.check import preflight
    from shoestring.train.builtin import materialize_tiny_model

    d = materialize_tiny_model(cache_dir)
    over = ["--plan.gpu", "T4", "--data.max_length", "65536", "--train.batch_size", "64"]
    with pytest.raises(ConfigError, match="per GPU"):
        preflight(load(FinetuneConfig, None, over), d)
    plan = preflight(load(FinetuneConfig, None, over + ["--plan.enforce", "false"]), d)
    assert plan is not None and not plan.fits
    fine = preflight(load(FinetuneConfig, None, ["--plan.gpu", "T4"]), d)
    assert fine is not None and fine.fits
    assert preflight(load(FinetuneConfig, None, ["--plan.gpu", "none"]), d) is None


QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8,
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "vocab_size": 151936, "norm_topk_prob": True,
}  # fmt: skip


def test_a_mixture_of_experts_is_planned_with_its_experts_and_checked_before_training(
    tmp_path: Path,
) -> None:
    """Qwen3-30B-A3B's shape: its 128 experts a layer are 29.0 B of its 30.5 B
    parameters. Counted as the dense model its attention describes, it would have fit
    anywhere (an OLMoE-1B-7B QLoRA once planned at 1.96 GiB was killed at 23.8 GB).
    peft's all-linear puts LoRA on every expert (r·128 per parameter: about 1 B trainable
    parameters at r=16), which an L4 cannot hold; the plan says so and advises LoRA on
    the attention, which fits an L4 with the experts in NF4 (not a T4). Its compute
    counts the 8 experts a token is routed to, not all 128."""
    from shoestring.plan.check import preflight

    d = tmp_path / "qwen3-moe"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    attention = "q_proj,k_proj,v_proj,o_proj"
    plans = {}
    for name, flags in (
        ("all-linear", ["--gpu", "L4"]),
        ("attention", ["--gpu", "L4", "--targets", attention]),
        ("T4", ["--gpu", "T4", "--targets", attention]),
        ("16-bit", ["--gpu", "H100", "--method", "lora", "--targets", attention]),
    ):
        r = plan_cli("--model", str(d), "--method", "qlora", *flags, "--json")
        plans[name] = json.loads(r.stdout)
        assert r.returncode == (0 if plans[name]["fits"] else 1), r.stderr
    expert_params = 48 * 128 * 3 * 2048 * 768
    lora_params = 48 * 128 * (32 * (2048 + 1536) + 16 * (768 + 2048)) + 48 * 16 * (2048 + 128)
    whole = plans["all-linear"]
    assert whole["breakdown"]["weights"] > expert_params // 2  # 4 bits each, at least
    assert whole["breakdown"]["adapters"] > 4 * lora_params  # fp32, beside the attention's
    assert not whole["fits"] and whole["advice"][0]["change"].startswith("LoRA on the attention")
    assert whole["advice"][0]["fits"]
    assert plans["attention"]["fits"] and not plans["T4"]["fits"]
    assert plans["16-bit"]["breakdown"]["weights"] > 2 * expert_params
    active = 2 * 48 * (8 * 3 * 2048 * 768 + 2 * 2048 * 4096 + 2 * 2048 * 512)
    assert plans["attention"]["flops_per_token"] < 4 * active  # not 30 B parameters' worth

    over = ["--plan.gpu", "T4", "--lora.quantize", "nf4", "--lora.dropout", "0",
            "--lora.target_modules", f"[{attention}]", "--model.gradient_checkpointing", "true"]  # fmt: skip
    with pytest.raises(ConfigError, match="per GPU"):
        preflight(load(FinetuneConfig, None, over), d)
    fine = preflight(load(FinetuneConfig, None, ["--plan.gpu", "L4", *over[2:]]), d)
    assert fine is not None and fine.fits


def test_an_moe_the_planner_does_not_model_is_refused_by_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Qwen2-MoE adds a shared expert to every layer; DeepSeek-V3 has dense first layers
    and its own attention: the planner names what it models instead of guessing.
    finetune's pre-flight warns and lets such a run start (the trainer runs them)."""
    from shoestring.plan.check import preflight

    for family, extra in (("qwen2_moe", {"shared_expert_intermediate_size": 5632}),
                          ("deepseek_v3", {"n_routed_experts": 256})):  # fmt: skip
        d = tmp_path / family
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, "model_type": family, **extra}))
        r = plan_cli("--model", str(d), "--method", "qlora")
        assert r.returncode == 2, r.stdout
        assert (
            f"({family}, " in r.stderr
            and "the planner models mixtral, olmoe, qwen3_moe" in r.stderr
        )
    d = tmp_path / "sparse-step"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, "mlp_only_layers": [0, 1]}))
    r = plan_cli("--model", str(d))
    assert r.returncode == 2 and "some layers are dense" in r.stderr
    with caplog.at_level("WARNING", "shoestring.plan"):
        assert preflight(load(FinetuneConfig, None, ["--plan.gpu", "T4"]), d) is None
        assert (
            preflight(load(FinetuneConfig, None, ["--plan.gpu", "T4"]), tmp_path / "qwen2_moe")
            is None
        )
    assert caplog.text.count("no pre-flight memory check") == 2 and "qwen2_moe" in caplog.text
    ok = tmp_path / "qwen3-moe"
    ok.mkdir()
    (ok / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    sharded = ["--plan.gpu", "T4", "--distributed.strategy", "fsdp", "--lora.dropout", "0"]
    with caplog.at_level("WARNING", "shoestring.plan"):
        assert preflight(load(FinetuneConfig, None, sharded), ok, world_size=2) is None
    assert "--strategy fsdp: the planner models a mixture of experts" in caplog.text


def test_memory_levers_from_a_config_and_flags(tmp_path: Path) -> None:
    """train.loss_chunk_tokens and train.offload_activations reach the plan from a finetune
    config (flags override them). On the Llama-3-8B shape at 2048 tokens, chunking takes
    the 128k-vocabulary logits out of the peak; offload moves the saved activations to
    host RAM on a GPU plan, and on a CPU plan only says where they are."""
    from shoestring.plan.memory import activation_bytes
    from shoestring.plan.report import to_dict, to_text
    from shoestring.plan.workload import PlanRequest, resolve_request

    y = tmp_path / "c.yaml"
    y.write_text(
        "lora:\n  quantize: nf4\ndata:\n  max_length: 2048\n"
        "train:\n  batch_size: 1\n  loss_chunk_tokens: 512\n  offload_activations: true\n"
    )
    r = resolve_request(PlanRequest(config=y, model="llama-3-8b", gpu="T4"))
    w = r.workload
    assert (w.loss_chunk_tokens, w.offload_activations, w.device) == (512, True, "cuda")
    plain = replace(w, loss_chunk_tokens=0, offload_activations=False)
    assert peak_bytes(plain) - peak_bytes(replace(w, offload_activations=False)) > 2 << 30
    plan = make_plan(w, find_gpu("T4"))
    act = activation_bytes(w)
    assert plan.host_bytes == {"offloaded_activations": act.saved} and act.host == act.saved
    assert plan.breakdown["activations"] == act.held
    assert "host RAM (pinned" in to_text(plan) and to_dict(plan)["host_bytes"] == plan.host_bytes
    off = PlanRequest(
        config=y, model="llama-3-8b", gpu="T4", loss_chunk_tokens=0, offload_activations=False
    )
    assert resolve_request(off).workload == replace(
        w, loss_chunk_tokens=0, offload_activations=False
    )
    cpu = make_plan(replace(w, device="cpu"), find_gpu("T4"))
    assert not cpu.host_bytes and any("host RAM" in n for n in cpu.notes)
    assert (
        cpu.peak_bytes
        == make_plan(replace(plain, device="cpu", loss_chunk_tokens=512), find_gpu("T4")).peak_bytes
    )
