"""Records → examples: parity with the trainer's tokenizer for text and pairs, the three
truncation modes and their stats, and the same result for any number of workers."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

import shoestring.data.tokenize as tokenize_module
from chat_fixtures import chatml_tokenizer, multi_turn, plain_tokenizer
from shoestring.data.records import IGNORE_INDEX, DataError, Example, Record
from shoestring.data.records import Example as _Ex
from shoestring.data.tokenize import (
    TokenizeSpec,
    TokenizeStats,
    tokenize_record,
    tokenize_records,
)
from shoestring.train import data as train_data
from shoestring.train.builtin import builtin_records


class _Legacy:
    """The trainer's tokenizer before shoestring.data (frozen here): for a tokenizer that
    adds its BOS itself (Llama's, the tiny model's), text and pair records must keep
    tokenizing byte for byte the same, or resumed runs would change data. (One that names
    a BOS but does not add it loses the stray BOS: tests/test_specials.py.)"""

    @staticmethod
    def tokenize(records: Any, tok: Any, max_length: int) -> list[_Ex]:
        bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        out = []
        for r in records:
            if r.text is not None:
                ids = bos + tok.encode(r.text, add_special_tokens=False) + eos
                labels = list(ids)
                if bos:
                    labels[0] = IGNORE_INDEX
            else:
                p = bos + tok.encode(r.prompt or "", add_special_tokens=False)
                c = tok.encode(r.completion or "", add_special_tokens=False) + eos
                ids = p + c
                labels = [IGNORE_INDEX] * len(p) + c
            ids, labels = ids[:max_length], labels[:max_length]
            if all(x == IGNORE_INDEX for x in labels[1:]):
                raise DataError(f"{r.source}: nothing to learn")
            out.append(_Ex(ids, labels))
        return out

    @staticmethod
    def label_count(ex: _Ex) -> int:
        return sum(1 for t in ex.labels[1:] if t != IGNORE_INDEX)


def _mixed_plain(n: int) -> list[Record]:
    """Pairs from the built-in task, texts (some non-ASCII, one empty prompt) between them."""
    pairs = train_data.from_dicts(builtin_records("train")[:n], "reverse")
    out: list[Record] = []
    for i, r in enumerate(pairs):
        out.append(r)
        if i % 3 == 0:
            out.append(Record(f"texts.jsonl:{i}", text=f"text {i}: naïve café 東京 " * (i % 5 + 1)))
        if i % 7 == 0:
            out.append(Record(f"pairs.jsonl:{i}", prompt="", completion=f"answer {i}"))
    return out


def _chat(i: int) -> Record:
    messages = [dict(m, content=f"{m['content']} #{i}") for m in multi_turn()]
    return Record(f"chats.jsonl:{i + 1}", messages=tuple(messages))


def _labelled(ex: Example) -> int:
    return sum(1 for x in ex.labels[1:] if x != IGNORE_INDEX)


@pytest.mark.parametrize("max_length", [24, 48, 512])
def test_text_and_pairs_match_the_trainers_tokenizer(max_length: int) -> None:
    """Existing runs hash their examples: text and pairs must not change by a byte."""
    tok = plain_tokenizer()
    records = _mixed_plain(300)
    expected = _Legacy.tokenize(records, tok, max_length)
    examples, stats = tokenize_records(records, tok, TokenizeSpec(max_length))
    assert examples == expected
    assert [tokenize_record(r, tok, TokenizeSpec(max_length))[0] for r in records] == expected
    assert stats.samples == len(records) and stats.dropped == 0
    assert stats.kinds == {"pair": sum(r.is_pair for r in records), "text": stats.kinds["text"]}
    assert stats.tokens == sum(len(ex.input_ids) for ex in expected)
    assert stats.label_tokens == sum(_Legacy.label_count(ex) for ex in expected)
    over = sum(len(e.input_ids) > max_length for e in _Legacy.tokenize(records, tok, 10**6))
    assert stats.truncated == over and (over > 0) == (max_length < 512)


class EncodeOnlyTokenizer:
    """A tokenizer with nothing but ``encode`` (the trainer's ``Tokenizer`` protocol);
    like Llama's, it puts BOS in front when asked for special tokens."""

    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    pad_token_id: int | None = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1] * add_special_tokens + [b + 3 for b in text.encode()]


