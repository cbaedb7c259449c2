"""Bad input to `shoestring finetune` is exit 2 with one line naming the path, the key or
the line, before any weights load (issue 19, item 10): a run directory it cannot write
into, a data file that is not UTF-8, a `--resume PATH` that is not a valid checkpoint of
this run, a checkpoint of another base model or config. And a record far longer than
`data.max_length` is tokenized in bounded memory, to the same ids.

"Before any weights load" is proven in process: the base model's loader is replaced by
one that fails the test, so a check that still came after it would not give exit 2.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import shoestring.data.tokenize as tokenize_module
from chat_fixtures import CHATML_SPECIALS, CHATML_TEMPLATE, chatml_tokenizer, plain_tokenizer
from conftest import CLI, FAST
from shoestring import exitcodes
from shoestring.data.records import DataError, Record
from shoestring.data.tokenize import TokenizeSpec, tokenize_records
from shoestring.train.builtin import materialize_tiny_model

#: Four steps, one checkpoint (step 4).
SHORT = [*FAST, "--train.max_steps", "4"]


class WeightsLoaded(AssertionError):
    """Raised by the stand-in loader: the check under test came too late."""


@pytest.fixture
def finetune(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> Any:
    """``finetune(out, *args) -> (exit code, stderr)`` in this process, with loading the
    base model's weights an error."""
    import shoestring.train.baseload as baseload

    def no_weights(*_a: Any, **_k: Any) -> Any:
        raise WeightsLoaded("the base model's weights were loaded before the check")

    # Every way the trainer loads a base: read (and quantized), or the cached 4-bit copy.
    monkeypatch.setattr(baseload, "load_base_model", no_weights)
    monkeypatch.setattr(baseload, "load_prequantized", no_weights)
    monkeypatch.setenv("SHOESTRING_CACHE", str(cache_dir))
    monkeypatch.delenv("SHOESTRING_FAULTS", raising=False)

    def run(out: Path, *args: str) -> tuple[int, str]:
        from shoestring.cli import main

        capsys.readouterr()
        code = main(["finetune", "--output_dir", str(out), *args])
        return code, capsys.readouterr().err

    return run


def _refused(result: tuple[int, str], *needles: str) -> str:
    code, err = result
    assert code == exitcodes.USAGE, err[-3000:]
    assert "Traceback" not in err and "WeightsLoaded" not in err, err[-3000:]
    line = next(x for x in err.splitlines() if "shoestring finetune: error:" in x)
    for needle in needles:
        assert needle in line, line
    return line


# --------------------------------------------------------------------------- read-only


def _mount_read_only(path: Path) -> bool:
    """Bind-mount ``path`` (a folder or a file) read-only on itself; False if impossible."""
    if shutil.which("mount") is None:
        return False
    bind = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True)
    if bind.returncode != 0:
        return False
    ro = subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], capture_output=True)
    if ro.returncode != 0:
        subprocess.run(["umount", str(path)], capture_output=True)
        return False
    return True


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """``path`` not writable by this process: a read-only bind mount as root (root
    ignores permission bits), else no write permission."""
    if os.geteuid() == 0:
        if not _mount_read_only(path):
            pytest.skip("needs mount --bind (root in a container without CAP_SYS_ADMIN?)")
        try:
            yield
        finally:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
        return
    mode = path.stat().st_mode
    path.chmod(mode & ~0o222)
    try:
        yield
    finally:
        path.chmod(mode)


