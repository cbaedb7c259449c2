"""GRPO (train.objective grpo): the loss's gradients equal TRL's ``GRPOTrainer``
on the same rollouts, advantages follow TRL's rule, sampling is keyed, bad input is
refused before weights load, and a run learns and resumes byte-identically.

TRL (a test-only dependency) computes the same micro-batch with its own trainer code:
``GRPOTrainer._compute_loss`` (and its ``_get_per_token_logps_and_entropies``, through
TRL's fused LM head at the same temperature) on a stand-in ``self`` holding the
trainer's settings.
"""

from __future__ import annotations

import json
import random
import signal
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from conftest import CLI, FAST, read_events, state_digest
from shoestring.data.formats import parse_record
from shoestring.data.prompts import tokenize_prompts
from shoestring.train.builtin import model_tokenizer, padded_vocab
from shoestring.train.grpo import GRPO
from shoestring.train.rollout import Rollouts, group_advantages
from shoestring.train.sampler import Sampling, sample

trl = pytest.importorskip("trl")

TEMPERATURE = 0.7
GROUP = 4


@pytest.fixture(scope="module")
def tok() -> Any:
    return model_tokenizer()


def _llama_config(tok: Any, layers: int) -> Any:
    """A tiny random Llama's config (widths multiples of 64) over ``tok``'s vocabulary."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=padded_vocab(len(tok)),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        pad_token_id=tok.pad_token_id,
    )


def _model(tok: Any) -> Any:
    """A tiny random Llama with TRL's fused head (before PEFT, as TRL requires) and a
    LoRA adapter whose B matrices are non-zero, so policy != reference."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    base = LlamaForCausalLM(_llama_config(tok, layers=2))
    add_fused_lm_head(base, outputs=("log_probs", "entropy"), temperature=TEMPERATURE)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")
    model = get_peft_model(base, lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    model.train()
    return model


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    return _model(tok)


def _rollouts(tok: Any) -> Rollouts:
    """Two prompts of one token length (TRL left-pads prompts; ours are whole rows),
    completions of varied lengths, some ending at EOS, some truncated."""
    recs = [
        parse_record({"prompt": f"reverse: {w} =", "answer": w[::-1]}, f"p.jsonl:{i}", "prompt")
        for i, w in enumerate(("abcde", "vwxyz"), 1)
    ]
    prompts, _ = tokenize_prompts(recs, tok, None, 64)
    rng = random.Random(3)
    completions, truncated = [], []
    for _ in range(2 * GROUP):
        n = rng.randint(2, 9)
        ids = [rng.randrange(3, 250) for _ in range(n)]
        cut = rng.random() < 0.3
        completions.append(ids if cut else [*ids, tok.eos_token_id])
        truncated.append(cut)
    table = np.array([[rng.random()] for _ in completions])
    adv, rewards = group_advantages(table, [1.0], GROUP, True)
    return Rollouts(prompts, completions, truncated, table, adv, rewards, GROUP)


def _trl(model: Any, loss_type: str, beta: float, max_len: int) -> Any:
    from accelerate import Accelerator

    return SimpleNamespace(
        model=model,
        accelerator=Accelerator(cpu=True),
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        aux_loss_enabled=False,
        beta=beta,
        epsilon_low=0.2,
        epsilon_high=0.2,
        importance_sampling_level="token",
        loss_type=loss_type,
        max_completion_length=max_len,
        off_policy_mask_threshold=None,
        top_entropy_quantile=1.0,
        use_vllm=False,
        current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (
            trl.GRPOTrainer._get_per_token_logps_and_entropies(_FAKE[0], *a, **k)
        ),
    )


_FAKE: list[Any] = []


def _trl_inputs(r: Rollouts, tok: Any, fake: Any, mask_truncated: bool) -> dict[str, Any]:
    width = max(len(c) for c in r.completions)
    comp = torch.full((len(r.completions), width), tok.pad_token_id, dtype=torch.long)
    cmask = torch.zeros_like(comp)
    for i, (c, cut) in enumerate(zip(r.completions, r.truncated)):
        comp[i, : len(c)] = torch.tensor(c)
        cmask[i, : len(c)] = 0 if (mask_truncated and cut) else 1
    prompt = torch.tensor([list(r.prompts[i // r.group].ids) for i in range(len(r.completions))])
    inputs = {
        "prompt_ids": prompt,
        "prompt_mask": torch.ones_like(prompt),
        "completion_ids": comp,
        "completion_mask": cmask,
        "advantages": r.advantages,
        "num_items_in_batch": cmask.sum(),
    }
    if fake.beta:
        with torch.no_grad(), fake.model.disable_adapter():
            ids = torch.cat([prompt, comp], 1)
            mask = torch.cat([torch.ones_like(prompt), cmask.clamp(min=1)], 1)
            ref, _, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(
                fake, fake.model, ids, mask, width
            )
        inputs["ref_per_token_logps"] = ref
    return inputs


def _grads(model: Any) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize(
    "loss_type,beta,mask_truncated,chunk",
    [
        pytest.param("dapo", 0.0, False, 0, marks=pytest.mark.slow),  # the next two cover it
        ("grpo", 0.04, True, 0),
        pytest.param("dr_grpo", 0.0, False, 0, marks=pytest.mark.slow),  # one more divisor
        ("dapo", 0.04, False, 5),  # train.loss_chunk_tokens: the head on completions only
    ],
)
def test_grpo_gradients_equal_trl(
    model: Any, tok: Any, loss_type: str, beta: float, mask_truncated: bool, chunk: int
) -> None:
    """The same rollouts through TRL's loss and ours: equal adapter gradients (the loss
    value itself is ~0 by construction: advantages are centred per group)."""
    r = _rollouts(tok)
    max_len = 12
    fake = _trl(model, loss_type, beta, max_len)
    _FAKE[:] = [fake]
    inputs = _trl_inputs(r, tok, fake, mask_truncated)
    want_loss = trl.GRPOTrainer._compute_loss(fake, model, inputs)
    want_loss.backward()
    want = _grads(model)

    ours = GRPO(beta, loss_type, TEMPERATURE, max_len, chunk)  # type: ignore[arg-type]
    batch = r.collate(0, 2, tok.pad_token_id, mask_truncated)
    norm = {
        "dapo": float(r.completion_tokens(mask_truncated)),
        "grpo": float(len(r.completions)),
        "dr_grpo": float(len(r.completions) * max_len),
    }[loss_type]
    out = ours.loss(model, model, batch, torch.tensor(norm, dtype=torch.float64))
    out.loss.backward()
    got = _grads(model)
    assert abs(float(out.loss) - float(want_loss)) < 1e-6
    assert want.keys() == got.keys() and len(want) > 0
    scale = max(float(g.abs().max()) for g in want.values())
    assert scale > 1e-4, "the gradients must not vanish here"
    for name, g in want.items():
        assert torch.allclose(got[name], g, atol=1e-5 * scale, rtol=1e-4), name
    if beta:
        assert float(out.sums[0]) > 0  # the KL estimate: policy != reference here


def test_advantages_follow_trls_rule() -> None:
    """(reward - group mean) / (group std + 1e-4), NaN-aware, TRL's ``nanstd``; a
    completion no function scored gets 0; weights sum the functions."""
    from trl.trainer.utils import nanstd

    rng = np.random.default_rng(0)
    table = rng.random((12, 2))
    table[1, 0] = np.nan  # one function did not score it
    table[5] = np.nan  # no function scored it
    weights = [1.0, 0.5]
    adv, rewards = group_advantages(table, weights, 4, True)
    t = torch.from_numpy(table).float()
    r = (t * torch.tensor(weights)).nansum(1)
    r[5] = torch.nan
    g = r.view(-1, 4)
    want = (g - torch.nanmean(g, 1, keepdim=True)) / (nanstd(g, dim=1, keepdim=True) + 1e-4)
    want = torch.nan_to_num(want.reshape(-1), nan=0.0)
    assert torch.allclose(adv, want, atol=1e-6)
    assert adv[5] == 0 and torch.isnan(rewards[5])
    centred, _ = group_advantages(table, weights, 4, False)  # scale_rewards none
    assert torch.allclose(centred[:4], (r[:4] - r[:4].mean()), atol=1e-6)


def _tiny_llama(tok: Any) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    return LlamaForCausalLM(_llama_config(tok, layers=1)).eval()


def test_completions_are_keyed_by_step_and_prompt_whatever_the_batch(tok: Any) -> None:
    """The same (seed, step, position) give the same completions whatever the global
    RNG holds and whichever prompts share the generate call; another step others; each
    ends at its first stop token or is marked truncated."""
    m = _tiny_llama(tok)
    recs = [
        parse_record({"prompt": p}, f"p:{i}", "prompt")
        for i, p in enumerate(["reverse: abc =", "say: a much longer prompt here ="])
    ]
    prompts, _ = tokenize_prompts(recs, tok, None, 64)
    stop = (int(prompts[0].ids[-1]),)  # a frequent token, so some completions stop early
    prompts = [type(p)(p.ids, stop, p.record) for p in prompts]
    s = Sampling(6, 10, temperature=2.0)
    dev = torch.device("cpu")
    pairs = list(enumerate(prompts))
    alone = [row for pair in pairs for row in sample(m, [pair], s, 11, 3, tok.pad_token_id, dev)]
    torch.manual_seed(999)
    together = sample(m, pairs, s, 11, 3, tok.pad_token_id, dev)
    later = sample(m, pairs, s, 11, 4, tok.pad_token_id, dev)
    assert together == alone and later != alone and len(alone) == 12
    for ids, cut in alone + later:
        assert cut == (stop[0] not in ids)
        assert len(ids) == 10 if cut else ids.index(stop[0]) == len(ids) - 1


def test_keyed_sampler_draws_from_the_tempered_filtered_distribution() -> None:
    """Gumbel-max over HF's warpers: frequencies match softmax(logits / T) restricted to
    the top-k, within 4 standard errors; filtered tokens are never drawn."""
    from shoestring.train.sampler import KeyedSampler

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    s = Sampling(1, 1, temperature=0.8, top_k=4)
    n = 20000
    sampler = KeyedSampler(range(n), s, torch.device("cpu"))
    draws = sampler(torch.zeros((n, 1), dtype=torch.long), logits.expand(n, -1)).argmax(-1)
    counts = torch.bincount(draws, minlength=6).double() / n
    want = torch.softmax(logits[0, :4] / 0.8, -1).double()
    assert counts[4:].sum() == 0
    se = (want * (1 - want) / n).sqrt()
    assert ((counts[:4] - want).abs() < 4 * se).all(), (counts, want)


LETTERS = '''
def letters(completions, completion_ids, **_):
    """The share of a completion's tokens that are lowercase letters."""
    return [sum(ch.islower() and ch.isascii() for ch in t) / max(len(ids), 1)
            for t, ids in zip(completions, completion_ids)]
'''


def _grpo_args(tmp_path: Path, *extra: str) -> list[str]:
    reward = tmp_path / "letters.py"
    reward.write_text(LETTERS)
    prompts = tmp_path / "prompts.jsonl"
    rng = random.Random(5)
    rows = [{"prompt": f"say: {rng.randint(0, 999)} =", "id": i} for i in range(16)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [
        *FAST,
        "--data.train",
        str(prompts),
        "--train.objective",
        "grpo",
        "--grpo.rewards",
        json.dumps([f"{reward}:letters"]),
        "--grpo.generations",
        "4",
        "--grpo.max_completion_tokens",
        "6",
        "--train.batch_size",
        "2",
        "--train.lr",
        "1e-2",
        *extra,
    ]


def test_bad_grpo_input_is_refused_before_weights_load(cli: CLI, tmp_path: Path) -> None:
    """A reward that cannot be imported stops the CLI with exit 2 before anything is
    written; a record without a prompt, or without the field a built-in reward reads,
    fails naming file:line (both are read before the model)."""
    from shoestring.data.records import DataError
    from shoestring.data.sources import read_records, resolve_source
    from shoestring.train.rewards import check_fields

    args = _grpo_args(tmp_path)
    r = cli.run(tmp_path / "a", *args, "--grpo.rewards", '["rewards_nowhere:score"]')
    assert r.returncode == 2 and "grpo.rewards[0] (rewards_nowhere:score)" in r.stderr, r.stderr
    assert not (tmp_path / "a" / "checkpoints").exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "b"}\n{"question": "b"}\n')
    source = resolve_source(str(bad), tmp_path / "sources", key="data.train")
    with pytest.raises(DataError, match=f"{bad}:2: missing 'prompt'"):
        read_records(source, "prompt")
    bad.write_text('{"prompt": "a", "answer": "b"}\n{"prompt": "c"}\n')
    records, _ = read_records(source, "prompt")
    check_fields(["builtin:similarity"], records[:1])
    with pytest.raises(DataError, match=f"{bad}:2: no 'answer' field.*grpo.rewards\\[1\\]"):
        check_fields(["x.py:f", "builtin:exact_match"], records)


@pytest.mark.slow  # ~40 s: two runs and a kill
def test_grpo_learns_and_a_sigkilled_run_reruns_byte_identical(cli: CLI, tmp_path: Path) -> None:
    """The letters reward rises from its random-init level; a run SIGKILLed after its
    first checkpoint and rerun ends byte-identical to the uninterrupted one (the
    completions are sampled from seeds keyed by step and prompt)."""
    from test_preference_run import _kill_after_a_commit

    args = _grpo_args(
        tmp_path,
        *("--train.max_steps", "8", "--checkpoint.every_steps", "2"),
        *("--data.eval", "0.25", "--eval.every_steps", "4"),
        *("--grpo.sample_prompts", "2"),  # batched calls: still keyed per completion
    )
    straight = tmp_path / "straight"
    r = cli.run(straight, *args)
    assert r.returncode == 0, r.stderr
    ev = read_events(straight)
    steps = [e for e in ev if e["event"] == "step"]
    assert all("rewards/letters/mean" in e and "completions/mean_length" in e for e in steps)
    assert steps[0]["reward"] < 0.5 and steps[-1]["reward"] > 0.9, [e["reward"] for e in steps]
    evals = {e["tag"]: e for e in ev if e["event"] == "eval"}
    assert evals.keys() == {"before", "periodic", "after"} and evals["before"]["samples"] == 4
    assert evals["before"]["reward"] < 0.5 < 0.9 < evals["after"]["reward"], evals

    out = tmp_path / "killed"
    p = cli.start(out, *args, env={"SHOESTRING_FAULTS": "step.forward@1:slow300"})
    committed = _kill_after_a_commit(out, p)
    assert p.returncode == -signal.SIGKILL and not (out / "final").exists()
    r = cli.run(out, *args)
    assert r.returncode == 0, r.stderr
    (resume,) = [e for e in read_events(out) if e["event"] == "resume"]
    assert resume["from_step"] == committed
    assert state_digest(out, 8) == state_digest(straight, 8)


@pytest.mark.slow  # ~60 s: torchrun with 2 gloo ranks, and one process
def test_two_ddp_ranks_train_grpo_like_one_process(cli: CLI, tmp_path: Path) -> None:
    """Each rank samples its prompts' groups from the same keyed seeds one process
    would, and divides by the same global normalizer: the steps' rewards and losses
    equal one process's (micro-batches of one prompt on both sides: the same dropout)."""
    from conftest import run_job

    args = _grpo_args(
        tmp_path,
        *("--train.max_steps", "4", "--train.batch_size", "4", "--train.micro_batch_size", "1"),
        *("--grpo.sample_prompts", "1"),  # no padded batches: the same floats at any size
    )
    two, one = tmp_path / "two", tmp_path / "one"
    r = run_job(cli, two, 2, *args)
    assert r.returncode == 0, r.stderr[-3000:]
    r = cli.run(one, *args)
    assert r.returncode == 0, r.stderr
    a = {e["step"]: e for e in read_events(two) if e["event"] == "step"}
    b = {e["step"]: e for e in read_events(one) if e["event"] == "step"}
    start = next(e for e in read_events(two) if e["event"] == "run_start")
    assert start["world_size"] == 2 and sorted(a) == sorted(b) == [1, 2, 3, 4]
    for s in a:
        assert a[s]["batch_crc"] == b[s]["batch_crc"] and a[s]["tokens"] == b[s]["tokens"], s
        assert a[s]["reward"] == b[s]["reward"], (s, a[s]["reward"], b[s]["reward"])
        assert abs(a[s]["loss"] - b[s]["loss"]) <= 1e-6 + 1e-4 * abs(b[s]["loss"]), s
    assert a[4]["reward"] > a[1]["reward"]


def test_conversation_prompts_end_at_the_turn_and_reach_rewards_as_messages() -> None:
    """A {"prompt": [messages]} record: rendered with the generation prompt, stopped at
    the template's end of turn; the reward functions get TRL's conversational shapes
    (the message list; the completion as an assistant message, its end token dropped
    from the text, kept in completion_ids) and the record's other fields."""
    from chat_fixtures import chatml_tokenizer
    from shoestring.train.rewards import Reward
    from shoestring.train.rollout import Scoring

    tok = chatml_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    rec = parse_record({"prompt": messages, "answer": "yo"}, "c.jsonl:1", "prompt")
    (prompt,), stats = tokenize_prompts([rec], tok, None, 64)
    text = tok.decode(list(prompt.ids))
    assert text.endswith("<|im_start|>assistant\n") and text.startswith("<|im_start|>system")
    assert prompt.stop == (tok.convert_tokens_to_ids("<|im_end|>"),) and stats.samples == 1
    seen: dict[str, Any] = {}

    def spy(**kw: Any) -> list[float]:
        seen.update(kw)
        return [float(len(c[0]["content"])) for c in kw["completions"]]

    hello = tok("hello", add_special_tokens=False)["input_ids"]
    completions = [[*hello, *prompt.stop], hello[:2]]
    table, adv, _ = Scoring((Reward("spy", spy),), True).advantages([prompt], completions, 2, tok)
    assert seen["prompts"] == [messages, messages] and seen["answer"] == ["yo", "yo"]
    assert seen["completions"] == [
        [{"role": "assistant", "content": "hello"}],
        [{"role": "assistant", "content": tok.decode(hello[:2])}],
    ]
    assert seen["completion_ids"] == completions
    assert table[:, 0].tolist() == [5.0, float(len(tok.decode(hello[:2])))] and adv[0] > 0
    long = parse_record({"prompt": [{"role": "user", "content": "x " * 200}]}, "c:2", "prompt")
    assert tokenize_prompts([long], tok, None, 64)[1].dropped == 1


def _notice_args(tmp_path: Path) -> list[str]:
    return _grpo_args(
        tmp_path,
        *("--train.max_steps", "3", "--train.batch_size", "4", "--data.max_length", "24"),
        *("--grpo.sample_prompts", "1"),  # a generate call per prompt: four calls a step
    )


def test_a_notice_while_sampling_abandons_the_step(cli: CLI, tmp_path: Path) -> None:
    """SIGTERM before the 6th generate call (step 2's second of four): the run stops
    before the third, without training step 2, commits step 1's state and exits 75."""
    out = tmp_path / "noticed"
    r = cli.run(out, *_notice_args(tmp_path), env={"SHOESTRING_FAULTS": "step.rollout@6:term"})
    assert r.returncode == 75, r.stderr
    ev = read_events(out)
    assert [e["step"] for e in ev if e["event"] == "step"] == [1]
    (gone,) = [e for e in ev if e["event"] == "step_abandoned"]
    (notice,) = [e for e in ev if e["event"] == "preempt"]
    assert gone["step"] == 2 and notice["step"] == 1 and notice["saved"] is True
    assert (out / "checkpoints" / "step-00000001" / "manifest.json").is_file()
    shown = [e for e in ev if e["event"] == "completions"]
    assert [e["step"] for e in shown] == [1] and len(shown[0]["samples"]) == 2
    keys = {"prompt", "completion", "rewards", "advantage", "truncated"}
    assert set(shown[0]["samples"][0]) == keys
    assert shown[0]["samples"][0]["prompt"].startswith("say: ")


@pytest.mark.slow  # ~60 s in CI's company: three runs (the CI test above makes the first)
def test_the_rerun_after_an_abandoned_step_is_exact(cli: CLI, tmp_path: Path) -> None:
    """The rerun samples step 2 again from the same seeds and ends byte-identical to a
    run that was never interrupted."""
    args = _notice_args(tmp_path)
    straight = tmp_path / "straight"
    assert cli.run(straight, *args).returncode == 0
    out = tmp_path / "noticed"
    r = cli.run(out, *args, env={"SHOESTRING_FAULTS": "step.rollout@6:term"})
    assert r.returncode == 75, r.stderr
    assert cli.run(out, *args).returncode == 0
    (resume,) = [e for e in read_events(out) if e["event"] == "resume"]
    assert resume["from_step"] == 1
    assert state_digest(out, 3) == state_digest(straight, 3)


def test_batch_scaled_advantages_use_the_whole_batch_std(tok: Any) -> None:
    """grpo.scale_rewards batch: (reward - group mean) / (std of every reward + 1e-4),
    applied after the counts are summed (here one rank), as TRL's ``batch``."""
    from trl.trainer.utils import nanstd

    from shoestring.train.grpostep import RolloutWorker
    from shoestring.train.rewards import Reward
    from shoestring.train.rollout import Scoring

    def length(completion_ids: list[list[int]], **_: Any) -> list[float]:
        return [float(len(c)) for c in completion_ids]

    recs = [parse_record({"prompt": f"q{i} ="}, f"p:{i}", "prompt") for i in range(3)]
    prompts, _ = tokenize_prompts(recs, tok, None, 64)
    prompts = [type(p)(p.ids, (int(p.ids[-1]),), p.record) for p in prompts]
    worker = RolloutWorker(
        prompts,
        Sampling(4, 8, temperature=2.0, prompts_per_call=3),
        Scoring((Reward("length", length),), "batch"),
        "dapo",
        False,
        7,
        tok.pad_token_id,
        False,
    )
    dev = torch.device("cpu")
    inputs = worker.inputs(_tiny_llama(tok), tok, [0, 1, 2], 0, dev, lambda x: x, lambda: False)
    assert inputs is not None
    r = inputs.rollouts.rewards
    g = r.view(-1, 4)
    want = ((g - g.mean(1, keepdim=True)) / (nanstd(r) + 1e-4)).reshape(-1)
    assert torch.allclose(inputs.rollouts.advantages, want, atol=1e-5)
    assert r.std() > 0 and inputs.norm == sum(len(c) for c in inputs.rollouts.completions)


def test_the_head_runs_on_completions_in_chunks_where_the_model_allows(tok: Any) -> None:
    """By default GRPO's LM head sees only completion positions (HEAD_CHUNK at a time;
    train.loss_chunk_tokens when set); a model whose logits the chunks would skip
    (soft-capping) gets its own whole forward."""
    from shoestring.config import build
    from shoestring.train.config import FinetuneConfig
    from shoestring.train.grpo import HEAD_CHUNK, head_chunk

    cfg = build(FinetuneConfig, [])
    m = _tiny_llama(tok)
    assert head_chunk(cfg, m) == HEAD_CHUNK
    cfg.train.loss_chunk_tokens = 256
    assert head_chunk(cfg, m) == 256
    m.config.final_logit_softcapping = 30.0
    assert head_chunk(cfg, m) == 0