def test_an_encode_only_tokenizer_still_works() -> None:
    records = _mixed_plain(40)
    tok = EncodeOnlyTokenizer()
    examples, _ = tokenize_records(records, tok, TokenizeSpec(32))
    assert examples == _Legacy.tokenize(records, tok, 32)


def test_truncate_right_keeps_the_start_and_left_keeps_the_end() -> None:
    tok = plain_tokenizer()
    text = Record("t.jsonl:1", text="abcdefghijklmnopqrstuvwxyz")
    full, _ = tokenize_record(text, tok, TokenizeSpec(1000))
    assert full is not None and len(full.input_ids) == 28  # BOS + 26 bytes + EOS
    right, cut = tokenize_record(text, tok, TokenizeSpec(10, truncate="right"))
    assert cut and right == Example(full.input_ids[:10], full.labels[:10])
    left, cut = tokenize_record(text, tok, TokenizeSpec(10, truncate="left"))
    assert cut and left == Example(full.input_ids[-10:], full.labels[-10:])
    assert tok.decode(left.input_ids, skip_special_tokens=True) == "abcdefghijklmnopqrstuvwxyz"[-9:]
    short, cut = tokenize_record(text, tok, TokenizeSpec(28, truncate="drop"))
    assert not cut and short == full
    assert tokenize_record(text, tok, TokenizeSpec(27, truncate="drop")) == (None, True)


def test_left_truncation_of_a_conversation_keeps_the_last_answer() -> None:
    tok = chatml_tokenizer()
    r = _chat(0)
    full, _ = tokenize_record(r, tok, TokenizeSpec(4096))
    assert full is not None
    left, cut = tokenize_record(r, tok, TokenizeSpec(40, truncate="left"))
    assert cut and left is not None and len(left.input_ids) == 40
    tail = tok.decode(left.input_ids, skip_special_tokens=False)
    assert tail.endswith("You're welcome. #0<|im_end|>\n")
    assert left.labels == full.labels[-40:]
    # Kept from the start, the same 40 tokens hold no answer.
    with pytest.raises(DataError, match=r"chats\.jsonl:1: nothing to learn .*max_length=40"):
        tokenize_record(r, tok, TokenizeSpec(40, truncate="right"))
    right, _ = tokenize_record(r, tok, TokenizeSpec(120, truncate="right"))
    assert right is not None and right.input_ids == full.input_ids[:120]
    assert 0 < _labelled(right) < _labelled(full)


def test_nothing_to_learn_after_truncation_is_an_error_unless_dropping() -> None:
    tok = plain_tokenizer()
    long_prompt = Record("pairs.jsonl:7", prompt="x" * 50, completion=" y")
    with pytest.raises(DataError, match=r"pairs\.jsonl:7: nothing to learn .*data\.max_length=20"):
        tokenize_record(long_prompt, tok, TokenizeSpec(20))
    ok = Record("pairs.jsonl:8", prompt="p", completion=" y")
    examples, stats = tokenize_records(
        [ok, long_prompt, ok], tok, TokenizeSpec(20, truncate="drop")
    )
    assert len(examples) == 2 and stats.dropped == 1 and stats.samples == 2
    assert stats.kinds == {"pair": 3}
    # Left truncation keeps the completion of the same record.
    left, _ = tokenize_record(long_prompt, tok, TokenizeSpec(20, truncate="left"))
    assert left is not None and _labelled(left) == 3  # " y" and EOS


