"""Where records come from: a file, a folder of shards, a saved dataset, a URL, a Hub name.

Two steps with different costs. :func:`resolve_source` finds the data files and hashes
their bytes (the digest keys the tokenized cache, so a restart runs it before deciding
whether that cache is still good); nothing is parsed. :func:`read_records` parses every
row into a :class:`Record` and says which format each file turned out to hold.

``data.train`` is read, in this order, as

1. a local file: ``.jsonl`` (or ``.jsonl.gz``), ``.json`` (a top-level array; ``.json.gz``),
   ``.parquet`` or ``.csv``;
2. a local folder: a ``datasets`` ``save_to_disk`` folder (a ``DatasetDict``'s ``split``
   is picked), or else every data file under it (recursively, sorted, one kind);
3. a URL (``s3://``, ``gs://``, ``file://``, ``memory://`` …): fetched through fsspec into
   the cache (kept while the remote size/etag/mtime stay the same), then as above;
4. ``name`` or ``owner/name``: a Hugging Face Hub dataset, loaded with ``datasets``.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import importlib
import json
import os
import random
import re
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import IO, Any, Literal

from shoestring.data.formats import FORMATS, ConcreteFormat, detect_format, parse_record
from shoestring.data.records import DataError, Format, Record
from shoestring.fsio import atomic_write

SourceKind = Literal["jsonl", "json", "parquet", "csv", "saved_dataset", "hub"]
FileKind = Literal["jsonl", "json", "parquet", "csv"]

#: File name endings of data files, longest first, and the kind each is read as.
DATA_SUFFIXES: tuple[tuple[str, FileKind], ...] = (
    (".jsonl.gz", "jsonl"),
    (".json.gz", "json"),
    (".jsonl", "jsonl"),
    (".json", "json"),
    (".parquet", "parquet"),
    (".csv", "csv"),
)
#: The files ``datasets.save_to_disk`` writes beside its ``.arrow`` shards.
SAVED_DATASET_FILES = ("dataset_dict.json", "state.json", "dataset_info.json")
#: Metadata files a dataset folder may hold that are not data (never read as shards).
METADATA_FILES = frozenset({*SAVED_DATASET_FILES, "dataset_infos.json"})
#: A missing path ending in one of these is a missing file, never a Hub dataset name.
FILE_LIKE_SUFFIXES = frozenset(
    {".jsonl", ".json", ".parquet", ".csv", ".gz", ".txt", ".tsv", ".arrow", ".zip", ".zst"}
)
KNOWN_SUFFIXES = ", ".join(suffix for suffix, _ in DATA_SUFFIXES)
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
INSTALL_HINT = "pip install 'shoestring[data]'"
SIDECAR = ".shoestring-source.json"
#: Fields of an fsspec ``info()`` that change when a remote file does.
IDENTITY_KEYS = ("size", "ETag", "etag", "md5Hash", "crc32c", "mtime", "LastModified", "updated")
HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class Source:
    spec: str  # what the user wrote (data.train)
    kind: SourceKind
    files: tuple[str, ...]  # local paths of the data files, sorted (a fetched copy for URLs)
    digest: str  # sha256 hex over the content (for the tokenized-cache key)
    split: str = "train"


# ---------------------------------------------------------------------------- helpers


def optional_module(name: str, purpose: str) -> Any:
    """Import an optional dependency, or fail with the install hint."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        top = name.split(".")[0]
        raise DataError(f"{purpose} needs the '{top}' package: {INSTALL_HINT}") from e


def file_kind(path: Path | str) -> FileKind | None:
    name = str(path).lower()
    return next((kind for suffix, kind in DATA_SUFFIXES if name.endswith(suffix)), None)


