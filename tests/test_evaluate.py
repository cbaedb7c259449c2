"""shoestring evaluate: lm-eval tasks answered by streamed inference jobs.

The honest check is lm-eval's own ``hf`` backend on the same model and tasks: the
same per-document log-likelihoods (within 1e-4), greedy flags, generated strings
and metrics. Tasks are tiny custom YAMLs over local JSON files (nothing downloaded).
The model's context is 64 tokens (a byte tokenizer: a token per character), so one
multiple-choice pair, one generation prompt and half the perplexity documents are
longer than it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shoestring.evaluate.cli import evaluate
from shoestring.evaluate.config import EvaluateConfig
from shoestring.infer.config import InferModelConfig, JobConfig
from shoestring.infer.fixtures import build_random_model

pytest.importorskip("lm_eval")

MC_YAML = """\
task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: label
doc_to_choice: choices
metric_list:
  - metric: acc
  - metric: acc_norm
"""

GEN_YAML = """\
task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: answer
generation_kwargs:
  until: {until}
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
"""

PPL_YAML = """\
task: tiny_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""

#: The test model's context (max_position_embeddings).
CONTEXT = 64

WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "rock", "fish"]


def _questions() -> list[str]:
    """The third is longer than the context less max_gen_toks: lm-eval cuts its left end."""
    qs = [f"say {WORDS[i]} {WORDS[(i * 7) % 10]}" for i in range(4)]
    qs[2] = "say " + " ".join(WORDS * 3) + " " + qs[2][4:]
    return qs


def _stop_hit_by_greedy(model: Path) -> str:
    """A character the model (run by transformers itself) generates greedily after the
    first prompt, a few tokens in: a stop string the generation task's answers meet."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype="float32")
    ids = tok(f"Q: {_questions()[0]}\nA:", return_tensors="pt").input_ids
    out = lm.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :]
    text = tok.decode(out, skip_special_tokens=True)
    return next(c for c in text[2:] if c.isascii() and c.isprintable() and c != '"')


def _question(i: int) -> str:
    """The first is longer than the model's context: lm-eval cuts its left end."""
    lead = " ".join(WORDS * 8) + ", then " if i == 0 else ""
    return f"which word follows {lead}{WORDS[i]} {WORDS[(i * 3) % 10]}?"


def _documents() -> list[str]:
    """Perplexity documents of one, one, three and six of the model's windows."""
    return [" ".join(WORDS[(i + k) % 10] for k in range(n)) for i, n in enumerate((3, 12, 40, 70))]


def _write_tasks(folder: Path, stop: str) -> Path:
    """Three tasks over local JSONL files: multiple choice (loglikelihood), generation
    (stopped at ``stop``, sixth of its stop strings: the job is given the first four,
    the rest are cut afterwards) and perplexity (loglikelihood_rolling)."""
    folder.mkdir(parents=True, exist_ok=True)
    mc, gen, ppl = folder / "mc.jsonl", folder / "gen.jsonl", folder / "ppl.jsonl"
    mc.write_text(
        "".join(
            json.dumps(
                {
                    "question": _question(i),
                    "choices": [f" {WORDS[(i + k) % 10]}" for k in range(3)],
                    "label": i % 3,
                }
            )
            + "\n"
            for i in range(8)
        )
    )
    gen.write_text(
        "".join(json.dumps({"question": q, "answer": " x"}) + "\n" for q in _questions())
    )
    (folder / "tiny_mc.yaml").write_text(MC_YAML.format(data=mc))
    until = json.dumps(["\n", "zz", "qq", "##", "@@", stop])
    (folder / "tiny_gen.yaml").write_text(GEN_YAML.format(data=gen, until=until))
    sampled = GEN_YAML.format(data=gen, until=until).replace("do_sample: false", "do_sample: true")
    (folder / "tiny_sampled.yaml").write_text(sampled.replace("tiny_gen", "tiny_sampled"))
    ppl.write_text("".join(json.dumps({"text": t}) + "\n" for t in _documents()))
    (folder / "tiny_ppl.yaml").write_text(PPL_YAML.format(data=ppl))
    return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("lmeval")
    model = build_random_model(
        root / "model", "llama", hidden=128, layers=2, ffn=256, seed=3, context=CONTEXT
    )
    return model, _write_tasks(root / "tasks", _stop_hit_by_greedy(model))


def _config(model: Path, tasks: Path, work: Path, names: list[str]) -> EvaluateConfig:
    return EvaluateConfig(
        model=InferModelConfig(path=str(model), device="cpu"),
        tasks=names,
        include_path=str(tasks),
        work_dir=str(work),
        log_samples=True,
        job=JobConfig(progress="off"),
    )


MC_GEN = ("tiny_mc", "tiny_gen")