@pytest.mark.parametrize("where", ["checkpoints", "events.jsonl", "ranks/rank1"])
def test_a_run_directory_it_cannot_write_into_is_exit_2_at_the_start(
    finetune: Any, tmp_path: Path, where: str
) -> None:
    """A previous run's directory with a folder (or event log) the job cannot write:
    refused at the start naming it (it failed at the first save, after training)."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "ranks" / "rank1").mkdir(parents=True)
    (out / "events.jsonl").write_text("")
    (out / "ranks" / "rank1" / "events.jsonl").write_text("")
    with read_only(out / where):
        line = _refused(finetune(out, *SHORT), f"{out / where}: cannot ")
    assert "the run directory must be writable" in line


def test_a_read_only_run_directory_is_exit_2_at_the_start(finetune: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").write_text("")  # a previous run's lock file: writable, the folder not
    if os.geteuid() != 0:
        (out / ".lock").chmod(0o666)
    with read_only(out):
        _refused(finetune(out, *SHORT), f"{out}: cannot be")


def test_an_empty_cache_folder_it_cannot_write_is_exit_2_at_the_start(
    finetune: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SHOESTRING_CACHE on a read-only mount with nothing in it: the run would fail at
    its first write (the built-in model, the tokenized data); refused before loading."""
    cache = tmp_path / "cache"
    cache.mkdir()
    with read_only(cache):
        monkeypatch.setenv("SHOESTRING_CACHE", str(cache))
        _refused(finetune(tmp_path / "run", *SHORT), f"SHOESTRING_CACHE={cache}: cannot write")


@pytest.mark.slow  # a resume as in test_an_unchanged_resume_still_loads, cache read-only
def test_a_filled_read_only_cache_is_used_as_it_is(cli: CLI, trained: Path, tmp_path: Path) -> None:
    """A shared cache already holding the model and the tokenized data, mounted read-only:
    the run uses it (a warning says nothing new can be kept there)."""
    out = _copy(trained, tmp_path / "run")
    with read_only(cli.cache):
        r = cli.run(out, *SHORT, "--train.max_steps", "5")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"SHOESTRING_CACHE={cli.cache} cannot be written" in r.stderr


# --------------------------------------------------------------------------- not UTF-8

GOOD = {"prompt": "Reverse the word: abc", "completion": " cba"}


def _with_bad_byte(path: Path, bad_line: int, lines: int = 3000) -> Path:
    """``lines`` JSON records; line ``bad_line`` holds a Latin-1 byte (not UTF-8)."""
    rows = [json.dumps(GOOD).encode() for _ in range(lines)]
    rows[bad_line - 1] = b'{"prompt": "caf\xe9 au lait", "completion": " tial ua \xe9fac"}'
    path.write_bytes(b"\n".join(rows) + b"\n")
    return path


@pytest.mark.parametrize("split", ["train", "eval"])
def test_a_jsonl_file_that_is_not_utf8_names_its_line(
    finetune: Any, tmp_path: Path, split: str
) -> None:
    """The text reader decodes ahead in 8 KB blocks: the line it was at is not the line
    of the bad byte (it said line 2402 for line 2500)."""
    bad = _with_bad_byte(tmp_path / "data.jsonl", 2500)
    key = "--data.train" if split == "train" else "--data.eval"
    args = [*SHORT, key, str(bad)]
    if split == "eval":
        good = tmp_path / "good.jsonl"
        good.write_text((json.dumps(GOOD) + "\n") * 50)
        args += ["--data.train", str(good)]
    _refused(finetune(tmp_path / "run", *args), f"{bad}:2500: not UTF-8 text", "at byte ")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("suffix", [".json", ".csv", ".jsonl.gz"])
def test_other_data_files_that_are_not_utf8_name_their_line(
    finetune: Any, tmp_path: Path, suffix: str
) -> None:
    """A .json array and a .csv were a UnicodeDecodeError traceback (exit 1)."""
    import gzip

    text = {
        ".json": b'[\n{"text": "one"},\n{"text": "caf\xe9"}\n]\n',
        ".csv": b"text\none\ncaf\xe9\n",
        ".jsonl.gz": gzip.compress(b'{"text": "one"}\n{"text": "two"}\n{"text": "caf\xe9"}\n'),
    }[suffix]
    bad = tmp_path / f"data{suffix}"
    bad.write_bytes(text)
    line = 3
    _refused(finetune(tmp_path / "run", *SHORT, "--data.train", str(bad)), f"{bad}:{line}: ")


