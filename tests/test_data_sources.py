"""Data sources: local files of every kind, shard folders, saved datasets, fsspec URLs, the
Hub (offline), the content digest that keys the tokenized cache, and the eval split."""

from __future__ import annotations

import gzip
import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shoestring.data import sources
from shoestring.data.records import DataError, Format, Record
from shoestring.data.sources import Source, read_records, resolve_source, split_eval

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def texts(records: list[Record]) -> list[str | None]:
    return [r.text for r in records]


def load(
    spec: str | Path, cache: Path, fmt: Format = "auto", **kw: Any
) -> tuple[Source, list[Record], dict[str, str]]:
    source = resolve_source(str(spec), cache, **kw)
    records, formats = read_records(source, fmt)
    return source, records, dict(formats)


# ---------------------------------------------------------------------------- local files


def test_jsonl_file(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "t.jsonl", [{"text": "a"}, {"text": "b"}])
    source, records, formats = load(p, tmp_path / "cache")
    assert (source.kind, source.files, source.split) == ("jsonl", (str(p),), "train")
    assert re.fullmatch(r"[0-9a-f]{64}", source.digest)
    assert texts(records) == ["a", "b"]
    assert [r.source for r in records] == [f"{p}:1", f"{p}:2"]
    assert formats == {str(p): "text"}


def test_jsonl_gz_and_blank_lines(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl.gz"
    with gzip.open(p, "wt") as f:
        f.write('{"text": "a"}\n\n{"messages": [{"role": "user", "content": "c"}]}\n')
    with pytest.raises(DataError, match=re.escape(f"{p}:3: a messages record, but")):
        load(p, tmp_path / "cache")
    p.write_bytes(gzip.compress(b'\n{"text": "a"}\n\n{"text": "b"}\n'))
    source, records, _ = load(p, tmp_path / "cache")
    assert source.kind == "jsonl"
    assert [r.source for r in records] == [f"{p}:2", f"{p}:4"]


def test_json_array_file(tmp_path: Path) -> None:
    p = tmp_path / "t.json"
    p.write_text(json.dumps([{"messages": CHAT}, {"messages": CHAT}]))
    source, records, formats = load(p, tmp_path / "cache")
    assert source.kind == "json" and formats == {str(p): "messages"}
    assert [r.source for r in records] == [f"{p}:item 1", f"{p}:item 2"]
    assert records[0].messages == tuple(CHAT)
    p.write_text(json.dumps([{"messages": CHAT}, {"messages": [{"role": "bot", "content": "x"}]}]))
    with pytest.raises(DataError, match=re.escape(f"{p}:item 2: message 1: unknown role 'bot'")):
        load(p, tmp_path / "cache")
    p.write_text(json.dumps({"data": [{"text": "a"}]}))
    with pytest.raises(
        DataError, match=re.escape(f"{p}: expected a JSON array of records, got dict")
    ):
        load(p, tmp_path / "cache")
    p.write_text('[{"text": "a"},\n {"text": }]')
    with pytest.raises(DataError, match=re.escape(f"{p}:2: invalid JSON: Expecting value")):
        load(p, tmp_path / "cache")


def test_json_lines_in_a_json_file(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "t.json", [{"text": "a"}, {"text": "b"}])
    _, records, _ = load(p, tmp_path / "cache")
    assert texts(records) == ["a", "b"] and records[1].source == f"{p}:2"


def test_parquet_messages_column_of_structs(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "t.parquet"
    rows: list[dict[str, Any]] = [
        {"messages": CHAT, "id": 1},
        {
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "id": 2,
        },
    ]
    pq.write_table(pa.Table.from_pylist(rows), p)
    source, records, formats = load(p, tmp_path / "cache")
    assert source.kind == "parquet" and formats == {str(p): "messages"}
    assert records[1].source == f"{p}:row 2"
    assert records[1].messages == (
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    )
    rows[1]["messages"][0]["role"] = "narrator"
    pq.write_table(pa.Table.from_pylist(rows), p)
    with pytest.raises(
        DataError, match=re.escape(f"{p}:row 2: message 1: unknown role 'narrator'")
    ):
        load(p, tmp_path / "cache")
    p.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=re.escape(f"{p}: not a readable Parquet file")):
        load(p, tmp_path / "cache")


def test_csv_alpaca_rows(tmp_path: Path) -> None:
    p = tmp_path / "t.csv"
    p.write_text('\ufeffinstruction,input,output\nAdd,"1, 2",3\n"Say\nhi",,hi\n')  # Excel's BOM
    source, records, formats = load(p, tmp_path / "cache")
    assert source.kind == "csv" and formats == {str(p): "alpaca"}
    assert records[0].messages == (
        {"role": "user", "content": "Add\n\n1, 2"},
        {"role": "assistant", "content": "3"},
    )
    assert records[1].messages is not None and records[1].messages[0]["content"] == "Say\nhi"
    assert records[1].source == f"{p}:row 2"
    p.write_text("instruction,input,output\nAdd,1,3\nAdd,1,\n")
    with pytest.raises(DataError, match=re.escape(f"{p}:row 2: 'output' is empty")):
        load(p, tmp_path / "cache")


def test_empty_file_and_unsupported_or_missing_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match=re.escape(f"{empty}: no records")):
        load(empty, tmp_path / "cache")
    txt = tmp_path / "notes.txt"
    txt.write_text("hello")
    with pytest.raises(DataError, match=re.escape(f"{txt}: not a data file this reads")):
        resolve_source(str(txt), tmp_path / "cache")
    # A missing path that looks like a file is a missing file: the Hub is never asked.
    monkeypatch.setattr(sources, "_load_hub", lambda *a: pytest.fail("asked the Hub"))
    for missing in ("train.jsonl", "org/train.parquet", str(tmp_path / "nope.csv"), "./data"):
        with pytest.raises(DataError, match=re.escape(f"{missing}: no such file")):
            resolve_source(missing, tmp_path / "cache")


