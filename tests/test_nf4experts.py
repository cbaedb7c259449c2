"""QLoRA of a mixture-of-experts base with its fused experts in NF4 (bitsandbytes'
quantizer leaves transformers 5's 3-D expert parameters in 16 bits).

The model computes what the same model with those experts dequantized computes under
transformers' own eager experts loop and peft's own expert LoRA; only routed experts
are read; the CLI trains it, resumes it bit-exactly and exports the merged model as
peft merges onto the dequantized base."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import CLI, FAST, read_events, state_digest
from shoestring.cli import main
from shoestring.infer.fixtures import build_random_model
from shoestring.train.config import ModelConfig
from shoestring.train.nf4experts import QuantizedExperts, is_placeholder, stacks_of

pytest.importorskip("bitsandbytes")

ARCHS: dict[str, dict[str, Any]] = {
    # [experts, out, in], SiLU gate and up concatenated
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    # the same layout; Mixtral's and OLMoE's own routers (OLMoE: q/k norms over all heads)
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    # [experts, in, out], biases, interleaved clamped gate
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=32, sliding_window=8,
                    context=131072, layer_types=["sliding_attention", "full_attention"] * 2),
}  # fmt: skip


def _moe(root: Path, arch: str) -> Path:
    return build_random_model(root / arch, arch, init_std=0.05, **ARCHS[arch])


def _load(model_dir: Path, quantize: str = "nf4") -> Any:
    from shoestring.train.model import load_base_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = ModelConfig(path=str(model_dir), dtype="float32", attn_implementation="eager")
        return load_base_model(model_dir, cfg, quantize)


def dequantize_experts(model: Any) -> Any:
    """The reference: each NF4 stack back as a dense parameter of its values, run by
    transformers' eager experts loop."""
    for module in model.modules():
        for name, stack in stacks_of(module).items():
            setattr(module, name, torch.nn.Parameter(stack.dense(), requires_grad=False))
        module.__dict__.pop("nf4_stacks", None)
    model.set_experts_implementation("eager")
    return model


def _with_lora(model: Any) -> Any:
    """LoRA on the attention and on both expert parameters (peft's ``all-linear`` maps
    the experts of the Mixtral and Qwen-MoE families only), A and B random; on NF4
    experts, factored as ``apply_lora`` does."""
    from peft import LoraConfig, get_peft_model

    from shoestring.train.model import trainable_parameters
    from shoestring.train.nf4lora import factor_expert_lora

    lora = LoraConfig(r=8, target_modules=["q_proj", "v_proj"],
                      target_parameters=["gate_up_proj", "down_proj"])  # fmt: skip
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(1)
        peft_model = get_peft_model(model, lora)
        factor_expert_lora(peft_model)
        for p in trainable_parameters(peft_model).values():
            p.normal_(0.0, 0.05)
    return peft_model


@pytest.mark.parametrize("arch", list(ARCHS))
def test_nf4_experts_compute_the_dequantized_model_with_peft_lora(
    arch: str, tmp_path: Path
) -> None:
    from shoestring.train.nf4lora import FactoredExperts

    torch.set_num_threads(1)
    model_dir = _moe(tmp_path, arch)
    ours, ref = _load(model_dir), dequantize_experts(_load(model_dir))
    experts = QuantizedExperts.of(ours)
    assert experts is not None and experts.modules == 4
    assert experts.bytes_nf4 < 0.16 * experts.bytes_16bit  # fp32 base: 4.1 bits of 32
    stacked = [getattr(m, n) for m in ours.modules() for n in stacks_of(m)]
    assert stacked and all(is_placeholder(p) and p.untyped_storage().nbytes() == 4 for p in stacked)
    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the base: the same kernels' values, the same order of sums
        base_logits = ours(input_ids=ids).logits
        assert torch.equal(base_logits, ref(input_ids=ids).logits)

    ours, ref = _with_lora(ours), _with_lora(ref)
    assert sum(isinstance(m, FactoredExperts) for m in ours.modules()) == 4
    assert not any(isinstance(m, FactoredExperts) for m in ref.modules())  # peft's own
    got, want = ours(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    with torch.no_grad(), ours.disable_adapter():  # a DPO reference: the base, exactly
        assert torch.equal(ours(input_ids=ids).logits, base_logits)
    got.loss.backward()
    want.loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    expert_grads = [n for n in grads if ".experts." in n]
    assert len(expert_grads) == 16  # A and B of two parameters in four layers
    for name, p in ours.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_only_the_experts_tokens_are_routed_to_are_read(tmp_path: Path) -> None:
    """An expert no token goes to is never dequantized: poisoned, it changes nothing;
    poisoned while routed to, it does."""
    experts = _load(_moe(tmp_path, "qwen3_moe")).model.layers[0].mlp.experts
    x = torch.randn(6, 128)
    routes = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 1], [2, 1], [1, 0]])
    weights = torch.full((6, 2), 0.5)
    clean = experts(x, routes, weights)
    for stack in stacks_of(experts).values():
        stack.states[3].state2.absmax.fill_(float("nan"))  # expert 3: never routed to
    assert torch.equal(experts(x, routes, weights), clean)
    stacks_of(experts)["down_proj"].states[2].state2.absmax.fill_(float("nan"))
    assert torch.isnan(experts(x, routes, weights)).any()


