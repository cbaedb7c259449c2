"""A Hugging Face Hub stand-in on 127.0.0.1: exactly the endpoints huggingface_hub 2.4's
``snapshot_download`` and ``hf_hub_download`` call, serving repositories built in memory.

(olah, a self-hosted Hub mirror, serves local repositories only from git checkouts with
LFS objects, reads every file whole into memory, has no Range support and cannot be
throttled or made to answer "gated"; this stand-in does all four in 150 lines.)

- ``GET /api/models/{repo}/revision/{rev}``: model info (``sha`` = the commit ``rev``
  resolves to);
- ``GET /api/models/{repo}/tree/{rev}``: the recursive file listing (one page);
- ``HEAD|GET /{repo}/resolve/{rev}/{path}``: ``X-Repo-Commit``, ``ETag`` (the LFS sha256
  for weights, the git blob id otherwise), ``Content-Length``; ``Range: bytes=N-`` is
  answered with 206. ``throttle`` slows chosen files so a test can kill a download in
  the middle of one.
- errors as the Hub sends them: ``X-Error-Code`` RepoNotFound (404), GatedRepo (401
  without the token), RevisionNotFound (404), EntryNotFound (404 + X-Repo-Commit).

Every request is logged (``requests``), so a test can assert that none was made.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    token: str | None = None  # gated: this bearer token is needed

    def add_commit(self, folder: Path, branch: str = "main") -> str:
        files = {
            p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*"))
            if p.is_file()
        }
        h = hashlib.sha1(json.dumps(sorted((k, git_blob_id(v)) for k, v in files.items())).encode())
        h.update(str(len(self.commits)).encode())
        sha = h.hexdigest()
        self.commits[sha] = files
        self.refs[branch] = sha
        return sha

    def resolve(self, rev: str) -> str | None:
        if rev in self.commits:
            return rev
        return self.refs.get(rev)


class HubServer:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[str] = []
        self.throttle: dict[str, float] = {}  # "org/name/file" -> bytes per second
        self.sent: dict[str, int] = {}  # "org/name/file" -> bytes sent by GETs
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> HubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def repo(self, repo_id: str) -> Repo:
        return self.repos.setdefault(repo_id, Repo())

    def log(self, line: str) -> None:
        with self._lock:
            self.requests.append(line)

    def count_sent(self, name: str, n: int) -> None:
        with self._lock:
            self.sent[name] = self.sent.get(name, 0) + n


def _etag(path: str, data: bytes) -> str:
    return hashlib.sha256(data).hexdigest() if path.endswith(".safetensors") else git_blob_id(data)


def _handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _error(self, status: int, code: str, commit: str | None = None) -> None:
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", code)
            if commit:
                self.send_header("X-Repo-Commit", commit)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _json(self, doc: object) -> None:
            data = json.dumps(doc).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _serve(self, body: bool) -> None:
            hub.log(f"{self.command} {self.path}")
            parts = [unquote(p) for p in urlsplit(self.path).path.strip("/").split("/")]
            api = parts[:2] == ["api", "models"]
            repo_id = "/".join(parts[2:4] if api else parts[0:2])
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._error(404, "RepoNotFound")
            auth = self.headers.get("Authorization", "")
            if repo.token is not None and auth != f"Bearer {repo.token}":
                return self._error(401, "GatedRepo")
            kind, rev = (parts[4], parts[5]) if api else (parts[2], parts[3])
            commit = repo.resolve(rev)
            if commit is None:
                return self._error(404, "RevisionNotFound")
            files = repo.commits[commit]
            if api and kind == "revision":
                siblings = [{"rfilename": p} for p in files]
                return self._json({"id": repo_id, "sha": commit, "siblings": siblings})
            if api and kind == "tree":
                return self._json([_entry(p, d) for p, d in files.items()])
            path = "/".join(parts[4:])
            if kind != "resolve" or path not in files:
                return self._error(404, "EntryNotFound", commit)
            self._file(f"{repo_id}/{path}", commit, path, files[path], body)

        def _file(self, key: str, commit: str, path: str, data: bytes, body: bool) -> None:
            start = 0
            rng = self.headers.get("Range", "")
            if rng.startswith("bytes=") and body:
                start = int(rng[6:].split("-")[0])
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{_etag(path, data)}"')
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if body:
                self._send(key, data[start:])

        def _send(self, name: str, data: bytes) -> None:
            rate = hub.throttle.get(name)
            step = 4096 if rate else len(data) or 1
            for i in range(0, len(data), step):
                chunk = data[i : i + step]
                try:
                    self.wfile.write(chunk)
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    return
                hub.count_sent(name, len(chunk))
                if rate:
                    time.sleep(len(chunk) / rate)

    return Handler


def _entry(path: str, data: bytes) -> dict[str, object]:
    doc: dict[str, object] = {
        "type": "file",
        "path": path,
        "size": len(data),
        "oid": git_blob_id(data),
    }
    if path.endswith(".safetensors"):
        doc["lfs"] = {
            "oid": hashlib.sha256(data).hexdigest(),
            "size": len(data),
            "pointerSize": 134,
        }
    return doc