def _hash_files(kind: SourceKind, root: Path | None, files: Sequence[Path]) -> str:
    """sha256 over the files' bytes (and, in a folder, their names relative to it)."""
    h = hashlib.sha256(kind.encode())
    for path in files:
        name = path.relative_to(root).as_posix() if root is not None else ""
        h.update(f"\0{name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            while chunk := f.read(HASH_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def _is_hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


# ---------------------------------------------------------------------------- resolve


def resolve_source(
    spec: str,
    cache_dir: Path,
    split: str = "train",
    storage_options: dict[str, Any] | None = None,
    *,
    key: str = "data.train",
) -> Source:
    """Find the data files of ``spec`` and hash them; parse nothing. ``key`` (the
    config key ``spec`` came from) prefixes errors that are not about one file."""
    if "://" in spec:
        local = fetch_url(spec, cache_dir, storage_options or {})
        return _resolve_local(spec, local, split)
    path = Path(spec).expanduser()
    if path.exists():
        return _resolve_local(spec, path, split)
    if _looks_like_hub_name(spec):
        return _resolve_hub(spec, split, key)
    raise DataError(f"{spec}: no such file")


def _looks_like_hub_name(spec: str) -> bool:
    if HUB_NAME.fullmatch(spec) is None:
        return False
    return Path(spec).suffix.lower() not in FILE_LIKE_SUFFIXES


def _resolve_local(spec: str, path: Path, split: str) -> Source:
    if path.is_dir():
        if _is_saved_dataset(path):
            return _resolve_saved_dataset(spec, path, split)
        return _resolve_shards(spec, path, split)
    kind = file_kind(path)
    if kind is None:
        raise DataError(f"{path}: not a data file this reads ({KNOWN_SUFFIXES})")
    return Source(spec, kind, (str(path),), _hash_files(kind, None, [path]), split)


def _is_saved_dataset(folder: Path) -> bool:
    if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
        return True
    return (folder / "dataset_info.json").is_file() and any(folder.glob("*.arrow"))


def _resolve_saved_dataset(spec: str, folder: Path, split: str) -> Source:
    dict_file = folder / "dataset_dict.json"
    if dict_file.is_file():
        splits = json.loads(dict_file.read_text()).get("splits", [])
        if split not in splits:
            raise DataError(
                f"{folder}: a saved DatasetDict without a {split!r} split "
                f"(splits: {', '.join(splits) or 'none'})"
            )
        folder = folder / split
    arrows = sorted(folder.glob("*.arrow"))
    if not arrows:
        raise DataError(f"{folder}: a saved dataset folder without .arrow files")
    digest = _hash_files("saved_dataset", folder, arrows)
    return Source(spec, "saved_dataset", tuple(str(p) for p in arrows), digest, split)


def _resolve_shards(spec: str, folder: Path, split: str) -> Source:
    shards = sorted(
        (
            p
            for p in folder.rglob("*")
            if p.is_file()
            and file_kind(p) is not None
            and p.name not in METADATA_FILES
            and not _is_hidden(p, folder)
        ),
        key=lambda p: p.relative_to(folder).as_posix(),
    )
    if not shards:
        raise DataError(f"{folder}: no data files ({KNOWN_SUFFIXES}) in this folder")
    kinds = sorted({k for p in shards if (k := file_kind(p)) is not None})
    if len(kinds) > 1:
        raise DataError(
            f"{folder}: mixed data file types ({', '.join(kinds)}); keep one kind per folder"
        )
    kind: FileKind = kinds[0]
    return Source(
        spec, kind, tuple(str(p) for p in shards), _hash_files(kind, folder, shards), split
    )


def _load_hub(name: str, split: str, key: str) -> Any:
    datasets = optional_module(
        "datasets", f"{key}: {name!r} is not a local path; as a Hub dataset it"
    )
    try:
        return datasets.load_dataset(name, split=split)
    except Exception as e:  # offline, not found, gated, no such split: all one answer
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(
            f"{key}: {name!r} is not a local path and could not be loaded from the "
            f"Hugging Face Hub (offline?): {reason}"
        ) from e


def _resolve_hub(name: str, split: str, key: str) -> Source:
    dataset = _load_hub(name, split, key)
    return Source(name, "hub", (), str(dataset._fingerprint), split)


# ---------------------------------------------------------------------------- fetch


def _remote_fs(url: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(url, **storage_options)
    except ImportError as e:
        proto = url.split("://", 1)[0]
        pkg = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
        hint = pkg.get(proto, f"the fsspec backend for {proto}://")
        raise DataError(f"{url}: reading it needs {hint} (pip install {hint})") from e
    except ValueError as e:
        raise DataError(f"{url}: not a URL fsspec can open: {e}") from e
    return fs, str(root).rstrip("/")


#: ``{relative path: (remote path, identity)}`` of the files to fetch.
Listing = dict[str, tuple[str, dict[str, str]]]


def _identity(info: Mapping[str, Any]) -> dict[str, str]:
    return {k: str(info[k]) for k in IDENTITY_KEYS if info.get(k) is not None}


def _wanted_remote(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    hidden = any(part.startswith(".") for part in rel.split("/"))
    return not hidden and (file_kind(name) is not None or name.endswith(".arrow"))


def _remote_call(url: str, call: Callable[[], Any]) -> Any:
    """One listing call; what the storage says goes into a one-line DataError."""
    try:
        return call()
    except FileNotFoundError as e:
        raise DataError(f"{url}: no such file or folder") from e
    except Exception as e:  # credentials, permissions, network: botocore's are not OSErrors
        raise DataError(f"{url}: could not be read: {type(e).__name__}: {e}") from e


def _remote_listing(fs: Any, root: str, url: str) -> tuple[bool, Listing]:
    """``(is_folder, {relative path: (remote path, identity)})`` of what to fetch."""
    fs.invalidate_cache()
    info = _remote_call(url, lambda: fs.info(root))
    if info.get("type") != "directory":
        if file_kind(root) is None:
            raise DataError(f"{url}: not a data file this reads ({KNOWN_SUFFIXES})")
        return False, {root.rsplit("/", 1)[-1]: (root, _identity(info))}
    found = _remote_call(url, lambda: fs.find(root, detail=True))
    listing = {
        rel: (path, _identity(meta))
        for path, meta in found.items()
        if _wanted_remote(rel := str(path)[len(root) :].lstrip("/"))
    }
    if not listing:
        raise DataError(f"{url}: no data files ({KNOWN_SUFFIXES}) in this folder")
    return True, listing


def _cache_folder(url: str, cache_dir: Path) -> Path:
    stem = re.sub(r"[^\w.-]+", "_", url.split("://", 1)[-1].rstrip("/").rsplit("/", 1)[-1])
    return cache_dir / f"{stem[:48] or 'data'}-{hashlib.sha256(url.encode()).hexdigest()[:16]}"


def _download(fs: Any, remote: str, local: Path, url: str) -> None:
    """Copy one remote file to ``local`` atomically: a temp name, then a rename."""
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = local.with_name(f".{local.name}.part-{uuid.uuid4().hex[:8]}")
    try:
        fs.get_file(remote, str(tmp))
        os.replace(tmp, local)
    except Exception as e:
        raise DataError(f"{url}: could not fetch {remote}: {type(e).__name__}: {e}") from e
    finally:
        tmp.unlink(missing_ok=True)


def _read_sidecar(folder: Path) -> dict[str, Any]:
    try:
        data = json.loads((folder / SIDECAR).read_text())
    except (OSError, ValueError):
        return {}
    return data.get("files", {}) if isinstance(data, dict) else {}


def fetch_url(url: str, cache_dir: Path, storage_options: dict[str, Any]) -> Path:
    """Mirror a remote file or folder under ``cache_dir``; files whose remote identity
    (size, etag, mtime) matches the sidecar from the last fetch are not downloaded again.
    Returns the local file or folder."""
    fs, root = _remote_fs(url, storage_options)
    is_folder, listing = _remote_listing(fs, root, url)
    folder = _cache_folder(url, cache_dir)
    known = _read_sidecar(folder)
    for rel, (remote, identity) in listing.items():
        local = folder / rel
        if known.get(rel) != identity or not local.is_file():
            _download(fs, remote, local, url)
    for rel in set(known) - set(listing):  # gone from the remote: not part of the data now
        (folder / rel).unlink(missing_ok=True)
    sidecar = {"url": url, "files": {rel: identity for rel, (_, identity) in listing.items()}}
    atomic_write(folder / SIDECAR, json.dumps(sidecar, indent=1).encode(), durable=False)
    return folder if is_folder else folder / next(iter(listing))


# ---------------------------------------------------------------------------- read

#: ``(where, object)`` pairs of one file or dataset, ``where`` being ``file:line`` or the like.
Rows = Iterator[tuple[str, Any]]


def _open_text(path: Path) -> IO[str]:
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8-sig")
    return open(path, encoding="utf-8-sig")


def _first_undecodable(path: Path) -> tuple[int, int, str] | None:
    """Where ``path`` (decompressed) first stops being UTF-8: ``(line, byte offset,
    reason)``. Line by line, so memory is one line: no UTF-8 sequence holds a newline byte."""
    offset = 0
    with gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return n, offset + e.start, e.reason
            offset += len(raw)
    return None


def _not_utf8(path: Path, e: UnicodeDecodeError) -> DataError:
    """The one-line error for a file that is not UTF-8, naming the line of the first bad
    byte (the text reader decodes ahead in blocks, so its position says nothing)."""
    found = _first_undecodable(path)
    if found is None:
        return DataError(f"{path}: not UTF-8 text ({e.reason})")
    line, offset, reason = found
    return DataError(f"{path}:{line}: not UTF-8 text ({reason} at byte {offset} of the file)")


def _json_line(line: str, where: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from e


def _jsonl_rows(path: Path) -> Rows:
    try:
        with _open_text(path) as f:
            for n, line in enumerate(f, start=1):
                if line.strip():
                    yield f"{path}:{n}", _json_line(line.rstrip("\r\n"), f"{path}:{n}")
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from e


def _json_rows(path: Path) -> Rows:
    try:
        with _open_text(path) as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # JSON Lines in a .json file, as many datasets ship them
            yield from _jsonl_rows(path)
            return
        raise DataError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from e
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON array of records, got {type(data).__name__}")
    for i, item in enumerate(data, start=1):
        yield f"{path}:item {i}", item


def _parquet_rows(path: Path) -> Rows:
    parquet = optional_module("pyarrow.parquet", f"{path}: reading Parquet")
    try:
        batches = parquet.ParquetFile(path).iter_batches(batch_size=1024)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{path}: not a readable Parquet file: {e}") from e
    n = 0
    for batch in batches:
        for row in batch.to_pylist():
            n += 1
            yield f"{path}:row {n}", row


def _csv_rows(path: Path) -> Rows:
    csv.field_size_limit(2**31 - 1)  # long documents in one cell are normal training data
    n = 0
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            for n, row in enumerate(csv.DictReader(f), start=1):
                # Cells past the header land under the key None: not a field of the record.
                yield f"{path}:row {n}", {k: v for k, v in row.items() if k is not None}
    except csv.Error as e:
        raise DataError(f"{path}:row {n + 1}: invalid CSV: {e}") from e
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from e


_FILE_ROWS: Mapping[SourceKind, Callable[[Path], Rows]] = MappingProxyType(
    {"jsonl": _jsonl_rows, "json": _json_rows, "parquet": _parquet_rows, "csv": _csv_rows}
)


def _dataset_rows(dataset: Any, label: str) -> Rows:
    n = 0
    for batch in dataset.iter(batch_size=1024):
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns)):
            n += 1
            yield f"{label}:row {n}", dict(zip(columns, values))


def _units(source: Source) -> Iterator[tuple[str, Rows]]:
    """``(name, rows)`` per file, or one pair for a whole dataset."""
    if source.kind == "saved_dataset":
        folder = str(Path(source.files[0]).parent)
        datasets = optional_module("datasets", f"{folder}: reading a saved dataset")
        yield folder, _dataset_rows(datasets.load_from_disk(folder), folder)
    elif source.kind == "hub":
        label = f"{source.spec}[{source.split}]"
        yield label, _dataset_rows(_load_hub(source.spec, source.split, "data"), label)
    else:
        for file in source.files:
            yield file, _FILE_ROWS[source.kind](Path(file))


#: Plain-text shapes may share a file (as they always could): each line is one or the other.
PLAIN: frozenset[str] = frozenset({"text", "prompt_completion"})


def _parse_unit(unit: str, rows: Rows, fmt: Format) -> tuple[list[Record], ConcreteFormat]:
    records: list[Record] = []
    unit_format: ConcreteFormat | None = None if fmt == "auto" else fmt
    first = ""
    for where, obj in rows:
        record_format = unit_format
        if fmt == "auto":
            record_format = detect_format(obj, where)
            if unit_format is None:
                unit_format, first = record_format, where
            elif record_format != unit_format and {record_format, unit_format} != PLAIN:
                raise DataError(
                    f"{where}: a {record_format} record, but {unit} holds {unit_format} "
                    f"records (detected from {first}); keep one format per file or set "
                    "data.format"
                )
        assert record_format is not None
        records.append(parse_record(obj, where, record_format))
    if unit_format is None or not records:
        raise DataError(f"{unit}: no records")
    return records, unit_format


def read_records(source: Source, fmt: Format) -> tuple[list[Record], dict[str, ConcreteFormat]]:
    """Every record of ``source``, and the format of each file (or dataset) by name."""
    if fmt != "auto" and fmt not in FORMATS:
        raise DataError(
            f"data.format: unknown format {fmt!r} (expected one of auto, {', '.join(FORMATS)})"
        )
    records: list[Record] = []
    formats: dict[str, ConcreteFormat] = {}
    for unit, rows in _units(source):
        unit_records, formats[unit] = _parse_unit(unit, rows, fmt)
        records += unit_records
    return records, formats


def split_eval(
    records: Sequence[Record], fraction: float, seed: int
) -> tuple[list[Record], list[Record]]:
    """``(train, eval)``: a seeded, deterministic hold-out of ``fraction`` of the records
    (at least one when ``fraction > 0``, never all). Both keep the records' order."""
    if not 0 <= fraction < 1:
        raise DataError(f"eval fraction must be in [0, 1), got {fraction}")
    if fraction == 0:
        return list(records), []
    if len(records) < 2:
        raise DataError(f"cannot hold out an eval set from {len(records)} record(s)")
    count = min(max(1, round(len(records) * fraction)), len(records) - 1)
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    held = set(order[:count])
    train = [r for i, r in enumerate(records) if i not in held]
    return train, [r for i, r in enumerate(records) if i in held]