def test_a_chat_template_file_that_is_not_utf8_names_its_line(tmp_path: Path) -> None:
    from shoestring.data.chat import load_template

    bad = tmp_path / "template.jinja"
    bad.write_bytes(b"{% for m in messages %}\n{{ m.content }} caf\xe9\n{% endfor %}\n")
    with pytest.raises(DataError, match=f"{bad}:2: data.chat_template is not UTF-8 text"):
        load_template(str(bad))


# --------------------------------------------------------------------------- resume


@pytest.fixture(scope="module")
def trained(cli: CLI, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of the built-in model with a committed checkpoint at step 4."""
    out = tmp_path_factory.mktemp("trained") / "run"
    r = cli.run(out, *SHORT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "checkpoints" / "step-00000004" / "manifest.json").is_file()
    return out


def _step(run: Path) -> Path:
    return run / "checkpoints" / "step-00000004"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _damage(ck: Path, how: str) -> None:
    if how == "no_manifest":
        (ck / "manifest.json").unlink()
    elif how == "torn_manifest":
        text = (ck / "manifest.json").read_bytes()
        (ck / "manifest.json").write_bytes(text[: len(text) // 2])
    elif how == "corrupt_file":
        data = bytearray((ck / "adapter.safetensors").read_bytes())
        data[-10] ^= 0xFF
        (ck / "adapter.safetensors").write_bytes(bytes(data))
    elif how == "torn_state":  # torn, yet listed so in the manifest: it verifies
        torn = b'{"progress": '
        (ck / "trainer_state.json").write_bytes(torn)
        manifest = json.loads((ck / "manifest.json").read_text())
        entry = manifest["files"]["trainer_state.json"]
        entry.update(size=len(torn), sha256=hashlib.sha256(torn).hexdigest())
        (ck / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("how", "says"),
    [
        ("no_manifest", "no manifest.json"),
        ("torn_manifest", "unreadable manifest"),
        ("corrupt_file", "adapter.safetensors: sha256 mismatch"),
        ("torn_state", "unreadable trainer state"),
    ],
)
def test_resume_path_that_is_not_a_valid_checkpoint_is_exit_2_before_loading(
    finetune: Any, trained: Path, tmp_path: Path, how: str, says: str
) -> None:
    """Was a CorruptCheckpoint traceback (exit 1) after the model had loaded."""
    ck = _copy(_step(trained), tmp_path / "ck")
    _damage(ck, how)
    out = tmp_path / "run"
    _refused(
        finetune(out, *SHORT, "--resume", str(ck)),
        f"--resume {ck}: not a valid checkpoint: ",
        says,
    )
    assert not out.exists()  # nothing written


def test_resume_path_that_does_not_exist_is_exit_2(finetune: Any, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    _refused(finetune(tmp_path / "run", *SHORT, "--resume", str(missing)), str(missing))


def test_resume_path_of_a_run_with_another_config_is_exit_2_before_loading(
    finetune: Any, trained: Path, tmp_path: Path
) -> None:
    ck = _step(trained)
    _refused(
        finetune(tmp_path / "run", *SHORT, "--resume", str(ck), "--lora.r", "8"),
        f"cannot resume from {ck}: the config changed",
        "lora.r: 16 -> 8",
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--lora.r", "8"), "lora.r: 16 -> 8"),
        (("--train.seed", "7"), "train.seed: 0 -> 7"),
        (("--data.max_length", "48"), "data.max_length: 32 -> 48"),
    ],
)
def test_a_changed_config_on_resume_is_refused_before_loading(
    finetune: Any, trained: Path, tmp_path: Path, args: tuple[str, ...], says: str
) -> None:
    """``--resume auto`` over the run's own checkpoints: refused before the weights load
    (it came after them) and before config.yaml is rewritten with the refused config."""
    out = _copy(trained, tmp_path / "run")
    before = (out / "config.yaml").read_bytes()
    line = _refused(
        finetune(out, *[*SHORT, "--train.max_steps", "8"], *args),
        f"cannot resume from {_step(out)}: the config changed",
    )
    assert says.split(":")[0] in line
    assert (out / "config.yaml").read_bytes() == before


def test_a_checkpoint_of_another_base_model_is_refused_before_loading(
    finetune: Any, trained: Path, cache_dir: Path, tmp_path: Path
) -> None:
    model = _copy(materialize_tiny_model(cache_dir), tmp_path / "other-model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rope_theta": 20000.0}))
    out = _copy(trained, tmp_path / "run")
    _refused(
        finetune(out, *SHORT, "--train.max_steps", "8", "--model.path", str(model)),
        f"cannot resume from {_step(out)}: model.path {model} is not the base model",
    )


def test_a_changed_config_is_refused_before_loading_from_checkpoint_storage(
    finetune: Any, trained: Path, tmp_path: Path
) -> None:
    """A fresh machine: no local checkpoint, the newest is in checkpoint.storage; its two
    JSON files are read (nothing is fetched) and the resume is refused."""
    storage = tmp_path / "bucket"
    _copy(_step(trained), storage / "step-00000004")
    out = tmp_path / "run"
    _refused(
        finetune(
            out,
            *SHORT,
            "--train.max_steps",
            "8",
            "--checkpoint.storage",
            str(storage),
            "--lora.r",
            "8",
        ),
        f"cannot resume from {storage}/step-00000004: the config changed",
        "lora.r: 16 -> 8",
    )
    assert not (out / "checkpoints" / "step-00000004").exists()


def test_an_unchanged_resume_still_loads(cli: CLI, trained: Path, tmp_path: Path) -> None:
    """The early checks pass a good resume (keys that may change on resume changed)."""
    out = _copy(trained, tmp_path / "run")
    r = cli.run(out, *SHORT, "--train.max_steps", "8", "--checkpoint.keep", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step 4" in r.stderr


# --------------------------------------------------------------------------- long records


def _bpe_tokenizer(use_regex: bool) -> Any:
    """A small trained byte-level BPE (with merges, unlike the built-in one), with the
    ChatML template; ``use_regex=False``: the whole text is one pre-token, so merges
    could reach across any distance."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(3)
    words = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 7))) for _ in range(300)]
    corpus = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(200)]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(CHATML_SPECIALS),
    )
    tk.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