# ---------------------------------------------------------------------------- folders


def test_folder_of_shards_sorted_recursive_one_kind(tmp_path: Path) -> None:
    d = tmp_path / "shards"
    write_jsonl(d / "b.jsonl", [{"text": "b"}])
    write_jsonl(d / "a.jsonl", [{"text": "a"}])
    write_jsonl(d / "c" / "0.jsonl", [{"messages": CHAT}])
    write_jsonl(d / ".cache" / "x.jsonl", [{"nonsense": 1}])  # hidden: not data
    (d / "README.md").write_text("# about")
    (d / "dataset_infos.json").write_text("{}")  # metadata, not a shard
    source, records, formats = load(d, tmp_path / "cache")
    assert source.kind == "jsonl"
    assert source.files == tuple(str(d / n) for n in ("a.jsonl", "b.jsonl", "c/0.jsonl"))
    assert texts(records) == ["a", "b", None] and records[2].kind == "chat"
    assert formats == {
        str(d / "a.jsonl"): "text",
        str(d / "b.jsonl"): "text",
        str(d / "c/0.jsonl"): "messages",
    }
    (d / "extra.csv").write_text("text\nx\n")
    with pytest.raises(DataError, match=re.escape(f"{d}: mixed data file types (csv, jsonl)")):
        resolve_source(str(d), tmp_path / "cache")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match=re.escape(f"{empty}: no data files")):
        resolve_source(str(empty), tmp_path / "cache")


def test_saved_dataset_and_dataset_dict_split(tmp_path: Path) -> None:
    import datasets

    train = datasets.Dataset.from_list(
        [{"prompt": "p1", "completion": "c1"}, {"prompt": "p2", "completion": "c2"}]
    )
    test = datasets.Dataset.from_list([{"text": "held out"}])
    train.save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "two"))

    source, records, formats = load(tmp_path / "one", tmp_path / "cache")
    assert source.kind == "saved_dataset"
    assert source.files == tuple(str(p) for p in sorted((tmp_path / "one").glob("*.arrow")))
    assert [(r.prompt, r.completion) for r in records] == [("p1", "c1"), ("p2", "c2")]
    assert records[1].source == f"{tmp_path / 'one'}:row 2"
    assert formats == {str(tmp_path / "one"): "prompt_completion"}

    two_train, recs_train, _ = load(tmp_path / "two", tmp_path / "cache")
    assert two_train.digest == source.digest  # the same rows, the same arrow bytes
    two_test, recs_test, _ = load(tmp_path / "two", tmp_path / "cache", split="test")
    assert two_test.split == "test" and two_test.digest != two_train.digest
    assert len(recs_train) == 2 and texts(recs_test) == ["held out"]
    with pytest.raises(DataError, match=r"without a 'validation' split \(splits: train, test\)"):
        resolve_source(str(tmp_path / "two"), tmp_path / "cache", split="validation")

    bad = datasets.Dataset.from_list([{"text": "ok"}, {"text": ""}])
    bad.save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'bad'}:row 2: 'text' is empty")):
        load(tmp_path / "bad", tmp_path / "cache")


