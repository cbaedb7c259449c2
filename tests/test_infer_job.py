"""``shoestring infer`` as a job: input checks, kill-anywhere resume, memory budget, adapter."""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.context
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from shoestring.cli import main
from shoestring.infer.fixtures import build_random_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("tiny"), "llama", seed=2)


def _write_prompts(path: Path, n: int) -> Path:
    words = ["alpha", "beta", "gamma", "delta", "eps"]
    with open(path, "w") as f:
        for i in range(n):
            f.write(
                json.dumps({"id": f"p{i}", "prompt": " ".join(words[: 1 + i % 5]) * (1 + i % 3)})
                + "\n"
            )
    return path


def _args(model: Path, inp: Path, out: Path, *extra: str) -> list[str]:
    return [
        "infer",
        "--model",
        str(model),
        "--input",
        str(inp),
        "--output",
        str(out),
        "--threads",
        "1",
        "--job.progress",
        "off",
        *extra,
    ]


def _events(out: Path) -> list[dict]:
    p = Path(str(out) + ".run") / "events.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def test_bad_input_fails_before_loading_anything(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": 3}\n')
    out = tmp_path / "out.jsonl"
    assert main(_args(tiny, inp, out)) == 2
    assert f"{inp}:3" in capsys.readouterr().err and not out.exists()
    inp.write_text('{"prompt": "a"}\n{"prompt": "b"\n')
    assert main(_args(tiny, inp, out)) == 2
    assert f"{inp}:2: not valid JSON" in capsys.readouterr().err
    inp.write_text('{"prompt": "a", "completion": "x"}\n{"prompt": "b"}\n')
    assert main(_args(tiny, inp, out, "--mode", "score")) == 2
    assert f"{inp}:2: score mode needs" in capsys.readouterr().err
    assert main(_args(tiny, inp, out, "--memory-budget", "lots")) == 2
    assert "--memory-budget: 'memory.budget' not a size" in capsys.readouterr().err
    assert main(_args(tiny, inp, out, "--memory.budgt", "1GB")) == 2
    assert "did you mean 'memory.budget'" in capsys.readouterr().err
    inp.write_text('{"prompt": "a"}\n')
    assert main(_args(tiny, inp, out, "--memory-budget", "300MB")) == 2
    err = capsys.readouterr().err
    assert "memory.budget: 0.30 GB is too small for this model" in err
    # prefetch_depth is 1 (its least): the error names the budget that would do, not it
    assert "(memory.prefetch_depth is already 1)" in err and "raise the budget to " in err
    assert main(["infer", "--input", str(inp), "--output", str(out)]) == 2
    assert "--model (model.path) is required" in capsys.readouterr().err
    # past the model's context (1024 positions): refused, not generated as garbage
    inp.write_text('{"prompt": "a"}\n' + json.dumps({"prompt": "x" * 1000}) + "\n")
    assert main(_args(tiny, inp, out, "--max-new-tokens", "64")) == 2
    assert "line 2: the prompt + --max-new-tokens is 1064 tokens" in capsys.readouterr().err
    assert not Path(str(out) + ".run").exists()


def test_score_mode_picks_the_likeliest_choice(tiny: Path, tmp_path: Path) -> None:
    inp = tmp_path / "in.jsonl"
    inp.write_text(
        json.dumps({"prompt": "q:", "choices": ["yes", "no", "maybe"]})
        + "\n"
        + json.dumps({"prompt": "q:", "completion": "no"})
        + "\n"
    )
    out = tmp_path / "out.jsonl"
    assert main(_args(tiny, inp, out, "--mode", "score")) == 0
    a, b = [json.loads(line) for line in out.read_text().splitlines()]
    assert a["label"] == ["yes", "no", "maybe"][a["choice"]]
    assert a["logprobs"][a["choice"]] == max(a["logprobs"])
    assert abs(b["logprob"] - a["logprobs"][1]) < 1e-4 and b["tokens"] == a["tokens"][1] == 2
    start, end = _events(out)[0], _events(out)[-1]
    assert end["event"] == "infer_end" and end["passes"] == start["chunks"]  # prefill only