def _long_records(n_chars: int) -> list[Record]:
    rng = random.Random(11)

    def text(n: int) -> str:
        out = []
        while sum(map(len, out)) < n:
            out.append("".join(rng.choice("abcdefgh é") for _ in range(rng.randint(1, 9))))
        return " ".join(out)[:n]

    return [
        Record("t.jsonl:1", text=text(n_chars)),
        Record("t.jsonl:2", prompt=text(n_chars), completion=text(50)),
        Record("t.jsonl:3", prompt=text(40), completion=text(n_chars)),
        Record("t.jsonl:4", text=text(30)),
        Record(
            "c.jsonl:1",
            messages=(
                {"role": "user", "content": text(30)},
                {"role": "assistant", "content": text(n_chars)},
            ),
        ),
        Record(
            "c.jsonl:2",
            messages=(
                {"role": "user", "content": text(n_chars)},
                {"role": "assistant", "content": text(40)},
            ),
        ),
    ]


@pytest.mark.parametrize("tokenizer", ["bpe_regex", "bpe_one_word", "bytes"])
@pytest.mark.parametrize("truncate", ["right", "left", "drop"])
def test_a_long_record_is_tokenized_in_a_cut_to_the_same_examples(
    monkeypatch: pytest.MonkeyPatch, tokenizer: str, truncate: str
) -> None:
    """Records 80x longer than ``max_length`` (also a prompt whose truncation leaves
    nothing to learn, which ``drop`` drops and the others refuse the same way): the
    tokenizer never sees more than a bounded cut, and the examples and stats are those of
    tokenizing every record whole."""
    tok = {
        "bpe_regex": lambda: _bpe_tokenizer(True),
        "bpe_one_word": lambda: _bpe_tokenizer(False),
        "bytes": chatml_tokenizer,
    }[tokenizer]()
    spec = TokenizeSpec(256, truncate=truncate)  # type: ignore[arg-type]
    records = _long_records(20_000)
    records = [r for r in records if truncate != "right" or r.source != "t.jsonl:2"]
    if truncate == "right":  # the long prompt leaves nothing to learn: an error either way
        records = [r for r in records if r.source != "c.jsonl:2"]

    seen: list[int] = []

    def spying(real: Any) -> Any:
        def spy(t: Any, texts: list[str]) -> Any:
            seen.extend(len(x) for x in texts)
            return real(t, texts)

        return spy

    monkeypatch.setattr(tokenize_module, "encode_many", spying(tokenize_module.encode_many))
    monkeypatch.setattr(
        tokenize_module, "encode_with_offsets", spying(tokenize_module.encode_with_offsets)
    )
    cut = tokenize_records(records, tok, spec)
    first_cut = tokenize_module.CHARS_PER_TOKEN * (256 + tokenize_module.SLACK)
    assert max(seen) <= 2 * first_cut < 20_000
    monkeypatch.setattr(tokenize_module, "CHARS_PER_TOKEN", 10**9)  # never cut
    whole = tokenize_records(records, tok, spec)
    assert max(seen) > 20_000
    assert cut[0] == whole[0] and vars(cut[1]) == vars(whole[1])
    assert cut[1].truncated + cut[1].dropped >= 3


