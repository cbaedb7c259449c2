"""Where a model comes from: one resolver for ``model.path``, ``infer --model``/``--adapter``
and ``plan --model``.

A reference is, in this order: an existing local directory (always wins), an fsspec URL of
a model folder (``s3://``, ``gs://``, ``file://``, ...), or a Hugging Face Hub id
``org/name`` with an optional ``@revision`` (branch, tag or commit). Hub models go into
huggingface_hub's own cache (shared with every other tool), limited to what a causal LM
needs (config, safetensors weights, tokenizer, chat template; never pickles), and come back
with the commit they resolved to. Bucket folders are copied by a hook the caller hands in
(the checkpoint store's fetch: this module is spine and imports no pillar) and come back
with a content digest. Every failure is a :class:`ConfigError` naming the key, the
reference and what to do, raised before anything is written.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from shoestring.config import ConfigError
from shoestring.secrets import redact_text

SourceKind = Literal["local", "hub", "bucket"]
#: What is fetched: a causal LM's folder, a LoRA adapter's, or only config.json (plan).
Want = Literal["model", "adapter", "config"]

#: The files a causal LM needs besides its weights (weights: the shards named by
#: model.safetensors.index.json, else model.safetensors).
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
INDEX = "model.safetensors.index.json"
SINGLE_WEIGHTS = "model.safetensors"

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_URL = re.compile(r"^[a-z][a-z0-9+.-]*://")

#: A bucket folder copied into ``dest`` (files matching ``patterns`` only): its local
#: path and a content digest. Handed in by the caller (the checkpoint store's fetch).
BucketFetch = Callable[[str, Path, tuple[str, ...]], tuple[Path, str]]


@dataclass(frozen=True)
class HubAccess:
    """How references are fetched; read once from the environment at the CLI edge."""

    cache_dir: Path  # shoestring's cache (SHOESTRING_CACHE): bucket copies in models/
    hf_cache: Path | None = None  # None: huggingface_hub's default (HF_HOME/hub)
    endpoint: str | None = None  # HF_ENDPOINT (None: huggingface.co)
    token: str | None = None  # HF_TOKEN (None: huggingface_hub's stored login, if any)
    offline: bool = False  # HF_HUB_OFFLINE: the cache only, no request
    progress: bool = False  # huggingface_hub's download bars (on a terminal)
    buckets: BucketFetch | None = None

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str],
        cache_dir: Path,
        *,
        buckets: BucketFetch | None = None,
        progress: bool = False,
    ) -> HubAccess:
        hf_cache = env.get("HF_HUB_CACHE") or (
            str(Path(env["HF_HOME"]) / "hub") if env.get("HF_HOME") else None
        )
        return cls(
            cache_dir=cache_dir,
            hf_cache=Path(hf_cache).expanduser() if hf_cache else None,
            endpoint=env.get("HF_ENDPOINT") or None,
            token=env.get("HF_TOKEN") or None,
            offline=env.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"),
            progress=progress,
            buckets=buckets,
        )


@dataclass(frozen=True)
class ModelRef:
    """A resolved reference: the local folder, where it came from, and which version."""

    spec: str  # as given
    kind: SourceKind
    path: Path
    repo_id: str | None = None
    revision: str | None = None  # as asked (None: the default branch)
    commit: str | None = None  # Hub: the commit the revision resolved to
    digest: str | None = None  # bucket: sha256 over the copied files' names, sizes, sha256

    @property
    def version(self) -> str | None:
        return self.commit or self.digest

    def record(self) -> dict[str, str]:
        """What run.json, the inference identity and checkpoint manifests keep."""
        doc = {"source": self.kind, "ref": redact_text(self.spec)}
        if self.commit:
            doc["commit"] = self.commit
        if self.digest:
            doc["digest"] = self.digest
        return doc


def looks_remote(spec: str) -> bool:
    """Whether ``spec`` is a Hub id or a URL rather than a local directory."""
    p = Path(spec).expanduser()
    return not p.is_dir() and (bool(_URL.match(spec)) or _is_hub_id(spec))


def hub_repo(spec: str) -> str | None:
    """The repo id of a Hub reference written ``org/name[@revision]`` (syntax only: no
    file system or network look-up), else None."""
    return spec.partition("@")[0] if _is_hub_id(spec) else None


def _is_hub_id(spec: str) -> bool:
    return bool(_HUB_ID.match(spec.partition("@")[0])) and not spec.startswith((".", "/", "~"))


def resolve(spec: str, access: HubAccess, *, key: str, want: Want = "model") -> ModelRef:
    """The local folder of ``spec`` (see the module doc); :class:`ConfigError` naming
    ``key`` when it cannot be had."""
    local = Path(spec).expanduser()
    if local.is_dir():
        _require_files(local, want, key, spec)
        return ModelRef(spec, "local", local)
    if _URL.match(spec):
        return _bucket(spec, access, key, want)
    if _is_hub_id(spec):
        return _hub(spec, access, key, want)
    raise ConfigError(
        f"{key}: {spec!r} is not a directory, a Hub id (org/name[@revision]) or a URL "
        "(s3://, gs://, file://) of a model folder"
    )


def _require_files(folder: Path, want: Want, key: str, spec: str) -> None:
    needed = ADAPTER_FILES if want == "adapter" else ("config.json",)
    missing = [n for n in needed if not (folder / n).is_file()]
    if missing:
        what = "LoRA adapter (finetune OUTPUT/final/)" if want == "adapter" else "model"
        raise ConfigError(f"{key}: {spec} has no {missing[0]}; expected a {what} folder")


def _patterns(want: Want) -> tuple[str, ...]:
    if want == "adapter":
        return ADAPTER_FILES
    if want == "config":
        return ("config.json",)
    return (*MODEL_FILES, "*.safetensors")


def _bucket(spec: str, access: HubAccess, key: str, want: Want) -> ModelRef:
    if access.buckets is None:
        raise ConfigError(f"{key}: {redact_text(spec)}: this command cannot read bucket URLs")
    try:
        path, digest = access.buckets(spec, access.cache_dir / "models", _patterns(want))
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - any storage error: one line naming the URL
        raise ConfigError(
            f"{key}: cannot copy {redact_text(spec)}: {type(e).__name__}: {e}"
        ) from None
    _require_files(path, want, key, redact_text(spec))
    return ModelRef(spec, "bucket", path, digest=digest)


# --------------------------------------------------------------------------- the Hub


def _hub(spec: str, access: HubAccess, key: str, want: Want) -> ModelRef:
    repo_id, _, revision = spec.partition("@")
    rev = revision or None
    with _errors(key, repo_id, rev, access):
        if want == "config":
            folder = Path(_download_file(access, repo_id, rev, "config.json")).parent
        else:
            first = ADAPTER_FILES if want == "adapter" else MODEL_FILES
            folder = Path(_download(access, repo_id, rev, list(first)))
        commit = folder.name  # .../snapshots/<commit>
        if want == "model":
            folder = Path(_download(access, repo_id, commit, _weight_files(folder)))
    _require_files(folder, want, key, spec)
    if want == "model" and not any(folder.glob("*.safetensors")):
        raise ConfigError(
            f"{key}: {spec} has no safetensors weights ({SINGLE_WEIGHTS} or {INDEX}); "
            "pickled .bin weights are never loaded: use a repo that has safetensors"
        )
    return ModelRef(spec, "hub", folder, repo_id=repo_id, revision=rev, commit=commit)


def _weight_files(folder: Path) -> list[str]:
    """The safetensors files the model loads: the shards its index names, else the one
    file (never a second copy such as Mistral's consolidated.safetensors)."""
    index = folder / INDEX
    if not index.is_file():
        return [SINGLE_WEIGHTS]
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{index}: unreadable safetensors index ({e})") from None


def _download(access: HubAccess, repo_id: str, revision: str | None, files: list[str]) -> str:
    from huggingface_hub import snapshot_download

    folder = snapshot_download(repo_id, allow_patterns=files, **_fetch_args(access, revision))
    assert isinstance(folder, str)  # not a dry run
    return folder


def _download_file(access: HubAccess, repo_id: str, revision: str | None, name: str) -> str:
    from huggingface_hub import hf_hub_download

    path = hf_hub_download(repo_id, name, **_fetch_args(access, revision))
    assert isinstance(path, str)  # not a dry run
    return path


def _fetch_args(access: HubAccess, revision: str | None) -> dict[str, Any]:
    """What every huggingface_hub fetch takes from ``access``: cache, endpoint, token,
    offline, progress bars."""
    return {
        "revision": revision,
        "cache_dir": access.hf_cache,
        "endpoint": access.endpoint,
        "token": access.token,
        "local_files_only": access.offline,
        "tqdm_class": _bar_class(access.progress),
    }


def _bar_class(show: bool) -> Any:
    """huggingface_hub's bars on a terminal, whatever :func:`shoestring.hf.quiet_hf` (which
    silences the library's own) has done; none elsewhere."""
    from tqdm.auto import tqdm

    class DownloadBar(tqdm):  # type: ignore[type-arg]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("name", None)
            kwargs["disable"] = not show
            super().__init__(*args, **kwargs)

    return DownloadBar


@contextlib.contextmanager
def _errors(key: str, repo_id: str, revision: str | None, access: HubAccess) -> Iterator[None]:
    """huggingface_hub's exceptions as one-line :class:`ConfigError`s that say what to do."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the known kinds become one line; others pass
        msg = hub_error_message(e, repo_id, revision, access)
        if msg is None:
            raise
        raise ConfigError(f"{key}: {msg}") from None


def hub_error_message(
    e: Exception, repo_id: str, revision: str | None, access: HubAccess
) -> str | None:
    """The one line for a huggingface_hub failure (None: not one of the known kinds)."""
    from huggingface_hub import errors

    where = access.endpoint or "https://huggingface.co"
    ref = f"{repo_id}@{revision}" if revision else repo_id
    if isinstance(e, errors.GatedRepoError):
        return (
            f"{repo_id} is gated: accept its terms on {where}/{repo_id} and set HF_TOKEN to a "
            "token of that account (huggingface-cli login also works)"
        )
    if isinstance(e, errors.RepositoryNotFoundError):
        return (
            f"Hub model {repo_id} not found on {where}, or private: check the id, or set "
            "HF_TOKEN to a token that can read it"
        )
    if isinstance(e, errors.RevisionNotFoundError):
        return (
            f"{repo_id} has no revision {revision!r}: give a branch, tag or commit of the "
            f"repo ({repo_id}@main)"
        )
    if isinstance(e, errors.RemoteEntryNotFoundError):
        return f"{ref} has no {_entry(e)}: is it a causal LM repo (config.json, safetensors)?"
    if isinstance(e, errors.HfHubHTTPError) and _status(e) in (401, 403):
        return (
            f"{ref}: access denied ({_status(e)}) on {where}: set HF_TOKEN to a token with "
            "read access to this repo"
        )
    if isinstance(e, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)):
        if access.offline:
            return (
                f"{ref} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: "
                "download it once online (then HF_HUB_OFFLINE=1 works), or give a local "
                "directory"
            )
        return (
            f"cannot reach {where} to fetch {ref}, and it is not in the local cache: check "
            "the network (or HF_ENDPOINT); after one download HF_HUB_OFFLINE=1 uses the "
            "cache, or give a local directory"
        )
    if isinstance(e, errors.HFValidationError):
        return f"{ref!r} is not a valid Hub id (org/name[@revision]): {e}"
    return None


def _entry(e: Exception) -> str:
    url = str(getattr(getattr(e, "response", None), "url", "") or "")
    return url.rsplit("/", 1)[-1] or "file it needs"


def _status(e: Exception) -> int | None:
    response = getattr(e, "response", None)
    code = getattr(response, "status_code", None)
    return int(code) if isinstance(code, int) else None