def test_rerun_with_other_output_settings_is_refused(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inp = _write_prompts(tmp_path / "in.jsonl", 3)
    out = tmp_path / "out.jsonl"
    assert main(_args(tiny, inp, out, "--max-new-tokens", "3")) == 0
    first = out.read_bytes()
    assert main(_args(tiny, inp, out, "--max-new-tokens", "3")) == 0  # complete: no-op
    assert out.read_bytes() == first
    assert [e["event"] for e in _events(out)].count("chunk") == 1
    assert main(_args(tiny, inp, out, "--max-new-tokens", "4")) == 2
    assert "belongs to a different job (generate.max_new_tokens changed)" in capsys.readouterr().err


def test_compute_dtype_is_resolved_once_and_pinned(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--compress with dtype auto: bf16 where it measures faster; the choice is pinned in
    run.json, so a rerun on a machine that measures otherwise computes the same way."""
    from shoestring.infer import dtype as job  # the dtype choice moved out of job.py

    inp = _write_prompts(tmp_path / "in.jsonl", 6)
    out = tmp_path / "out.jsonl"
    common = ("--max-new-tokens", "3", "--batch-size", "3", "--compress", "int8")
    monkeypatch.setattr(job, "bf16_is_faster", lambda device: True)
    assert main(_args(tiny, inp, out, *common, "--job.chunk_size", "3")) == 0
    first = out.read_bytes()
    run_json = json.loads((Path(str(out) + ".run") / "run.json").read_text())
    assert run_json["pinned"]["dtype"] == "bfloat16"
    assert [e["dtype"] for e in _events(out) if e["event"] == "infer_start"] == ["bfloat16"]
    # Rerun from half way on a "machine" where bf16 is slow: the pinned bf16 is kept.
    chunks = Path(str(out) + ".run") / "chunks"
    shutil.rmtree(sorted(chunks.iterdir())[-1])
    out.unlink()
    monkeypatch.setattr(job, "bf16_is_faster", lambda device: False)
    assert main(_args(tiny, inp, out, *common, "--job.chunk_size", "3")) == 0
    assert [e["dtype"] for e in _events(out) if e["event"] == "infer_start"][-1] == "bfloat16"
    assert out.read_bytes() == first
    # The same job in a fresh run dir resolves again (fp32 here) and computes differently;
    # without compression auto is always the checkpoint's dtype.
    fresh = tmp_path / "fresh.jsonl"
    assert main(_args(tiny, inp, fresh, *common)) == 0
    assert [e["dtype"] for e in _events(fresh) if e["event"] == "infer_start"] == ["float32"]
    assert job.compute_dtype("auto", torch.float32, "none", torch.device("cpu")) == torch.float32
    assert job.compute_dtype("auto", torch.bfloat16, "int8", torch.device("cpu")) == torch.bfloat16
    assert job.compute_dtype("float16", torch.float32, "none", torch.device("cpu")) == torch.float16
    assert (
        job.compute_dtype("auto", torch.float32, "int8", torch.device("cpu"), pinned="stored")
        == torch.float32
    )


def _reference_and_job(
    tiny: Path, tmp_path: Path, n: int, new_tokens: int, *job_args: str
) -> tuple[Path, Path, list[str]]:
    """An uninterrupted run's output (3 prompts per chunk), and the interrupted job's
    output path and arguments (the same job, plus ``job_args``)."""
    inp = _write_prompts(tmp_path / "in.jsonl", n)
    common = ["--max-new-tokens", str(new_tokens), "--batch-size", "3"]
    ref = tmp_path / "ref.jsonl"
    assert main(_args(tiny, inp, ref, *common)) == 0
    out = tmp_path / "out.jsonl"
    return ref, out, _args(tiny, inp, out, *common, *job_args)


class _Job:
    """A job started in a child process forked from a server that has already imported
    torch and transformers: a real process (kill -9, signals, its own RSS) without
    paying the imports again for every start."""

    def __init__(
        self, ctx: multiprocessing.context.BaseContext, args: list[str], faults: str = ""
    ) -> None:
        self.proc = ctx.Process(target=_child, args=(args, faults))
        self.proc.start()

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float) -> int | None:
        self.proc.join(timeout)
        return self.proc.exitcode

    def send_signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)  # type: ignore[arg-type]


def _child(args: list[str], faults: str) -> None:
    os.environ["SHOESTRING_FAULTS"] = faults
    torch.set_num_threads(1)
    sys.exit(main(args))


@pytest.fixture(scope="module")
def jobs() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    # transformers imports lazily; preload what a job touches, or every child pays ~5 s.
    ctx.set_forkserver_preload(
        [
            "torch",
            "transformers",
            "transformers.modeling_utils",
            "transformers.masking_utils",
            "transformers.cache_utils",
            "transformers.models.llama.modeling_llama",
            "transformers.models.auto.modeling_auto",
            "transformers.models.auto.tokenization_auto",
            "transformers.tokenization_utils_tokenizers",
            "transformers.processing_utils",
            "safetensors.torch",
            "shoestring.cli",
            "shoestring.infer.job",
            "shoestring.infer.engine",
            "shoestring.hf",
        ]
    )
    return ctx


def test_killed_anywhere_the_rerun_output_is_byte_identical(
    tiny: Path, tmp_path: Path, jobs: multiprocessing.context.BaseContext
) -> None:
    """Kill mid-chunk, kill mid-commit, preempt with SIGTERM, then finish: same bytes."""
    ref, out, args = _reference_and_job(tiny, tmp_path, 11, 5)

    def chunks() -> int:
        return (
            sum(e["event"] == "chunk" for e in _events(out))
            if Path(str(out) + ".run", "events.jsonl").exists()
            else 0
        )

    # 1: SIGKILL in the 8th pass (inside chunk 1, after chunk 0 committed).
    p = _Job(jobs, args, "step.end@8:kill")
    assert p.wait(timeout=120) == -9
    assert chunks() == 1 and not out.exists()
    # 2: SIGKILL inside the next commit, after its manifest, before the rename.
    p = _Job(jobs, args, "ckpt.before_rename@1:kill")
    assert p.wait(timeout=120) == -9
    assert chunks() == 1
    # 3: SIGTERM at the end of chunk 2's 2nd pass (this process redoes chunk 1 in passes
    # 1-5) -> exit 75, chunks kept, and chunk 2's generation saved after those 2 passes.
    p = _Job(jobs, args, "step.end@7:term")
    assert p.wait(timeout=120) == 75
    ev = _events(out)
    assert ev[-1]["event"] == "preempt" and ev[-1]["reason"] == "SIGTERM"
    assert chunks() == 2 and ev[-1]["mid_pass"] is False
    (saved,) = [e for e in ev if e["event"] == "partial_saved"]
    assert (saved["chunk"], saved["passes"]) == (2, 2)
    assert ev[-1]["partial_passes"] == saved["passes"]
    # 4: a clean rerun of the same command continues chunk 2 from there and finishes.
    n_before = len(_events(out))
    p = _Job(jobs, args)
    assert p.wait(timeout=120) == 0
    rerun = _events(out)[n_before:]
    assert [(e["chunk"], e["passes"]) for e in rerun if e["event"] == "partial_loaded"] == [
        (2, saved["passes"])
    ]
    assert rerun[-1]["passes"] == (5 - saved["passes"]) + 5  # rest of chunk 2, all of 3
    assert not list((Path(str(out) + ".run") / "partial").iterdir())
    assert out.read_bytes() == ref.read_bytes()
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["index"] for x in lines] == list(range(11))
    assert [x["id"] for x in lines] == [f"p{i}" for i in range(11)]
    starts = [e for e in _events(out) if e["event"] == "infer_start"]
    assert [s["chunks_done"] for s in starts] == [0, 1, 1, 2]


def test_kill_without_notice_resumes_from_the_periodic_state(
    tiny: Path, tmp_path: Path, jobs: multiprocessing.context.BaseContext
) -> None:
    """``job.save_every_s``: a SIGKILL in the middle of a chunk, with no signal first,
    costs only the passes since the last periodic save."""
    ref, out, args = _reference_and_job(
        tiny, tmp_path, 6, 6, "--job.save_every_s", "1e-9"
    )  # after every pass
    # Chunk 0 takes passes 1-6; SIGKILL at the end of pass 10 (chunk 1's 4th).
    assert _Job(jobs, args, "step.end@10:kill").wait(timeout=120) == -9
    saved = [(e["chunk"], e["passes"]) for e in _events(out) if e["event"] == "partial_saved"]
    assert saved == [(0, p) for p in range(1, 7)] + [(1, p) for p in range(1, 5)]
    n_before = len(_events(out))
    assert _Job(jobs, args).wait(timeout=120) == 0
    rerun = _events(out)[n_before:]
    assert [(e["chunk"], e["passes"]) for e in rerun if e["event"] == "partial_loaded"] == [(1, 4)]
    assert rerun[-1]["passes"] == 2
    assert out.read_bytes() == ref.read_bytes()


def test_a_state_save_that_fails_does_not_stop_the_job(
    tiny: Path, tmp_path: Path, jobs: multiprocessing.context.BaseContext
) -> None:
    ref, out, args = _reference_and_job(tiny, tmp_path, 3, 4, "--job.save_every_s", "1e-9")
    # The disk is full while the state after pass 2 is written (its 2nd file; a save of
    # this 4-layer model is 6 files): logged, the temp dir removed, the state of pass 1
    # kept, and the job finishes.
    assert _Job(jobs, args, "ckpt.after_file@8:enospc").wait(timeout=120) == 0
    ev = _events(out)
    (skipped,) = [e for e in ev if e["event"] == "partial_skipped"]
    assert skipped["passes"] == 2 and "No space left" in skipped["reason"]
    assert [e["passes"] for e in ev if e["event"] == "partial_saved"] == [1, 3, 4]
    assert not list((Path(str(out) + ".run") / "partial").iterdir())
    assert out.read_bytes() == ref.read_bytes()


def test_notice_inside_a_pass_stops_there_and_resumes_exactly(
    tiny: Path, tmp_path: Path, jobs: multiprocessing.context.BaseContext
) -> None:
    """SIGTERM between two layers of a decode pass: the job does not finish the pass (it
    may take longer than the notice), it saves the state as of the last whole pass."""
    ref, out, args = _reference_and_job(tiny, tmp_path, 6, 6)
    # 4 layers: the stop check runs before units 1-5 of each pass; hit 23 is before the
    # 3rd unit (2nd layer) of pass 5, chunk 0's 4th decode pass.
    assert _Job(jobs, args, "pass.unit@23:term").wait(timeout=120) == 75
    ev = _events(out)
    assert ev[-1]["event"] == "preempt" and ev[-1]["mid_pass"] is True
    assert [(e["chunk"], e["passes"]) for e in ev if e["event"] == "partial_saved"] == [(0, 4)]
    n_before = len(ev)
    assert _Job(jobs, args).wait(timeout=120) == 0
    rerun = _events(out)[n_before:]
    assert [(e["chunk"], e["passes"]) for e in rerun if e["event"] == "partial_loaded"] == [(0, 4)]
    assert out.read_bytes() == ref.read_bytes()


@pytest.mark.parametrize(
    "extra",
    [(), ("--compress", "int8", "--dtype", "bfloat16", "--max-new-tokens", "12")],
    ids=["fp32", "int8-bf16"],
)
def test_peak_rss_stays_within_a_budget_smaller_than_the_model(
    tmp_path: Path, jobs: multiprocessing.context.BaseContext, extra: tuple[str, ...]
) -> None:
    big = build_random_model(
        tmp_path / "big",
        "llama",
        hidden=1024,
        ffn=2816,
        layers=14,
        heads=8,
        kv_heads=8,
        shard="300MB",
        init_std=0.02,
    )
    model_bytes = sum(p.stat().st_size for p in big.glob("*.safetensors"))
    budget = 600_000_000
    assert model_bytes > 1.15 * budget
    inp = _write_prompts(tmp_path / "in.jsonl", 4)
    out = tmp_path / "out.jsonl"
    p = _Job(
        jobs,
        _args(
            big,
            inp,
            out,
            "--max-new-tokens",
            "2",
            "--memory-budget",
            str(budget),
            "--memory.runtime_reserve",
            "400MB",
            "--memory.prefetch_depth",
            "1",
            "--memory.micro_batch_tokens",
            "64",
            *extra,
        ),
    )
    assert p.wait(timeout=300) == 0
    end = _events(out)[-1]
    assert end["event"] == "infer_end"
    assert end["peak_rss_bytes"] <= budget, end
    assert end["bytes_read"] >= 2 * end["bytes_per_pass"]  # really streamed, twice
    if not extra:
        assert end["resident_units"] < 16 and end["bytes_per_pass"] > budget // 2
    else:  # resident units hold only their bf16 tensors, and more of them fit
        assert 0 < end["resident_units"] < 16 and end["passes"] == 12


def test_an_moe_model_streams_within_its_budget_and_answers_as_transformers(
    tmp_path: Path, jobs: multiprocessing.context.BaseContext
) -> None:
    """Qwen3-MoE stored as on the Hub (a tensor per expert), larger than the budget: its
    experts are fused as transformers runs them, in the budget's scratch; the answers
    are transformers' greedy ones."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    moe = build_random_model(tmp_path / "moe", "qwen3_moe", hidden=1024, ffn=1024, layers=12,
                             heads=8, kv_heads=4, shard="300MB", init_std=0.02, num_experts=10,
                             num_experts_per_tok=2, moe_intermediate_size=512)  # fmt: skip
    model_bytes = sum(p.stat().st_size for p in moe.glob("*.safetensors"))
    budget = 760_000_000
    assert model_bytes > 1.1 * budget
    inp = _write_prompts(tmp_path / "in.jsonl", 3)
    out = tmp_path / "out.jsonl"
    args = ["--max-new-tokens", "3", "--memory-budget", str(budget),
            "--memory.runtime_reserve", "400MB", "--memory.prefetch_depth", "1"]  # fmt: skip
    assert _Job(jobs, _args(moe, inp, out, *args)).wait(timeout=300) == 0
    end = _events(out)[-1]
    assert end["event"] == "infer_end" and end["peak_rss_bytes"] <= budget, end
    assert end["bytes_read"] >= 2 * end["bytes_per_pass"]  # really streamed
    ref = AutoModelForCausalLM.from_pretrained(str(moe)).eval()
    tok = AutoTokenizer.from_pretrained(str(moe))
    for line, got in zip(inp.read_text().splitlines(), out.read_text().splitlines()):
        ids = tok(json.loads(line)["prompt"], return_tensors="pt")["input_ids"]
        g = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                         do_sample=False)  # fmt: skip
        assert json.loads(got)["completion"] == tok.decode(
            g[0, ids.shape[1] :], skip_special_tokens=True
        )


