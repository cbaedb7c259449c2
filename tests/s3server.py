"""A real, local S3-compatible server for tests: moto's standalone server in its own process.

Use from tests::

    from s3server import s3_server          # pytest fixture (session scope)

    def test_x(s3_server):
        env = s3_server.child_env()             # os.environ + what a child needs
        url = s3_server.url("run1")             # s3://BUCKET/run1
        s3_server.client()                      # boto3 S3 client for assertions

or without pytest::

    with S3Server() as srv:
        ...

or as a script (prints the env vars, serves until Ctrl+C)::

    python tests/s3server.py [--bucket NAME] [--port N]

The server is moto's standalone server (what ``python -m moto.server -H 127.0.0.1
-p PORT`` runs) started with ``subprocess.Popen`` in a new session, so the code
under test talks HTTP to a separate process exactly as it would to S3; nothing is
mocked in-process. It exits when its parent does, even if the parent is SIGKILLed.
Clients find it through ``AWS_ENDPOINT_URL``, which botocore (and therefore
boto3 and s3fs/aiobotocore) reads for every service.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

DEFAULT_BUCKET = "shoestring-test"

# Credentials and region for a fake account; moto accepts anything.
_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_SECURITY_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    # Never read the developer's real ~/.aws config or an instance metadata service.
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
    # Talk to 127.0.0.1 directly even where an HTTP(S)_PROXY is configured.
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}

# Variables that would redirect or override the endpoint/credentials set above.
_AWS_ENV_DROP = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ENDPOINT_URL_S3",
    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
    "FSSPEC_S3",
    "FSSPEC_S3_ENDPOINT_URL",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)


# The child runs moto's own ``main`` (what ``python -m moto.server`` runs), plus a watchdog:
# its stdin is a pipe from us, so when this process dies, even by SIGKILL, the pipe
# closes and the server exits instead of lingering on its port.
_SERVER_CODE = """\
import os, sys, threading
def _watch():
    try:
        sys.stdin.buffer.read()
    finally:
        os._exit(0)
threading.Thread(target=_watch, daemon=True).start()
from moto.server import main
main(sys.argv[1:])
"""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class S3Server:
    """moto's S3 server on 127.0.0.1:<free port> in a child process, with one bucket."""

    def __init__(
        self,
        bucket: str = DEFAULT_BUCKET,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        start_timeout: float = 60.0,
    ) -> None:
        self.bucket = bucket
        self.host = host
        self.port = port
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        self._client: Any = None
        self._client_lock = threading.Lock()

    # ---------------------------------------------------------------- what tests use
    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """Environment variables a child process needs to reach this server."""
        return {**_AWS_ENV, "AWS_ENDPOINT_URL": self.endpoint_url}

    def child_env(self, base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
        """``base`` (default ``os.environ``) with competing AWS settings dropped and ours set."""
        env = {
            k: v
            for k, v in (os.environ if base is None else base).items()
            if k not in _AWS_ENV_DROP
        }
        env.update(self.env)
        env.update(extra)
        return env

    def url(self, prefix: str = "") -> str:
        """``s3://BUCKET/prefix``."""
        return f"s3://{self.bucket}/{prefix.strip('/')}".rstrip("/")

    def client(self) -> Any:
        """A boto3 S3 client for this server (one, shared: clients are thread-safe)."""
        with self._client_lock:
            if self._client is None:
                import boto3

                # A session of its own: boto3's default session is not thread-safe.
                self._client = boto3.session.Session().client(
                    "s3",
                    endpoint_url=self.endpoint_url,
                    region_name="us-east-1",
                    aws_access_key_id="testing",
                    aws_secret_access_key="testing",
                )
            return self._client

    def list_keys(self, prefix: str = "") -> dict[str, int]:
        """All keys under ``prefix`` in the bucket with their sizes."""
        out: dict[str, int] = {}
        pages = (
            self.client()
            .get_paginator("list_objects_v2")
            .paginate(Bucket=self.bucket, Prefix=prefix)
        )
        for page in pages:
            for obj in page.get("Contents", []):
                out[obj["Key"]] = int(obj["Size"])
        return out

    def get(self, key: str) -> bytes:
        return self.client().get_object(Bucket=self.bucket, Key=key)["Body"].read()

    # ---------------------------------------------------------------- lifecycle
    def _answers(self) -> bool:
        """True once *our* moto server answers ListBuckets on the endpoint."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxies
        try:
            with opener.open(self.endpoint_url + "/", timeout=2) as r:
                body = r.read()
        except OSError:  # refused, reset, timeout, HTTP error
            return False
        return (
            b"ListAllMyBucketsResult" in body and self.proc is not None and self.proc.poll() is None
        )

    def start(self) -> S3Server:
        fixed_port = self.port is not None
        last_err = ""
        for _attempt in range(1 if fixed_port else 3):
            # A port seen free can be taken by someone else before moto binds it: retry.
            port = self.port if fixed_port else free_port(self.host)
            self.port = port
            self._client = None  # bound to the old endpoint
            self._log = tempfile.TemporaryFile()
            env = {k: v for k, v in os.environ.items() if k not in _AWS_ENV_DROP}
            env.update(_AWS_ENV)
            env.pop("AWS_ENDPOINT_URL", None)
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _SERVER_CODE, "-H", self.host, "-p", str(port)],
                stdin=subprocess.PIPE,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            deadline = time.monotonic() + self.start_timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                if self._answers():
                    self._create_bucket()
                    return self
                time.sleep(0.1)
            last_err = self._read_log()
            self.stop()
        raise RuntimeError(f"moto S3 server did not start on {self.host}:{self.port}:\n{last_err}")

    def _create_bucket(self) -> None:
        self.client().create_bucket(Bucket=self.bucket)

    def _read_log(self) -> str:
        if self._log is None:
            return ""
        try:
            self._log.seek(0)
            return self._log.read().decode("utf-8", "replace")[-4000:]
        except (OSError, ValueError):
            return ""

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()  # the watchdog's cue to exit
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        if proc is not None and proc.poll() is None:
            # Its own session/process group: signal the group so werkzeug's children go too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        if self._log is not None:
            with contextlib.suppress(OSError):
                self._log.close()
            self._log = None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


@contextlib.contextmanager
def running_s3_server(bucket: str = DEFAULT_BUCKET) -> Iterator[S3Server]:
    srv = S3Server(bucket)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One moto S3 server (separate process) for the whole test session.

    Tests share the bucket; give each test its own key prefix (``s3_server.url(name)``).
    """
    with running_s3_server() as srv:
        yield srv


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Run a local moto S3 server with one bucket.")
    p.add_argument("--bucket", default=DEFAULT_BUCKET)
    p.add_argument("--port", type=int, default=None)
    args = p.parse_args(argv)

    def _stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    srv = S3Server(args.bucket, port=args.port)
    srv.start()
    try:
        for k, v in srv.env.items():
            print(f"export {k}={v}")
        print(f"# bucket: s3://{srv.bucket}   (Ctrl+C to stop)", flush=True)
        while srv.proc is not None and srv.proc.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