def test_qlora_of_an_moe_base_resumes_exactly_and_exports_as_peft_merges_it(
    cli: CLI, tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the CLI: the load event says what was quantized; a run SIGKILLed right
    after its step-4 checkpoint and rerun ends in the state of an uninterrupted one; the
    merged export is, bitwise, peft's merge of the adapter onto the dequantized base."""
    from peft import PeftModel
    from safetensors.torch import load_file

    monkeypatch.setenv("SHOESTRING_CACHE", str(cache_dir))
    model_dir = _moe(tmp_path, "qwen3_moe")
    args = [*FAST, "--model.path", str(model_dir), "--lora.dropout", "0", "--train.max_steps",
            "8", "--lora.quantize", "nf4", "--data.eval", ""]  # fmt: skip
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    killed = cli.start(cut, *args, env={"SHOESTRING_FAULTS": "ckpt.after_rename@1:kill"})
    torch.set_num_threads(1)
    assert main(["finetune", "--output_dir", str(ref), *args, "--export.merged"]) == 0
    assert killed.wait(timeout=300) != 0
    resumed = cli.run(cut, *args)
    assert resumed.returncode == 0, resumed.stderr
    assert [e["from_step"] for e in read_events(cut) if e["event"] == "resume"] == [4]
    assert state_digest(cut, 8) == state_digest(ref, 8)
    load = next(e for e in read_events(ref) if e["event"] == "load" and e["phase"] == "model")
    assert load["nf4_experts"] == 4 and "qbase_skipped" not in load
    assert load["nf4_expert_bytes"] < 0.16 * load["nf4_expert_bytes_16bit"]
    adapter = load_file(str(ref / "final" / "adapter_model.safetensors"))
    expert_b = [k for k in adapter if ".mlp.experts." in k and ".lora_B." in k]
    assert expert_b and all(bool(adapter[k].ne(0).any()) for k in expert_b)

    base = dequantize_experts(_load(model_dir)).dequantize()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_merged = PeftModel.from_pretrained(base, str(ref / "final")).merge_and_unload()
    peft_merged.save_pretrained(str(tmp_path / "peft-merged"))
    ours, theirs = (
        {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
        for d in (ref / "merged", tmp_path / "peft-merged")
    )
    assert ours.keys() == theirs.keys()
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in ours  # the stored layout
    for k, v in theirs.items():
        assert torch.equal(ours[k], v), k


def test_a_restart_reads_the_nf4_experts_from_the_quantized_base_cache(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first run saves the quantized base with its NF4 experts (one more file, sealed
    in the manifest with the rest); the next reads it instead of quantizing, holds the
    same stacks and trains to the same bytes."""
    import shutil

    from safetensors import safe_open

    from shoestring.train.nf4stored import EXPERTS_FILE

    cache = tmp_path / "cache"
    cache.mkdir()
    for child in cache_dir.iterdir():  # the tokenizer and built-in model, not the qbase
        if child.name.startswith("tiny-"):
            shutil.copytree(child, cache / child.name)
    monkeypatch.setenv("SHOESTRING_CACHE", str(cache))
    model_dir = _moe(tmp_path, "olmoe")
    args = [*FAST, "--model.path", str(model_dir), "--lora.dropout", "0", "--train.max_steps",
            "3", "--lora.quantize", "nf4", "--data.eval", ""]  # fmt: skip
    torch.set_num_threads(1)
    loads = []
    for run in ("a", "b"):
        assert main(["finetune", "--output_dir", str(tmp_path / run), *args]) == 0
        events = read_events(tmp_path / run)
        loads.append(next(e for e in events if e["event"] == "load" and e["phase"] == "model"))
    (entry,) = [p for p in (cache / "qbase").iterdir() if not p.name.startswith(".")]
    assert loads[0]["source"] == "model_dir" and loads[0]["qbase_saved"] == entry.name
    assert loads[1]["source"] == "qbase-local" and loads[1]["quantize_s"] == 0.0
    for field in ("nf4_experts", "nf4_expert_params", "nf4_expert_bytes"):
        assert loads[1][field] == loads[0][field], field
    manifest = json.loads((entry / "manifest.json").read_text())
    assert EXPERTS_FILE in manifest["files"]  # sealed and sha256-verified with the rest
    with safe_open(str(entry / "model.safetensors"), "pt") as f:  # no 16-bit experts
        assert [k for k in f.keys() if ".experts." in k] == []
        assert any(k.endswith("q_proj.weight") for k in f.keys())
    assert state_digest(tmp_path / "b", 3) == state_digest(tmp_path / "a", 3)


def test_the_cache_keeps_nf4_experts_only_where_transformers_can_restore_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stacks are installed at transformers' ``_finalize_model_loading``: a version
    without it skips caching them (a restart quantizes again) rather than failing."""
    from transformers import PreTrainedModel

    from shoestring.train.nf4stored import restorable

    assert restorable()
    monkeypatch.delattr(PreTrainedModel, "_finalize_model_loading")
    assert not restorable()


def test_fsdp_is_refused_and_no_checkpointing_warning_for_nf4_experts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """NF4 experts are not parameters FSDP2 could shard: refused by name before loading.
    peft's whole-stack forms, which made gradient checkpointing a must, are not made."""
    from shoestring.config import ConfigError, load
    from shoestring.train.config import FinetuneConfig
    from shoestring.train.model import check_fused_base

    moe = _moe(tmp_path, "qwen3_moe")
    cfg = load(FinetuneConfig, None, ["--lora.dropout", "0", "--lora.quantize", "nf4"])
    with pytest.raises(ConfigError, match="distributed.strategy: fsdp"):
        check_fused_base(moe, cfg.model, cfg.lora, "fsdp")
    with caplog.at_level("WARNING", "shoestring.finetune"):
        check_fused_base(moe, cfg.model, cfg.lora, "ddp")
    assert "gradient_checkpointing" not in caplog.text


def _path_of(model: Any, module: Any) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def test_experts_are_quantized_as_transformers_loads_them(tmp_path: Path) -> None:
    """The loader's hook leaves nothing for the pass after the load, and quantizes each
    expert to the very bytes the pass after the load gives."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from shoestring.train.nf4experts import quantize_experts, quantized_as_loaded

    model_dir = _moe(tmp_path, "qwen3_moe")
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                           bnb_4bit_use_double_quant=True)  # fmt: skip
    with quantized_as_loaded():
        hooked = AutoModelForCausalLM.from_pretrained(str(model_dir), quantization_config=q)
    assert quantize_experts(hooked) == 0  # all 8 were quantized while loading
    after = AutoModelForCausalLM.from_pretrained(str(model_dir), quantization_config=q)
    assert not any(stacks_of(m) for m in after.modules())  # the hook is gone after its block
    assert quantize_experts(after) == 8
    pairs = [(stacks_of(a), stacks_of(b)) for a, b in zip(hooked.modules(), after.modules())]
    pairs = [(a, b) for a, b in pairs if a]
    assert len(pairs) == 4
    plain = AutoModelForCausalLM.from_pretrained(str(model_dir))  # the stored weights
    for module, (a, b) in zip([m for m in after.modules() if stacks_of(m)], pairs, strict=True):
        for name in a:
            assert torch.equal(a[name].packed, b[name].packed)
            # NF4 of the stored weights, within its rounding: not any bytes that match
            stored = plain.get_submodule(_path_of(after, module)).get_parameter(name)
            dense = a[name].dense()
            assert (
                torch.nn.functional.cosine_similarity(dense.flatten(), stored.flatten(), 0) > 0.99
            )
            assert (dense - stored).abs().max() <= 0.15 * stored.abs().max()
            assert all(
                torch.equal(x.absmax, y.absmax) for x, y in zip(a[name].states, b[name].states)
            )


def test_gradient_checkpointing_recomputes_the_routed_experts_to_the_same_gradients(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With checkpointing the experts' forward runs again in the backward (factors handed
    down again): every adapter gradient equals the run without it."""
    from shoestring.train.nf4experts import ExpertStack

    torch.set_num_threads(1)
    model_dir = _moe(tmp_path, "qwen3_moe")
    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    grads, matmuls = [], []
    original = ExpertStack.matmul

    def counted(self: ExpertStack, x: torch.Tensor, e: int) -> torch.Tensor:
        matmuls[-1] += 1
        return original(self, x, e)

    monkeypatch.setattr(ExpertStack, "matmul", counted)
    for checkpointing in (False, True):
        matmuls.append(0)
        model = _with_lora(_load(model_dir))
        if checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
            model.enable_input_require_grads()
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert matmuls[1] == 2 * matmuls[0] > 0  # checkpointed: every expert forward runs twice
    assert grads[0].keys() == grads[1].keys() and any(".experts." in n for n in grads[0])
    for name, g in grads[0].items():
        assert g is not None and torch.equal(g, grads[1][name]), name


def test_gpt_oss_experts_train_in_nf4_through_lora_target_parameters(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """peft's ``all-linear`` does not reach gpt-oss's experts; ``lora.target_parameters``
    does: they train in NF4 (transposed, with biases) through the CLI, and the adapter
    names them as peft does."""
    import json

    from safetensors.torch import load_file

    monkeypatch.setenv("SHOESTRING_CACHE", str(cache_dir))
    torch.set_num_threads(1)
    model_dir = _moe(tmp_path, "gpt_oss")
    out = tmp_path / "run"
    args = [*FAST, "--model.path", str(model_dir), "--lora.dropout", "0", "--train.max_steps",
            "3", "--lora.quantize", "nf4", "--model.attn_implementation", "eager",
            "--lora.target_parameters", "gate_up_proj,down_proj", "--data.eval", ""]  # fmt: skip
    assert main(["finetune", "--output_dir", str(out), *args]) == 0
    load = next(e for e in read_events(out) if e["event"] == "load" and e["phase"] == "model")
    assert load["nf4_experts"] == 4
    config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert {"gate_up_proj", "down_proj"} <= set(config["target_parameters"])
    adapter = load_file(str(out / "final" / "adapter_model.safetensors"))
    expert_b = [k for k in adapter if ".mlp.experts." in k and ".lora_B." in k]
    assert len(expert_b) == 8 and all(bool(adapter[k].ne(0).any()) for k in expert_b)


def test_a_gguf_of_nf4_experts_reads_back_as_the_adapted_model(tmp_path: Path) -> None:
    """The GGUF export of a QLoRA with NF4 experts (Qwen3-MoE, adapters on the experts):
    each layer's experts stacked from the dequantized stacks plus peft's deltas, and the
    file reads back in transformers as the in-memory adapted model (f16's tolerance)."""
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    from gguf_fixtures import tiny_model_dir
    from shoestring.train.ggufexport import export_gguf
    from test_gguf import _reads_back

    d = tiny_model_dir(tmp_path / "tiny-qwen3-moe", "qwen3_moe")
    model = _with_lora(_load(d)).eval()
    assert QuantizedExperts.of(model) is not None
    tok = AutoTokenizer.from_pretrained(d)
    path = export_gguf(model, tok, tmp_path / "gguf", "f16", d.name)
    _reads_back(model, tok, path, "f16")


def test_all_linear_that_leaves_experts_bare_is_said_with_the_knob(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """gpt-oss's experts are out of ``all-linear``'s reach in peft: the run says so and
    names ``lora.target_parameters``; not once they are targeted, nor for Qwen3-MoE,
    whose experts peft maps itself."""
    from shoestring.train.config import LoraSection
    from shoestring.train.model import apply_lora

    said = []
    for arch, parameters in (("gpt_oss", []), ("gpt_oss", ["gate_up_proj", "down_proj"]),
                             ("qwen3_moe", [])):  # fmt: skip
        model_dir = tmp_path / arch
        if not model_dir.exists():
            _moe(tmp_path, arch)
        lora = LoraSection(dropout=0.0, target_parameters=parameters)
        caplog.clear()
        with caplog.at_level("WARNING", "shoestring.finetune"):
            apply_lora(_load(model_dir, "none"), lora, seed=0, gradient_checkpointing=False)
        said.append("--lora.target_parameters gate_up_proj,down_proj" in caplog.text)
    assert said == [True, False, False]


def test_peft_saying_its_expert_patterns_were_ignored_is_not_repeated(tmp_path: Path) -> None:
    """peft's ``all-linear`` gives Qwen3-MoE's ``gate_up_proj`` twice the rank through
    rank/alpha patterns, applies them, and warns they matched nothing (it checks modules,
    not parameters): that warning is dropped, the patterns are seen applied, and a
    pattern warning that names nothing adapted still gets through."""
    import warnings as w

    from peft.tuners.lora.layer import ParamWrapper

    from shoestring.train.config import LoraSection
    from shoestring.train.model import _rewarn, apply_lora

    lora = LoraSection(dropout=0.0, r=8, alpha=16)
    with w.catch_warnings(record=True) as said:
        w.simplefilter("always")
        model = apply_lora(_load(_moe(tmp_path, "qwen3_moe"), "none"), lora, 0, False)
    assert not [m for m in said if "_pattern keys did not match" in str(m.message)]
    wrappers = {m.parameter_name: m for m in model.modules() if isinstance(m, ParamWrapper)}
    assert wrappers["gate_up_proj"].r["default"] == 16  # the pattern, applied
    assert (
        wrappers["gate_up_proj"].scaling["default"]
        == 2.0
        == wrappers["down_proj"].scaling["default"]
    )

    text = "The following alpha_pattern keys did not match any targeted module and were ignored: "
    with w.catch_warnings(record=True) as seen:
        w.simplefilter("always")
        other = text + repr([r".*\.w9"]) + "."  # as peft writes it: the list's repr
        _rewarn([w.WarningMessage(RuntimeWarning(other), RuntimeWarning, "p.py", 1)],
                ["model.layers.0.mlp.experts.gate_up_proj"])  # fmt: skip
    assert [str(m.message) for m in seen] == [other]


def _resumed_with_meta(cli: CLI, out: Path, args: list[str], **meta: Any) -> Any:
    """Rewrite the newest checkpoint's manifest meta (``None`` removes a key), then rerun."""
    manifest_path = out / "checkpoints" / "step-00000004" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for key, value in meta.items():
        if value is None:
            manifest["meta"].pop(key)
        else:
            manifest["meta"][key] = value
    manifest_path.write_text(json.dumps(manifest))
    return cli.run(out, *args)


def test_a_checkpoint_whose_base_was_held_otherwise_is_refused(
    cli: CLI, tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every checkpoint records how its frozen base was held. One that says its experts
    were 16-bit (as an MoE's were under this config before NF4 experts) is refused with
    both forms named; one without the record resumes and says it could not check; other
    library versions resume and are named in the resume event."""
    monkeypatch.setenv("SHOESTRING_CACHE", str(cache_dir))
    model_dir = _moe(tmp_path, "qwen3_moe")
    args = [*FAST, "--model.path", str(model_dir), "--lora.dropout", "0", "--train.max_steps",
            "4", "--lora.quantize", "nf4", "--data.eval", ""]  # fmt: skip
    out = tmp_path / "run"
    torch.set_num_threads(1)
    assert main(["finetune", "--output_dir", str(out), *args]) == 0
    meta = json.loads((out / "checkpoints" / "step-00000004" / "manifest.json").read_text())
    layout = meta["meta"]["base_layout"]
    assert layout["experts"] == "nf4" and "nf4" in layout["linears"].split(",")
    assert meta["meta"]["versions"]["transformers"]

    more = [*args, "--train.max_steps", "5"]
    events_before = (out / "events.jsonl").read_bytes()
    refused = _resumed_with_meta(cli, out, more, base_layout={**layout, "experts": "bfloat16"})
    assert refused.returncode == 2, refused.stderr
    assert "experts: bfloat16 -> nf4" in refused.stderr
    assert not (out / "checkpoints" / "step-00000005").exists()
    # refused from the manifest, before the run directory is opened or weights load
    assert (out / "events.jsonl").read_bytes() == events_before

    old = {"transformers": "5.0.0", "torch": "2.9.0"}
    resumed = _resumed_with_meta(cli, out, more, base_layout=None, versions=old)
    assert resumed.returncode == 0, resumed.stderr
    assert "predates the record of how its base was held" in resumed.stderr
    (event,) = [e for e in read_events(out) if e["event"] == "resume"]
    assert event["base_layout"] == "unrecorded"
    assert event["versions_changed"] == {
        "torch": f"2.9.0 -> {torch.__version__}",
        "transformers": f"5.0.0 -> {__import__('transformers').__version__}",
    }