def test_records_under_the_bound_are_tokenized_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing changes for records that are not far over ``max_length``: every piece of
    the chunk goes to the tokenizer whole, in one batch."""
    tok = plain_tokenizer()
    calls: list[list[str]] = []
    real = tokenize_module.encode_many

    def spy(t: Any, texts: list[str]) -> list[list[int]]:
        calls.append(list(texts))
        return real(t, texts)

    monkeypatch.setattr(tokenize_module, "encode_many", spy)
    limit = tokenize_module.CHARS_PER_TOKEN * (16 + tokenize_module.SLACK)
    records = [Record(f"r:{i}", text="x" * n) for i, n in enumerate([1, 100, limit])]
    tokenize_records(records, tok, TokenizeSpec(16))
    assert calls == [["x", "x" * 100, "x" * limit]]


RSS_SCRIPT = """
import json, resource, sys
from pathlib import Path
from shoestring.data.sources import read_records, resolve_source
from shoestring.data.tokenize import TokenizeSpec, tokenize_records
from shoestring.train.builtin import model_tokenizer

path = Path(sys.argv[1])
tok = model_tokenizer()
records, _ = read_records(resolve_source(str(path), path.parent / "c"), "auto")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
examples, stats = tokenize_records(records, tok, TokenizeSpec(2048))
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"grew_mb": (after - before) / 1024, "lengths": [len(e.input_ids) for e in examples]}))
"""


def test_one_long_jsonl_line_is_tokenized_in_bounded_memory(tmp_path: Path) -> None:
    """One 8 MB line with the built-in (byte) tokenizer: the peak grew by ~1.6 GB while
    tokenizing it whole (9.8 GB for 50 MB); now by next to nothing."""
    word = "naïve café reverse this "
    big = (word * (8_000_000 // len(word) + 1))[:8_000_000]
    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": big}) + "\n")
    import shoestring

    src = str(Path(shoestring.__file__).parents[1])  # the code under test, in the child too
    env = {**os.environ, "PYTHONPATH": src, "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["lengths"] == [7, 2048]
    assert result["grew_mb"] < 100, result


# --------------------------------------------------------------------------- full disk


@contextlib.contextmanager
def small_filesystem(where: Path, size_mb: int) -> Iterator[Path]:
    """A tmpfs of ``size_mb`` mounted at ``where`` (root only: a real full disk)."""
    where.mkdir(parents=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs (a real full disk)")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(where)])
    if r.returncode != 0:
        pytest.skip("mount -t tmpfs refused (a container without CAP_SYS_ADMIN?)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _fill(fs: Path) -> Path:
    """Fill ``fs`` to its last byte; the ballast file, to delete to free the space."""
    ballast = fs / "ballast"
    with open(ballast, "wb", buffering=0) as f:
        for chunk in (65536, 1):
            with contextlib.suppress(OSError):
                while f.write(b"\0" * chunk):
                    pass
    return ballast


def test_a_restart_on_a_full_disk_is_one_clear_line_and_the_rerun_after_freeing_goes_on(
    cli: CLI, trained: Path, tmp_path: Path
) -> None:
    """Restarting a run whose disk is already full: one line naming the path and what to
    do (no traceback), the committed checkpoint untouched; once space is freed, the same
    command resumes from it and finishes."""
    with small_filesystem(tmp_path / "fs", 32) as fs:
        out = _copy(trained, fs / "run")
        before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in _step(out).iterdir()}
        ballast = _fill(fs)
        more = [*SHORT, "--train.max_steps", "6"]
        r = cli.run(out, *more)
        assert r.returncode == exitcodes.FAILED, r.stderr[-3000:]
        assert "Traceback" not in r.stderr, r.stderr[-3000:]
        line = r.stderr.strip().splitlines()[-1]
        assert line.startswith("shoestring finetune: error: no space left on device: "), line
        assert f"cannot write {out}" in line and "rerun the same command" in line, line
        after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in _step(out).iterdir()}
        assert after == before
        ballast.unlink()
        r = cli.run(out, *more)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "resumed from step 4" in r.stderr
        assert (out / "checkpoints" / "step-00000006" / "manifest.json").is_file() or (
            out / "final" / "adapter_model.safetensors"
        ).is_file()


# --------------------------------------------------------------------------- MoE base


def test_an_moe_base_refuses_dropout_before_loading(finetune: Any, tmp_path: Path) -> None:
    """A mixture-of-experts base (Qwen3-MoE, stored a tensor per expert as on the Hub):
    peft adapts its fused experts as parameters, which take no dropout: one line naming
    the key, before the weights load and before the run directory is made."""
    from shoestring.infer.fixtures import build_random_model

    moe = build_random_model(tmp_path / "moe", "qwen3_moe", num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=64)  # fmt: skip
    base = [*SHORT, "--model.path", str(moe)]
    line = _refused(finetune(tmp_path / "a", *base), "lora.dropout: 0.05", "fused")
    assert "set lora.dropout 0" in line and "lora.target_modules [q_proj" in line
    assert not (tmp_path / "a").exists()


def test_a_base_stored_quantized_another_way_than_bitsandbytes_is_refused_before_loading(
    finetune: Any, tmp_path: Path
) -> None:
    """FP8 (the Hub's ``*-FP8`` repos, DeepSeek-V3) or GPTQ: finetune trains LoRA on
    16/32-bit bases and bitsandbytes-stored ones; any other stored quantization is one
    line naming the method, before the weights load and the run directory is made."""
    from shoestring.infer.fixtures import build_random_model, save_fp8

    base = build_random_model(tmp_path / "base", "llama")
    fp8 = save_fp8(base, tmp_path / "fp8", (64, 64))
    line = _refused(finetune(tmp_path / "a", *SHORT, "--model.path", str(fp8)), "model.path:")
    assert "stored quantized by fp8" in line and "16-bit original" in line
    assert not (tmp_path / "a").exists()