def _ours(
    model: Path,
    tasks: Path,
    work: Path,
    chunk_size: int = 0,
    limit: int = 0,
    names: tuple[str, ...] = MC_GEN,
) -> dict[str, Any]:
    cfg = _config(model, tasks, work, list(names))
    cfg.job.chunk_size, cfg.limit = chunk_size, limit
    assert evaluate(cfg) == 0
    return json.loads((work / "results.json").read_text())


def _hf(
    model: Path, tasks: Path, limit: int | None = None, names: tuple[str, ...] = MC_GEN
) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(  # type: ignore[no-any-return]
        model="hf",
        model_args={"pretrained": str(model), "dtype": "float32", "device": "cpu"},
        tasks=list(names),
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        batch_size=4,
        limit=limit,
        log_samples=True,
        random_seed=1234,
        numpy_random_seed=1234,
        torch_random_seed=1234,
        fewshot_random_seed=1234,
    )


def _per_doc(results: dict[str, Any], task: str) -> list[Any]:
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_results_match_lm_evals_hf_backend(setup: tuple[Path, Path], tmp_path: Path) -> None:
    model, tasks = setup
    names = (*MC_GEN, "tiny_ppl")
    ours = _ours(model, tasks, tmp_path / "work", limit=6, names=names)
    theirs = _hf(model, tasks, limit=6, names=names)
    mc_ours, mc_theirs = _per_doc(ours, "tiny_mc"), _per_doc(theirs, "tiny_mc")
    assert len(mc_ours) == len(mc_theirs) == 6  # --limit reached lm-eval (the file has 8)
    for doc_ours, doc_theirs in zip(mc_ours, mc_theirs):
        for (lp, greedy), (lp_hf, greedy_hf) in zip(
            (r[0] for r in doc_ours), (r[0] for r in doc_theirs)
        ):
            assert lp == pytest.approx(lp_hf, abs=1e-4) and greedy == greedy_hf
    assert _per_doc(ours, "tiny_gen") == _per_doc(theirs, "tiny_gen")
    cut = [len(r[0][0]) for r in _per_doc(ours, "tiny_gen")]
    assert min(cut) < 12 / 2, cut  # a stop string ended a generation early
    for task, metrics in (
        ("tiny_mc", ("acc,none", "acc_norm,none")),
        ("tiny_gen", ("exact_match,none",)),
    ):
        for m in metrics:
            assert ours["results"][task][m] == theirs["results"][task][m], (task, m)
    # Perplexity: each document's windows summed; the longest spans 6 windows of 64.
    ppl_ours, ppl_theirs = _per_doc(ours, "tiny_ppl"), _per_doc(theirs, "tiny_ppl")
    assert len(ppl_ours) == len(ppl_theirs) == len(_documents())
    for doc_ours, doc_theirs in zip(ppl_ours, ppl_theirs):
        assert doc_ours[0][0] == pytest.approx(doc_theirs[0][0], abs=1e-4)
    for m in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours["results"]["tiny_ppl"][m] == pytest.approx(
            theirs["results"]["tiny_ppl"][m], rel=1e-5
        )
    # one score job per call (multiple choice: 6 docs x 3 choices; perplexity: every
    # document's windows), one generate job
    jobs = sorted(p.name.split("-")[0] for p in (tmp_path / "work" / "jobs").iterdir())
    assert jobs == ["generate", "score", "score"]


