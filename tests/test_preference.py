"""Preference tuning (train.objective dpo|orpo): the loss equals TRL's on a fixed batch,
the data is refused with file:line, and truncation never cuts an answer.

TRL (a test-only dependency) computes the same batch with its own trainer code:
``DPOTrainer._compute_loss`` (the reference through its own ``use_adapter`` on the
PEFT model, or its precomputed ``ref_*_logps`` inputs) and ``ORPOTrainer``'s
``get_batch_loss_metrics``, called on a stand-in ``self`` that holds the trainer's
settings.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from preference_rows import ROWS
from shoestring.data.formats import detect_format, parse_record
from shoestring.data.preference import fit_pair, pair_examples
from shoestring.data.records import DataError, Example, Record
from shoestring.data.sources import read_records, resolve_source
from shoestring.data.tokenize import TokenizeSpec
from shoestring.train.builtin import model_tokenizer, padded_vocab
from shoestring.train.objective import DPO, ORPO, PREFERENCE_METRICS, SimPO, sequence_logps
from shoestring.train.reflogps import compute_reference
from shoestring.train.samples import PairSamples

trl = pytest.importorskip("trl")

TOL = 1e-5


def _records(rows: list[dict[str, Any]]) -> list[Record]:
    return [
        parse_record(r, f"t.jsonl:{i}", detect_format(r, "t.jsonl")) for i, r in enumerate(rows, 1)
    ]


@pytest.fixture(scope="module")
def tok() -> Any:
    return model_tokenizer()


@pytest.fixture(scope="module")
def pairs(tok: Any) -> list[Example]:
    return pair_examples(_records(ROWS), tok, TokenizeSpec(max_length=48))


def _model(tok: Any) -> Any:
    """A tiny random Llama with TRL's fused head added (before PEFT, as TRL requires)
    and a LoRA adapter whose B matrices are non-zero, so policy != reference."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=padded_vocab(len(tok)),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        pad_token_id=tok.pad_token_id,
    )
    base = LlamaForCausalLM(cfg)
    add_fused_lm_head(base, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")
    model = get_peft_model(base, lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    model.eval()
    return model


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    return _model(tok)


def _accelerator() -> Any:
    from accelerate import Accelerator

    return Accelerator(cpu=True)


def _trl_dpo(model: Any, precompute: bool) -> Any:
    return SimpleNamespace(
        model=model,
        accelerator=_accelerator(),
        args=SimpleNamespace(gradient_checkpointing_kwargs=None),
        aux_loss_enabled=False,
        beta=0.1,
        f_divergence_type="reverse_kl",
        label_smoothing=0.0,
        ld_alpha=None,
        loss_types=["sigmoid"],
        loss_weights=[1.0],
        precompute_ref_logps=precompute,
        ref_model=None,
        use_weighting=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )


def _trl_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "completion_mask": (batch["labels"] != -100).long(),
    }


def _ours(objective: Any, model: Any, batch: dict[str, torch.Tensor], pairs: PairSamples) -> Any:
    norm = objective.normalizer(pairs, range(len(pairs)), None)
    with torch.no_grad():
        return objective.loss(model, model, batch, norm)


def test_dpo_loss_equals_trl_with_the_adapter_disabled_as_reference(
    model: Any, pairs: list[Example], tok: Any
) -> None:
    from trl import DPOTrainer

    samples = PairSamples(pairs)
    batch = samples.collate(range(len(samples)), tok.pad_token_id)
    fake = _trl_dpo(model, precompute=False)
    with torch.no_grad():
        want = DPOTrainer._compute_loss(fake, model, _trl_inputs(batch), False)
    out = _ours(DPO(beta=0.1), model, batch, samples)
    assert abs(float(out.loss) - float(want)) < TOL, (float(out.loss), float(want))
    assert abs(float(want) - 0.6931) > 1e-3, "policy and reference must differ here"
    means = dict(zip(PREFERENCE_METRICS, (out.sums / len(samples)).tolist(), strict=True))
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert abs(means[name] - fake._metrics["eval"][name][0]) < TOL, name


def test_dpo_precomputed_reference_equals_trl(model: Any, pairs: list[Example], tok: Any) -> None:
    """Our precomputed reference log-probs (fixed batches, adapter disabled) equal TRL's
    ``compute_ref_log_probs``; the loss from them equals TRL's precomputed-ref loss."""
    from trl import DPOTrainer

    ref = compute_reference(model, pairs, tok.pad_token_id, torch.device("cpu"), _no_autocast())
    samples = PairSamples(pairs, ref)
    batch = samples.collate(range(len(samples)), tok.pad_token_id)
    fake = _trl_dpo(model, precompute=True)
    inputs = _trl_inputs(batch)
    with torch.no_grad():
        trl_chosen, trl_rejected = DPOTrainer.compute_ref_log_probs(fake, model, inputs)
    k = len(samples)
    assert torch.allclose(batch["ref_logps"][:k].float(), trl_chosen.float(), atol=TOL)
    assert torch.allclose(batch["ref_logps"][k:].float(), trl_rejected.float(), atol=TOL)
    inputs.update(ref_chosen_logps=trl_chosen, ref_rejected_logps=trl_rejected)
    with torch.no_grad():
        want = DPOTrainer._compute_loss(fake, model, inputs, False)
    out = _ours(DPO(beta=0.1), model, batch, samples)
    assert abs(float(out.loss) - float(want)) < TOL
    # and the same as the adapter-disabled reference computed on the fly
    plain = _ours(
        DPO(beta=0.1), model, PairSamples(pairs).collate(range(k), tok.pad_token_id), samples
    )
    assert abs(float(out.loss) - float(plain.loss)) < TOL


@pytest.mark.slow  # the same code path as the sigmoid loss, one more term; ~3 s
def test_robust_dpo_equals_trl(model: Any, pairs: list[Example], tok: Any) -> None:
    from trl import DPOTrainer

    samples = PairSamples(pairs)
    batch = samples.collate(range(len(samples)), tok.pad_token_id)
    fake = _trl_dpo(model, precompute=False)
    fake.loss_types, fake.label_smoothing = ["robust"], 0.2
    with torch.no_grad():
        want = DPOTrainer._compute_loss(fake, model, _trl_inputs(batch), False)
    out = _ours(DPO(beta=0.1, label_smoothing=0.2), model, batch, samples)
    assert abs(float(out.loss) - float(want)) < TOL


def _no_autocast() -> Any:
    from shoestring.train.device import Precision

    return Precision("fp32", torch.device("cpu"))


class _TrlOrpo:
    """ORPOTrainer's own methods on a stand-in ``self``."""

    def __init__(self, pad_id: int, beta: float) -> None:
        from trl.experimental.orpo import ORPOTrainer

        cls = ORPOTrainer
        self.is_encoder_decoder = False
        self.padding_value = pad_id
        self.accelerator = _accelerator()
        self.aux_loss_enabled = False
        self.beta = beta
        self.concatenated_inputs = cls.concatenated_inputs
        self.get_batch_logps = cls.get_batch_logps
        self.concatenated_forward = cls.concatenated_forward.__get__(self)
        self.odds_ratio_loss = cls.odds_ratio_loss.__get__(self)
        self.loss_metrics = cls.get_batch_loss_metrics.__get__(self)


def _orpo_batch(pairs: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    from shoestring.train.samples import collate_padded

    out: dict[str, torch.Tensor] = {}
    for name, rows in (("chosen", pairs[0::2]), ("rejected", pairs[1::2])):
        b = collate_padded(rows, pad_id)
        out |= {f"{name}_input_ids": b["input_ids"], f"{name}_attention_mask": b["attention_mask"]}
        out[f"{name}_labels"] = b["labels"]
    return out


def test_orpo_loss_equals_trl(model: Any, pairs: list[Example], tok: Any) -> None:
    samples = PairSamples(pairs)
    batch = samples.collate(range(len(samples)), tok.pad_token_id)
    with torch.no_grad():
        want, metrics = _TrlOrpo(tok.pad_token_id, 0.1).loss_metrics(
            model, _orpo_batch(pairs, tok.pad_token_id)
        )
    out = _ours(ORPO(beta=0.1), model, batch, samples)
    assert abs(float(out.loss) - float(want)) < TOL, (float(out.loss), float(want))
    means = dict(zip(PREFERENCE_METRICS, (out.sums / len(samples)).tolist(), strict=True))
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen"):
        assert abs(means[name] - metrics[name]) < TOL, name


class _TrlCpo:
    """CPOTrainer's own methods (``loss_type simpo``) on a stand-in ``self``."""

    def __init__(self, pad_id: int, beta: float, gamma: float, alpha: float, ls: float) -> None:
        from trl.experimental.cpo import CPOTrainer

        cls = CPOTrainer
        self.is_encoder_decoder = False
        self.pad_token_id = pad_id
        self.accelerator = _accelerator()
        self.aux_loss_enabled = False
        self.loss_type = "simpo"
        self.beta, self.simpo_gamma, self.cpo_alpha, self.label_smoothing = beta, gamma, alpha, ls
        self.alpha = 0.0  # AlphaPO's reward transform: off
        self.concatenated_inputs = cls.concatenated_inputs
        self.get_batch_logps = cls.get_batch_logps
        self.concatenated_forward = cls.concatenated_forward.__get__(self)
        self.cpo_loss = cls.cpo_loss.__get__(self)
        self.loss_metrics = cls.get_batch_loss_metrics.__get__(self)


@pytest.mark.parametrize("alpha,ls", [(0.0, 0.0), (1.0, 0.1)])  # SimPO; CPO-SimPO, smoothed
def test_simpo_loss_equals_trl(
    model: Any, pairs: list[Example], tok: Any, alpha: float, ls: float
) -> None:
    samples = PairSamples(pairs)
    batch = samples.collate(range(len(samples)), tok.pad_token_id)
    with torch.no_grad():
        want, metrics = _TrlCpo(tok.pad_token_id, 2.0, 0.5, alpha, ls).loss_metrics(
            model, _orpo_batch(pairs, tok.pad_token_id)
        )
    out = _ours(SimPO(2.0, 0.5, alpha, ls), model, batch, samples)
    assert abs(float(out.loss) - float(want)) < TOL, (float(out.loss), float(want))
    means = dict(zip(PREFERENCE_METRICS, (out.sums / len(samples)).tolist(), strict=True))
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen"):
        assert abs(means[name] - metrics[name]) < TOL, name


@pytest.mark.slow  # the normalizer arithmetic; the SIGKILL test runs 2-pair batches; ~3 s
def test_micro_batches_add_up_to_the_whole_batch(
    model: Any, pairs: list[Example], tok: Any
) -> None:
    """Each micro-batch's loss is its share (sums over the global normalizer)."""
    samples = PairSamples(pairs)
    for objective in (DPO(beta=0.1), ORPO(beta=0.1), SimPO(2.0, 0.5, 1.0)):
        norm = objective.normalizer(samples, range(4), None)
        whole = _ours(objective, model, samples.collate(range(4), tok.pad_token_id), samples)
        with torch.no_grad():
            parts = [
                objective.loss(model, model, samples.collate(rows, tok.pad_token_id), norm)
                for rows in ([0, 1], [2, 3])
            ]
        assert abs(sum(float(p.loss) for p in parts) - float(whole.loss)) < TOL


def test_sequence_logps_sums_the_answer_tokens_only(pairs: list[Example], tok: Any) -> None:
    batch = PairSamples(pairs).collate([0], tok.pad_token_id)
    logits = torch.randn(*batch["input_ids"].shape, 320)
    got = sequence_logps(logits, batch["labels"])
    for row in range(2):
        labels = batch["labels"][row]
        want = sum(
            float(torch.log_softmax(logits[row, i - 1], -1)[labels[i]])
            for i in range(1, len(labels))
            if labels[i] != -100
        )
        assert abs(float(got[row]) - want) < 1e-4


# --------------------------------------------------------------------------- data


def test_text_and_conversational_records_are_detected(tmp_path: Path) -> None:
    path = tmp_path / "prefs.jsonl"
    rows = [
        {
            "chosen": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
            ],
            "rejected": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "go away"},
            ],
        },
        {
            "prompt": [{"role": "user", "content": "2+2?"}],
            "chosen": [{"role": "assistant", "content": "4"}],
            "rejected": [{"role": "assistant", "content": "5"}],
        },
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records, formats = read_records(resolve_source(str(path), tmp_path / "c"), "auto")
    assert set(formats.values()) == {"preference"}
    first = records[0]
    assert first.is_preference and first.answer_start == 1
    assert first.messages is not None and first.messages[-1]["content"] == "hello"
    assert first.rejected is not None and first.rejected.messages is not None
    assert first.rejected.messages[-1]["content"] == "go away"
    assert records[1].answer_start == 1 and records[1].messages is not None
    assert [m["content"] for m in records[1].messages] == ["2+2?", "4"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"prompt": "p", "chosen": "a"}, "missing 'rejected'"),
        (
            {"prompt": "p", "chosen": "a", "rejected": ["x"]},
            "must both be strings or both message lists",
        ),
        ({"chosen": "a", "rejected": "b"}, "missing 'prompt'"),
        ({"prompt": "p", "chosen": "", "rejected": "b"}, "'chosen' is empty"),
        (
            {"chosen": [{"role": "user", "content": "q"}], "rejected": [{"role": "user"}]},
            "rejected message 1: missing 'content'",
        ),
        (
            {
                "prompt": [{"role": "user", "content": "q"}],
                "chosen": [{"role": "assistant", "content": "a"}],
                "rejected": [{"role": "user", "content": "b"}],
            },
            "'rejected' must end with an assistant message",
        ),
    ],
)
def test_bad_records_are_refused_with_file_and_line(
    tmp_path: Path, line: dict[str, Any], message: str
) -> None:
    path = tmp_path / "prefs.jsonl"
    good = {"prompt": "p", "chosen": "a", "rejected": "b"}
    if isinstance(line.get("chosen"), list):
        good = {
            "prompt": [{"role": "user", "content": "q"}],
            "chosen": [{"role": "assistant", "content": "a"}],
            "rejected": [{"role": "assistant", "content": "b"}],
        }
    path.write_text(json.dumps(good) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(DataError) as e:
        read_records(resolve_source(str(path), tmp_path / "c"), "auto")
    assert f"{path}:2" in str(e.value) and message in str(e.value)


def test_prompt_is_truncated_from_its_start_and_answers_never(tok: Any) -> None:
    r = _records([{"prompt": "reverse: abcdefghij =", "chosen": " jihgfedcba", "rejected": " x"}])[
        0
    ]
    full = pair_examples([r], tok, TokenizeSpec(max_length=64))
    chosen, rejected = full
    limit = len(chosen.input_ids) - 5
    cut = pair_examples([r], tok, TokenizeSpec(max_length=limit))
    assert max(len(e.input_ids) for e in cut) == limit
    for before, after in zip(full, cut, strict=True):
        answer = [t for t in before.labels if t != -100]
        assert [t for t in after.labels if t != -100] == answer  # every answer token kept
        assert after.input_ids[0] == before.input_ids[0]  # the first token (BOS) kept
        assert after.input_ids[-len(answer) - 3 :] == before.input_ids[-len(answer) - 3 :]
    answer_and_bos = 1 + sum(1 for t in chosen.labels if t != -100)
    n = answer_and_bos - 1  # the chosen answer alone does not fit
    with pytest.raises(DataError, match=r"t.jsonl:1: the answers do not fit data.max_length"):
        fit_pair(r, chosen, rejected, TokenizeSpec(max_length=n))
    assert fit_pair(r, chosen, rejected, TokenizeSpec(max_length=n, truncate="drop")) is None


def test_plan_counts_chosen_and_rejected_and_the_reference_pass() -> None:
    from shoestring.plan.estimate import flops_per_token
    from shoestring.plan.workload import builtin_arch, workload_from_config
    from shoestring.train.config import FinetuneConfig

    def planned(objective: str, precompute: bool = False) -> Any:
        cfg = FinetuneConfig()
        cfg.train.objective, cfg.dpo.precompute_ref = objective, precompute  # type: ignore[assignment]
        return workload_from_config(cfg, builtin_arch())[0]

    sft, dpo, orpo = planned("sft"), planned("dpo"), planned("orpo")
    cached = planned("dpo", precompute=True)
    assert dpo.micro_batch == orpo.micro_batch == 2 * sft.micro_batch  # sequences per pass
    assert flops_per_token(orpo) == flops_per_token(sft) == flops_per_token(cached)
    a = builtin_arch()
    forward = 2 * (
        a.layers * sum(i * o for i, o in a.linear_shapes().values()) + a.vocab * a.hidden
    )
    forward += 2 * a.layers * dpo.seq_len * a.heads * a.head_dim
    assert flops_per_token(dpo) == flops_per_token(sft) + forward


def test_conversational_pairs_take_loss_on_the_answer_turn_only() -> None:
    from chat_fixtures import chatml_tokenizer

    tok = chatml_tokenizer()
    row = {
        "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
        "chosen": [{"role": "assistant", "content": "four"}],
        "rejected": [{"role": "assistant", "content": "five, or so"}],
    }
    chosen, rejected = pair_examples(_records([row]), tok, TokenizeSpec(max_length=128))
    for ex, answer in ((chosen, "four"), (rejected, "five, or so")):
        learned = tok.decode([t for t in ex.labels if t != -100])
        assert learned == answer + "<|im_end|>"
    start = sum(1 for t in chosen.labels if t == -100)  # the shared prompt, rendered once
    assert chosen.input_ids[: start - 1] == rejected.input_ids[: start - 1]


def test_pairs_refuse_packing_and_chunked_loss_and_the_wrong_records() -> None:
    from shoestring.config import ConfigError
    from shoestring.data.preference import preference_only
    from shoestring.train.config import FinetuneConfig
    from shoestring.train.objective import check_objective

    cfg = FinetuneConfig()
    cfg.train.objective = "orpo"
    cfg.data.packing = True
    with pytest.raises(ConfigError, match="data.packing"):
        check_objective(cfg)
    cfg.data.packing, cfg.train.loss_chunk_tokens = False, 256
    with pytest.raises(ConfigError, match="train.loss_chunk_tokens"):
        check_objective(cfg)
    cfg.train.loss_chunk_tokens, cfg.dpo.precompute_ref = 0, True
    with pytest.raises(ConfigError, match="dpo.precompute_ref"):
        check_objective(cfg)
    sft_row = _records([{"prompt": "p", "completion": "c"}])
    with pytest.raises(DataError, match="t.jsonl:1: train.objective dpo needs preference"):
        preference_only(sft_row, "dpo")
    with pytest.raises(DataError, match="t.jsonl:1: a preference record"):
        preference_only(_records(ROWS[:1]), "sft")
