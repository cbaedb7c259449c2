"""Conversations end to end: a chat-template model, messages data, packing and the
tokenized cache through `shoestring finetune` — exact resume after SIGKILL, a cache hit on
restart, a fresh machine that gets data and cache from the bucket, and bad data refused
before anything is written."""

from __future__ import annotations

import json
import shutil
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest

from chat_fixtures import chatml_tokenizer, save_tokenizer
from conftest import CLI, FAST, read_events, state_digest
from shoestring import exitcodes
from shoestring.train.builtin import builtin_records, materialize_tiny_model

pytestmark = pytest.mark.e2e


def _conversations(marker: str) -> list[dict[str, Any]]:
    """The bundled reversal task as chats; ``marker`` makes the content (and key) unique."""
    rows = builtin_records("train")[:160]
    return [
        {
            "messages": [
                {"role": "system", "content": f"Reverse the words. {marker}"},
                {"role": "user", "content": r["prompt"]},
                {"role": "assistant", "content": r["completion"]},
            ]
        }
        for r in rows
    ]


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def chat_model(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny model with a ChatML tokenizer (its ids fit the padded vocab)."""
    src = materialize_tiny_model(cache_dir)
    dst = tmp_path_factory.mktemp("chat-model") / "tiny-chatml"
    shutil.copytree(src, dst)
    for f in dst.glob("tokenizer*"):
        f.unlink()
    save_tokenizer(chatml_tokenizer(), dst)
    return dst


def _args(model: Path, data: Path | str, *extra: str) -> list[str]:
    return [
        *FAST,
        "--model.path",
        str(model),
        "--data.train",
        str(data),
        "--data.packing",
        "--data.max_length",
        "256",
        *extra,
    ]


def _data_event(out: Path, nth: int = -1) -> dict[str, Any]:
    return [e for e in read_events(out) if e["event"] == "data"][nth]


def test_messages_packed_cached_sigkill_resume_is_bit_exact(
    cli: CLI, chat_model: Path, tmp_path: Path
) -> None:
    data = _write_jsonl(tmp_path / "chats.jsonl", _conversations(uuid.uuid4().hex))
    args = _args(chat_model, data)
    ref = tmp_path / "ref"
    r = cli.run(ref, *args)
    assert r.returncode == 0, r.stderr
    ev = _data_event(ref)
    assert ev["cache"] == "built" and ev["formats"] == {str(data): "messages"}
    assert ev["rows"] < ev["samples"]  # packed: several chats per row
    out = tmp_path / "run"
    # Killed right after the step-4 checkpoint commits (a kill at a step end could come
    # before a save on a loaded machine had committed, and the rerun would start over).
    r = cli.run(out, *args, env={"SHOESTRING_FAULTS": "ckpt.after_rename@1:kill"})
    assert r.returncode == -signal.SIGKILL
    assert _data_event(out)["cache"] == "hit"  # the second start tokenizes nothing
    r = cli.run(out, *args)
    assert r.returncode == 0, r.stderr
    assert [e["from_step"] for e in read_events(out) if e["event"] == "resume"] == [4]
    assert _data_event(out)["cache"] == "hit"
    assert state_digest(out, 12) == state_digest(ref, 12)


@pytest.mark.slow  # cache keys per option: tests/test_token_cache.py (CI time)
def test_changed_max_length_or_template_rebuilds_the_cache(
    cli: CLI, chat_model: Path, tmp_path: Path
) -> None:
    data = _write_jsonl(tmp_path / "chats.jsonl", _conversations(uuid.uuid4().hex))
    short = ["--train.max_steps", "1", "--checkpoint.every_steps", "0"]
    first = cli.run(tmp_path / "a", *_args(chat_model, data), *short)
    assert first.returncode == 0, first.stderr
    again = cli.run(tmp_path / "b", *_args(chat_model, data), *short)
    assert again.returncode == 0, again.stderr
    assert _data_event(tmp_path / "b")["cache"] == "hit"
    longer = cli.run(tmp_path / "c", *_args(chat_model, data, "--data.max_length", "128"), *short)
    assert longer.returncode == 0, longer.stderr
    assert _data_event(tmp_path / "c")["cache"] == "built"
    template = tmp_path / "template.jinja"
    template.write_text(chatml_tokenizer().chat_template.replace("<|im_start|>", "<|im_start|> "))
    other = cli.run(
        tmp_path / "d", *_args(chat_model, data, "--data.chat_template", str(template)), *short
    )
    assert other.returncode == 0, other.stderr
    assert _data_event(tmp_path / "d")["cache"] == "built"
    keys = {_data_event(tmp_path / n)["cache_key"] for n in "abcd"}
    assert len(keys) == 3


_SHAREGPT_OK = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}
_ALPACA_OK = {"instruction": "reverse", "input": "a b", "output": "b a"}


@pytest.mark.parametrize(
    "good,row,message",
    [
        (
            None,
            {"messages": [{"role": "asistant", "content": "hi"}]},
            "message 1: unknown role 'asistant'",
        ),
        (_SHAREGPT_OK, {"conversations": [{"from": "robot", "value": "x"}]}, "robot"),
        (_ALPACA_OK, {"instruction": "x"}, "output"),
        (None, {"messages": "hello"}, "messages"),
        (None, {"text": "a plain row among chats"}, "one format per file"),
    ],
)
def test_malformed_data_exits_2_before_anything_is_written(
    cli: CLI,
    chat_model: Path,
    tmp_path: Path,
    good: dict[str, Any] | None,
    row: dict[str, Any],
    message: str,
) -> None:
    rows = _conversations("ok")[:3] if good is None else [good] * 3
    data = _write_jsonl(tmp_path / "bad.jsonl", [*rows, row])
    out = tmp_path / "run"
    r = cli.run(out, *_args(chat_model, data, "--data.format", "auto"))
    assert r.returncode == exitcodes.USAGE, r.stderr
    assert f"{data}:4" in r.stderr and message in r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists()


# Its parts are CI's elsewhere: the data cache published to and read back from the bucket
# (tests/test_token_cache.py, real S3), a fresh machine resuming from checkpoint storage
# (tests/test_launch.py) (CI time).
@pytest.mark.slow
def test_fresh_machine_gets_data_and_cache_from_the_bucket(
    cli: CLI, chat_model: Path, tmp_path: Path, s3_server: Any
) -> None:
    prefix = f"data-e2e-{uuid.uuid4().hex[:8]}"
    body = "".join(json.dumps(r) + "\n" for r in _conversations(prefix))
    s3_server.client().put_object(
        Bucket=s3_server.bucket, Key=f"{prefix}/chats.jsonl", Body=body.encode()
    )
    url = s3_server.url(f"{prefix}/chats.jsonl")
    storage = ["--checkpoint.storage", s3_server.url(f"{prefix}/ckpt")]
    args = _args(chat_model, url, *storage)
    env = s3_server.env
    ref = tmp_path / "ref"
    r = cli.run(ref, *_args(chat_model, url), env=env)
    assert r.returncode == 0, r.stderr
    first = tmp_path / "vm1"
    # Killed at the end of step 7, once the step-4 save (local commit, then the upload)
    # finished: a plain kill there could land mid-upload on a loaded machine.
    r = cli.run(first, *args, env={**env, "SHOESTRING_FAULTS": "step.end@7:kill:saved"})
    assert r.returncode == -signal.SIGKILL
    keys = s3_server.list_keys(f"{prefix}/ckpt/data-cache/")
    assert any(k.endswith("/manifest.json") for k in keys)
    # A new VM: empty output dir and an empty cache except the model.
    fresh = CLI(tmp_path / "empty-cache")
    second = tmp_path / "vm2"
    r = fresh.run(second, *args, env=env)
    assert r.returncode == 0, r.stderr
    assert _data_event(second)["cache"] == "remote_hit"
    assert [e["from_step"] for e in read_events(second) if e["event"] == "resume"] == [4]
    assert state_digest(second, 12) == state_digest(ref, 12)