def _cli(
    model: Path, tasks: Path, work: Path, faults: str = "", names: str = "tiny_mc,tiny_gen"
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SHOESTRING_FAULTS": faults, "TOKENIZERS_PARALLELISM": "false"}
    args = ["--model.path", str(model), "--model.device", "cpu", "--tasks", names]
    args += ["--include-path", str(tasks), "--work-dir", str(work), "--log-samples"]
    args += ["--job.chunk-size", "4", "--job.progress", "off"]
    cmd = [sys.executable, "-m", "shoestring", "evaluate", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # three evaluations (~20 s); the CI test checks the results themselves
@pytest.mark.parametrize(
    ("faults", "code", "done"),
    [
        ("step.end@3:kill", -9, 2),  # SIGKILL after the score job's 3rd chunk's pass
        ("step.end@3:term", 75, 2),  # SIGTERM there: the job stops, exit 75
    ],
)
def test_killed_mid_job_the_rerun_resumes_it_and_gives_the_same_results(
    setup: tuple[Path, Path], tmp_path: Path, faults: str, code: int, done: int
) -> None:
    model, tasks = setup
    clean = _ours(model, tasks, tmp_path / "clean", chunk_size=4)  # the same chunks
    work = tmp_path / "work"
    stopped = _cli(model, tasks, work, faults=faults)
    assert stopped.returncode == code, stopped.stderr[-2000:]
    assert not (work / "results.json").exists()
    rerun = _cli(model, tasks, work)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    again = json.loads((work / "results.json").read_text())
    assert again["results"] == clean["results"]
    for task in ("tiny_mc", "tiny_gen"):
        assert _per_doc(again, task) == _per_doc(clean, task)
    (score,) = (work / "jobs").glob("score-*")
    starts = [json.loads(x) for x in (score / "run" / "events.jsonl").read_text().splitlines()]
    starts = [e for e in starts if e["event"] == "infer_start"]
    assert [e["chunks_done"] for e in starts] == [0, done]  # the rerun computed only the rest
    jobs = [json.loads(x) for x in (work / "events.jsonl").read_text().splitlines()]
    assert [(e["mode"], e["resumed"]) for e in jobs if e["event"] == "evaluate_job"] == [
        ("score", False),
        ("score", True),
        ("generate", False),
    ]
    assert any(e["event"] == "evaluate_preempt" for e in jobs) == (code == 75)


@pytest.mark.slow  # an unknown name is only known unknown after lm-eval indexes its ~14,700 built-in tasks (~10 s here)
def test_unknown_task_is_refused_before_anything_loads(
    setup: tuple[Path, Path], tmp_path: Path
) -> None:
    _model, tasks = setup
    work = tmp_path / "work"
    # no model at that path: a refusal naming the task comes before the model is looked at
    done = _cli(tmp_path / "no-model-here", tasks, work, names="tiny_mc,no_such_task")
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "unknown task(s) no_such_task" in last and "tiny_mc" not in last, last
    assert not work.exists()


def test_score_lines_of_token_ids_are_checked_naming_the_line(tmp_path: Path) -> None:
    from shoestring.config import ConfigError
    from shoestring.infer.inputs import read_input

    good = {"prompt_ids": [5, 6], "completion_ids": [7]}
    path = tmp_path / "in.jsonl"
    for bad, why in (
        ({"prompt_ids": [5, -1], "completion_ids": [7]}, '"prompt_ids" must be a non-empty list'),
        ({"prompt_ids": [5], "completion_ids": []}, '"completion_ids" must be a non-empty list'),
        ({"prompt_ids": [5], "completion_ids": [7], "completion": "x"}, "exactly one of"),
    ):
        path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(ConfigError, match=f"{path}:2: .*{why}"):
            read_input(path, "score", 8)
    path.write_text(json.dumps(good) + "\n")
    (rec,) = read_input(path, "score", 8).records or []
    assert (rec.prompt_ids, rec.completion_ids, rec.single) == ((5, 6), (7,), True)


def test_a_score_line_one_token_longer_than_the_context_is_scored_as_transformers_does(
    setup: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The last token is scored, never fed: context + 1 tokens fit, context + 2 do not."""
    import torch
    from transformers import AutoModelForCausalLM

    from shoestring.cli import main

    model, _ = setup
    ids = [(7 * i + 3) % 200 + 10 for i in range(CONTEXT + 1)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"prompt_ids": ids[:40], "completion_ids": ids[40:]}) + "\n")
    args = ["infer", "--model", str(model), "--input", str(inp), "--output", str(out)]
    args += ["--mode", "score", "--device", "cpu", "--job.progress", "off"]
    assert main(args) == 0, capsys.readouterr().err
    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(lm(torch.tensor([ids[:-1]])).logits[0].double(), -1)
    expected = sum(float(logp[i - 1, ids[i]]) for i in range(40, len(ids)))
    assert line["tokens"] == CONTEXT + 1 - 40
    assert line["logprob"] == pytest.approx(expected, abs=1e-4)
    inp.write_text(json.dumps({"prompt_ids": ids[:41], "completion_ids": ids[40:]}) + "\n")
    assert main([*args[:6], str(tmp_path / "out2.jsonl"), *args[7:]]) == 2
    err = capsys.readouterr().err
    assert (
        f"io.input: line 1: the prompt + its completion but the last token (never fed) is {CONTEXT + 1} tokens, more than the model's context of {CONTEXT}"
        in err
    ), err


@pytest.mark.parametrize(
    ("task", "why"),
    [
        ("tiny_sampled", "task tiny_sampled samples"),
    ],
)
def test_what_streaming_cannot_answer_is_refused_naming_the_task(
    setup: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    task: str,
    why: str,
) -> None:
    model, tasks = setup
    assert evaluate(_config(model, tasks, tmp_path / "work", [task])) == 2
    assert why in capsys.readouterr().err
    assert not (tmp_path / "work" / "jobs").exists()  # refused before any job ran


def test_the_verb_names_a_missing_key_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from shoestring.cli import main

    argv = ["evaluate", "--tasks", "tiny_mc", "--work-dir", str(tmp_path / "w")]
    assert main(argv) == 2
    assert "--model.path (model.path) is required" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()
