"""Data: malformed lines fail with file:line; the sample order resumes in O(1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoestring.cli import main
from shoestring.data.records import IGNORE_INDEX, DataError, Record
from shoestring.data.sources import read_records, resolve_source
from shoestring.data.tokenize import TokenizeSpec, tokenize_records
from shoestring.train.data import SampleOrder
from shoestring.train.samples import collate_padded


def read_jsonl(path: Path) -> list[Record]:
    return read_records(resolve_source(str(path), path.parent / "cache"), "auto")[0]


def tokenize(records: list[Record], tok: object, max_length: int) -> list:
    return tokenize_records(records, tok, TokenizeSpec(max_length))[0]


class ByteTok:
    """Bytes + 3; puts BOS (1) in front when asked for special tokens, like Llama's."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1] * add_special_tokens + [b + 3 for b in text.encode()]


@pytest.mark.parametrize(
    "line,msg",
    [
        ('{"text": "ok"', "invalid JSON"),
        ('["text"]', "expected a JSON object"),
        ('{"prompt": "a"}', "missing 'completion'"),
        ('{"completion": "a"}', "missing 'prompt'"),
        ('{"foo": 1}', "missing 'text' or 'prompt'\\+'completion'"),
        ('{"text": 5}', "'text' must be a string"),
        ('{"text": "a", "prompt": "b", "completion": "c"}', "use either .*not both"),
        ('{"prompt": "a", "completion": ""}', "'completion' is empty"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path: Path, line: str, msg: str) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "fine"}\n\n' + line + "\n")
    with pytest.raises(DataError, match=rf"d\.jsonl:3: {msg}"):
        read_jsonl(p)


def test_cli_malformed_data_exit_2_before_model_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = tmp_path / "train.jsonl"
    p.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a" "completion": "b"}\n')
    model = tmp_path / "never-loaded"  # a folder no load could read: the data fails first
    model.mkdir()
    (model / "config.json").write_text("{}")
    rc = main(
        [
            "finetune",
            "--data.train",
            str(p),
            "--output_dir",
            str(tmp_path / "o"),
            "--model.path",
            str(model),
        ]
    )
    assert rc == 2
    assert f"{p}:2: invalid JSON" in capsys.readouterr().err


def test_completion_only_labels_and_truncation() -> None:
    recs = read_jsonl_text('{"prompt": "ab", "completion": "cd"}\n{"text": "xyz"}\n')
    ex = tokenize(recs, ByteTok(), max_length=64)
    assert ex[0].input_ids == [1, 100, 101, 102, 103, 2]
    assert ex[0].labels == [IGNORE_INDEX] * 3 + [102, 103, 2]
    assert ex[1].labels == [IGNORE_INDEX, 123, 124, 125, 2]
    with pytest.raises(DataError, match="nothing to learn"):
        tokenize(recs[:1], ByteTok(), max_length=3)


def read_jsonl_text(text: str) -> list:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write(text)
    return read_jsonl(Path(f.name))


def test_collate_pads_and_masks() -> None:
    recs = read_jsonl_text('{"text": "abcdef"}\n{"text": "ghij"}\n')
    ex = tokenize(recs, ByteTok(), 64)
    batch = collate_padded(ex, pad_id=0)
    assert batch["input_ids"].shape == (2, 8)
    assert batch["attention_mask"][1].tolist() == [1] * 6 + [0, 0]
    assert batch["labels"][1, 6:].tolist() == [IGNORE_INDEX] * 2


def test_sample_order_is_a_pure_function_of_position() -> None:
    a = SampleOrder(10, seed=3)
    full = a.indices(0, 35)
    assert sorted(full[:10]) == list(range(10)) and sorted(full[10:20]) == list(range(10))
    assert full[:10] != full[10:20]  # new permutation each epoch
    b = SampleOrder(10, seed=3)  # a "resumed" order, jumping straight to position 23
    assert b.indices(23, 12) == full[23:35]
    assert SampleOrder(10, seed=4).indices(0, 10) != full[:10]


def test_resume_cursor_cost_is_independent_of_position() -> None:
    import time

    order = SampleOrder(1000, seed=0)
    t0 = time.perf_counter()
    order.indices(10, 8)
    near = time.perf_counter() - t0
    order2 = SampleOrder(1000, seed=0)
    t0 = time.perf_counter()
    order2.indices(10**9, 8)  # a million epochs in, no replay
    far = time.perf_counter() - t0
    assert far < max(near * 20, 0.05)