def test_finetune_adapter_is_applied(tiny: Path, tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(tiny))
    peft_model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    )
    (tmp_path / "final").mkdir()
    peft_model.save_pretrained(str(tmp_path / "final"))
    merged = peft_model.merge_and_unload().eval()
    inp = _write_prompts(tmp_path / "in.jsonl", 3)
    outs = {}
    for extra in ((), ("--adapter", str(tmp_path / "final"))):
        out = tmp_path / f"out{len(extra)}.jsonl"
        assert main(_args(tiny, inp, out, "--max-new-tokens", "4", *extra)) == 0
        outs[len(extra)] = [json.loads(x)["completion"] for x in out.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(str(tiny))
    want = []
    for line in inp.read_text().splitlines():
        ids = tok(json.loads(line)["prompt"], return_tensors="pt")["input_ids"]
        g = merged.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False
        )
        want.append(tok.decode(g[0, ids.shape[1] :], skip_special_tokens=True))
    assert outs[2] == want and outs[0] != want


def test_plan_spends_the_budget_on_batch_first_and_counts_dequantized_residents() -> None:
    from types import SimpleNamespace

    from shoestring.infer.config import MemoryConfig
    from shoestring.infer.plan import Budget, Lengths, ModelShape, Needs, make_plan

    cfg = SimpleNamespace(
        hidden_size=256, intermediate_size=512, num_attention_heads=4, vocab_size=320
    )
    mb = 1 << 20
    common = dict(
        # at 250 MB all 10 plain units fit (with no ring left to reserve)
        budget=Budget(total=240 * mb, runtime=100 * mb),
        shape=ModelShape(config=cfg, itemsize=4, kv_per_token=16384),
        lengths=Lengths(prompts=[20] * 64, new_tokens=12),
        memory=MemoryConfig(batch_size=64, micro_batch_tokens=512, prefetch_depth=1, resident=-1),
    )
    plain = make_plan(needs=Needs(read=[10 * mb] * 10, extra=[0] * 10), **common)
    # int8-like: 2.5 MB read per unit, but 10 MB of dequantized weights once loaded.
    packed = make_plan(needs=Needs(read=[int(2.5 * mb)] * 10, extra=[10 * mb] * 10), **common)
    assert plain.batch_size == packed.batch_size == 64
    for p in (plain, packed):
        assert sum(p.breakdown.values()) <= p.budget
    assert len(packed.resident) <= len(plain.resident) < 10
    assert packed.breakdown["resident"] == len(packed.resident) * int(12.5 * mb)
    # Prepared entirely into scratch (dequantized and cast): a resident unit drops its
    # raw bytes, so the same room holds more of them.
    dropped = make_plan(
        needs=Needs(read=[int(2.5 * mb)] * 10, extra=[10 * mb] * 10, raw_kept=[False] * 10),
        **common,
    )
    assert dropped.breakdown["resident"] == len(dropped.resident) * 10 * mb
    assert len(dropped.resident) > len(packed.resident)
    assert sum(dropped.breakdown.values()) <= dropped.budget


def test_a_second_job_on_a_busy_run_dir_is_refused(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from shoestring.rundir import hold

    inp = _write_prompts(tmp_path / "in.jsonl", 2)
    out = tmp_path / "out.jsonl"
    with hold(Path(str(out) + ".run"), "x"):  # another job running on this output
        assert main(_args(tiny, inp, out, "--max-new-tokens", "2")) == 2
        assert f"is in use: pid {os.getpid()}" in capsys.readouterr().err
        assert not out.exists()
    assert main(_args(tiny, inp, out, "--max-new-tokens", "2")) == 0  # free again