def test_drop_skips_samples_over_max_length_and_counts_them() -> None:
    tok = chatml_tokenizer()
    records = [
        Record("t.jsonl:1", text="short"),
        Record("t.jsonl:2", text="long " * 30),
        _chat(0),
        Record("p.jsonl:1", prompt="q", completion="a"),
    ]
    examples, stats = tokenize_records(records, tok, TokenizeSpec(120, truncate="drop"))
    assert len(examples) == 2
    assert stats == TokenizeStats(
        samples=2,
        truncated=0,
        dropped=2,
        tokens=sum(len(ex.input_ids) for ex in examples),
        label_tokens=sum(_labelled(ex) for ex in examples),
        kinds={"text": 2, "chat": 1, "pair": 1},
    )
    _, right = tokenize_records(records, tok, TokenizeSpec(120, truncate="right"))
    assert right.samples == 4 and right.truncated == 2 and right.dropped == 0


def _pool_workers(parent: psutil.Process | None = None) -> int:
    """The spawned pool workers of ``parent`` (this process by default), not its resource
    tracker, not servers."""
    children = (parent or psutil.Process()).children()
    return sum("spawn_main" in " ".join(child.cmdline()) for child in children)


def _small_chunks(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    """Many chunks from few records, and a pool for any number of them."""
    monkeypatch.setattr(tokenize_module, "CHUNK", chunk)
    monkeypatch.setattr(tokenize_module, "MIN_PARALLEL_RECORDS", 0)


def test_many_workers_give_the_same_examples_as_one(monkeypatch: pytest.MonkeyPatch) -> None:
    _small_chunks(monkeypatch, 16)
    tok = chatml_tokenizer()
    records: list[Record] = []
    for i, r in enumerate(_mixed_plain(60)):
        records.append(r)
        if i % 2 == 0:
            records.append(_chat(i))
    spec = TokenizeSpec(96, truncate="drop")
    one = tokenize_records(records, tok, spec, workers=1)
    two = tokenize_records(records, tok, spec, workers=2)
    assert len(records) > 5 * 16 and one[1].dropped > 0 and one[1].kinds["chat"] > 0
    assert two == one


def test_a_chunk_with_every_record_dropped_comes_back_empty(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _small_chunks(monkeypatch, 4)
    tok = chatml_tokenizer()
    records = [Record(f"t.jsonl:{i}", text="long " * 200) for i in range(4)]
    records += [Record(f"t.jsonl:{i}", text=f"short {i}") for i in range(4, 12)]
    spec = TokenizeSpec(64, truncate="drop")
    one = tokenize_records(records, tok, spec, workers=1)
    assert one[1].dropped == 4 and one[1].samples == 8
    assert tokenize_records(records, tok, spec, workers=2) == one


def test_a_bad_record_in_a_worker_fails_with_its_source(monkeypatch: pytest.MonkeyPatch) -> None:
    _small_chunks(monkeypatch, 4)
    tok = chatml_tokenizer()
    records = [_chat(i) for i in range(12)]
    records[9] = Record("chats.jsonl:10", messages=({"role": "user", "content": "no answer"},))
    with pytest.raises(DataError, match=r"chats\.jsonl:10: nothing to learn"):
        tokenize_records(records, tok, TokenizeSpec(4096), workers=2)


@pytest.mark.parametrize("workers", [1, 2])
def test_should_stop_interrupts_between_chunks(
    monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    _small_chunks(monkeypatch, 8)
    polls: list[int] = []

    def stop_on_third_poll() -> bool:
        polls.append(_pool_workers())
        return len(polls) >= 3

    records = _mixed_plain(40)
    with pytest.raises(InterruptedError, match="preempted while tokenizing"):
        tokenize_records(
            records,
            plain_tokenizer(),
            TokenizeSpec(64),
            workers=workers,
            should_stop=stop_on_third_poll,
        )
    assert len(polls) == 3
    assert max(polls) == (2 if workers == 2 else 0)


def test_a_small_dataset_is_tokenized_in_this_process() -> None:
    """Below MIN_PARALLEL_RECORDS a pool would cost more than it saves: no worker starts."""
    workers_seen: list[int] = []

    def count_workers() -> bool:
        workers_seen.append(_pool_workers())
        return False

    records = _mixed_plain(2000)
    chunks = -(-len(records) // tokenize_module.CHUNK)
    assert chunks > 1 and len(records) < tokenize_module.MIN_PARALLEL_RECORDS
    many = tokenize_records(
        records, plain_tokenizer(), TokenizeSpec(64), workers=4, should_stop=count_workers
    )
    assert many == tokenize_records(records, plain_tokenizer(), TokenizeSpec(64))
    assert len(workers_seen) == chunks + 1 and max(workers_seen) == 0


def test_progress_bar_goes_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    records: list[Any] = _mixed_plain(20)
    tokenize_records(records, plain_tokenizer(), TokenizeSpec(64), progress=True)
    captured = capsys.readouterr()
    assert "tokenizing" in captured.err and str(len(records)) in captured.err
    assert captured.out == ""
    tokenize_records(records, plain_tokenizer(), TokenizeSpec(64))
    assert capsys.readouterr().err == ""
    assert sys.stderr is not None


def test_tokenizer_workers_die_with_a_killed_parent(tmp_path: Path) -> None:
    """A SIGKILLed trainer must not leave forked tokenizer workers behind: they would hold
    the run directory's and the data cache's locks it inherited."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from chat_fixtures import chatml_tokenizer\n"
        "from shoestring.data.records import Record\n"
        "from shoestring.data.tokenize import TokenizeSpec, tokenize_records\n"
        "recs = [Record(f'r:{i}', text='word ' * 200) for i in range(400_000)]\n"
        "print('start', flush=True)\n"
        "tokenize_records(recs, chatml_tokenizer(), TokenizeSpec(64), workers=2)\n"
    )
    tests = str(Path(__file__).parent)
    p = subprocess.Popen([sys.executable, "-c", code, tests], stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == b"start"
        parent = psutil.Process(p.pid)
        deadline = time.monotonic() + 60
        while len(parent.children()) < 2:
            assert time.monotonic() < deadline, "no workers started"
            time.sleep(0.05)
        workers = parent.children()
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, f"workers outlived their parent: {[w.pid for w in alive]}"


def test_a_notice_to_the_whole_job_stops_tokenizing_cleanly(tmp_path: Path) -> None:
    """Slurm signals every process of a job step, a terminal every process of its group:
    the workers, even while they start, leave the notice to the trainer, which stops
    between chunks; a worker that died of it would break the pool instead."""
    import os
    import signal
    import subprocess
    import time

    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from chat_fixtures import chatml_tokenizer\n"
        "from shoestring.data import tokenize as T\n"
        "from shoestring.data.records import Record\n"
        "from shoestring.preempt.flag import PreemptionFlag, SignalSource\n"
        "T.MIN_PARALLEL_RECORDS = 0\n"
        "recs = [Record(f'r:{i}', text='word ' * 200) for i in range(100_000)]\n"
        "flag = PreemptionFlag()\n"
        "with SignalSource(flag):\n"
        "    print('start', flush=True)\n"
        "    try:\n"
        "        T.tokenize_records(recs, chatml_tokenizer(), T.TokenizeSpec(64), workers=2,\n"
        "                           should_stop=flag.is_set)\n"
        "    except InterruptedError as e:\n"
        "        print('stopped:', e, flag.reason, flush=True)\n"
    )
    tests = str(Path(__file__).parent)
    p = subprocess.Popen(
        [sys.executable, "-c", code, tests], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == b"start"
        parent = psutil.Process(p.pid)
        deadline = time.monotonic() + 60
        while _pool_workers(parent) < 2:
            assert time.monotonic() < deadline, "no workers started"
            time.sleep(0.02)
        os.killpg(p.pid, signal.SIGTERM)  # the workers are still importing
        out, _ = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 0, out
    assert out.decode().strip() == "stopped: preempted while tokenizing SIGTERM"