# ---------------------------------------------------------------------------- digest


def test_digest_follows_content_only(tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a" / "train.jsonl", [{"text": "x"}])
    b = write_jsonl(tmp_path / "b" / "other-name.jsonl", [{"text": "x"}])
    da = resolve_source(str(a), tmp_path / "cache").digest
    assert resolve_source(str(a), tmp_path / "cache").digest == da  # unchanged: equal
    assert resolve_source(str(b), tmp_path / "cache").digest == da  # same bytes elsewhere: equal
    write_jsonl(a, [{"text": "y"}])
    assert resolve_source(str(a), tmp_path / "cache").digest != da  # one byte changed
    shards = tmp_path / "shards"
    write_jsonl(shards / "0.jsonl", [{"text": "x"}])
    write_jsonl(shards / "1.jsonl", [{"text": "y"}])
    ds = resolve_source(str(shards), tmp_path / "cache").digest
    write_jsonl(shards / "2.jsonl", [{"text": "z"}])
    assert resolve_source(str(shards), tmp_path / "cache").digest != ds  # a shard added
    (shards / "2.jsonl").unlink()
    assert resolve_source(str(shards), tmp_path / "cache").digest == ds


# ---------------------------------------------------------------------------- URLs


def test_file_url_is_fetched_once_and_refetched_when_changed(tmp_path: Path) -> None:
    remote = write_jsonl(tmp_path / "remote" / "train.jsonl", [{"text": "a"}])
    cache = tmp_path / "cache"
    url = remote.as_uri()
    source, records, _ = load(url, cache)
    local = Path(source.files[0])
    assert source.spec == url and source.kind == "jsonl"
    assert local.is_relative_to(cache) and local.read_bytes() == remote.read_bytes()
    assert source.digest == resolve_source(str(remote), cache).digest
    assert texts(records) == ["a"] and records[0].source == f"{local}:1"
    first = local.stat().st_mtime_ns
    assert resolve_source(url, cache).files == source.files
    assert local.stat().st_mtime_ns == first  # unchanged remote: the local copy is reused
    write_jsonl(remote, [{"text": "a"}, {"text": "b"}])
    again = resolve_source(url, cache)
    assert again.digest != source.digest and local.read_bytes() == remote.read_bytes()
    assert not [p for p in local.parent.iterdir() if ".part-" in p.name]  # no temp leftovers


@pytest.fixture
def memory_url() -> Iterator[str]:
    import fsspec

    root = f"memory://shoestring-test-{uuid.uuid4().hex}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


def test_memory_url_folder_of_shards_mirrors_remote(tmp_path: Path, memory_url: str) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe(f"{memory_url}/data/part-1.jsonl", b'{"text": "b"}\n')
    fs.pipe(f"{memory_url}/data/part-0.jsonl", b'{"text": "a"}\n')
    fs.pipe(f"{memory_url}/data/README.md", b"# not data")
    cache = tmp_path / "cache"
    source, records, _ = load(f"{memory_url}/data", cache)
    assert source.kind == "jsonl" and texts(records) == ["a", "b"]
    assert [Path(f).name for f in source.files] == ["part-0.jsonl", "part-1.jsonl"]
    folder = Path(source.files[0]).parent
    assert sorted(p.name for p in folder.iterdir()) == [
        ".shoestring-source.json",
        "part-0.jsonl",
        "part-1.jsonl",
    ]
    fs.rm(f"{memory_url}/data/part-1.jsonl")
    fewer = resolve_source(f"{memory_url}/data", cache)
    assert [Path(f).name for f in fewer.files] == ["part-0.jsonl"] and fewer.digest != source.digest
    with pytest.raises(
        DataError, match=re.escape(f"{memory_url}/missing.jsonl: no such file or folder")
    ):
        resolve_source(f"{memory_url}/missing.jsonl", cache)


def test_memory_url_saved_dataset(tmp_path: Path, memory_url: str) -> None:
    import datasets
    import fsspec

    saved = tmp_path / "saved"
    datasets.Dataset.from_list([{"text": "from arrow"}]).save_to_disk(str(saved))
    fs = fsspec.filesystem("memory")
    for p in saved.iterdir():
        fs.pipe(f"{memory_url}/ds/{p.name}", p.read_bytes())
    source, records, _ = load(f"{memory_url}/ds", tmp_path / "cache")
    assert source.kind == "saved_dataset" and texts(records) == ["from arrow"]
    assert source.digest == resolve_source(str(saved), tmp_path / "cache").digest


def test_s3_url(s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    prefix = f"data-{uuid.uuid4().hex[:8]}"
    s3_server.client().put_object(
        Bucket=s3_server.bucket, Key=f"{prefix}/train.jsonl", Body=b'{"text": "s3"}\n'
    )
    opts = {"endpoint_url": s3_server.endpoint_url, "key": "testing", "secret": "testing"}
    url = s3_server.url(f"{prefix}/train.jsonl")
    source, records, _ = load(url, tmp_path / "cache", storage_options=opts)
    assert texts(records) == ["s3"]
    sidecar = json.loads((Path(source.files[0]).parent / ".shoestring-source.json").read_text())
    assert "ETag" in sidecar["files"]["train.jsonl"]
    gone = s3_server.url(f"{prefix}/missing.jsonl")
    with pytest.raises(DataError, match=re.escape(f"{gone}: no such file or folder")):
        resolve_source(gone, tmp_path / "cache", storage_options=opts)


# ---------------------------------------------------------------------------- Hub


def test_hub_name_fails_cleanly_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # Both libraries read the variables once, at import: set what they read.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    name = f"shoestring-test/no-such-dataset-{uuid.uuid4().hex[:8]}"
    with pytest.raises(DataError) as e:
        resolve_source(name, tmp_path / "cache")
    msg = str(e.value)
    assert msg.startswith(
        f"data.train: {name!r} is not a local path and could not be loaded from the Hugging Face Hub (offline?): "
    )
    assert len(msg.splitlines()) == 1 and "Traceback" not in msg


def test_hub_source_digest_is_the_dataset_fingerprint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Hub path without the network: ``load_dataset`` replaced by a local dataset."""
    import datasets

    local = datasets.Dataset.from_list([{"text": "hub row"}])
    calls: list[tuple[str, str]] = []

    def fake_load(name: str, split: str) -> Any:
        calls.append((name, split))
        return local

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    source, records, formats = load("org/name", tmp_path / "cache", split="test")
    assert (source.kind, source.files, source.digest) == ("hub", (), local._fingerprint)
    assert calls == [("org/name", "test"), ("org/name", "test")]
    assert records[0].source == "org/name[test]:row 1" and formats == {"org/name[test]": "text"}


# ---------------------------------------------------------------------------- eval split


def test_split_eval_is_seeded_and_keeps_both_sides_non_empty() -> None:
    recs = [Record(f"f:{i}", text=str(i)) for i in range(100)]
    train, held = split_eval(recs, 0.1, seed=3)
    assert len(held) == 10 and len(train) == 90
    assert sorted(r.source for r in train + held) == sorted(r.source for r in recs)
    assert split_eval(recs, 0.1, seed=3) == (train, held)  # deterministic
    assert split_eval(recs, 0.1, seed=4)[1] != held  # the seed matters
    assert [r.text for r in held] == sorted(
        (r.text for r in held), key=lambda t: int(t or 0)
    )  # file order kept
    assert len(split_eval(recs, 0.001, seed=0)[1]) == 1  # a tiny fraction still holds one out
    two = recs[:2]
    assert [len(x) for x in split_eval(two, 0.99, seed=0)] == [1, 1]  # train is never emptied
    assert split_eval(recs, 0.0, seed=0) == (recs, [])
    with pytest.raises(DataError, match="cannot hold out an eval set from 1 record"):
        split_eval(recs[:1], 0.5, seed=0)
    with pytest.raises(DataError, match=r"must be in \[0, 1\)"):
        split_eval(recs, 1.0, seed=0)
