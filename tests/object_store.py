"""An S3-compatible server for the tests: moto's standalone server on a free loopback port,
driven by real boto3 (and by worker processes, through QT_STORAGE and QT_S3_ENDPOINT_URL)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto.server import ThreadedMotoServer

from queue_tinker.storage.s3 import S3Store

# Credentials the test server accepts (any will do); set for this process and its children.
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "qt-test",
    "AWS_SECRET_ACCESS_KEY": "qt-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class S3Server:
    """moto's server, stoppable and startable again on the same port; its buckets and objects
    live in this process's memory, so they outlive a stop (a store that went away and came
    back)."""

    def __init__(self) -> None:
        self.port = 0
        self._server: ThreadedMotoServer | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        server.start()
        self.port = server.get_host_and_port()[1]
        self._server = server

    def stop(self) -> None:
        """Gone: stopped, and its socket closed, so requests are refused at once."""
        if self._server is not None:
            self._server.stop()
            inner: Any = getattr(self._server, "_server", None)
            if inner is not None:
                inner.server_close()
            self._server = None

    def client(self) -> Any:
        return boto3.client("s3", endpoint_url=self.url)

    def bucket(self) -> str:
        """A new empty bucket."""
        name = f"qt-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def store(self, bucket: str, cache: Path, **options: Any) -> S3Store:
        return S3Store(f"s3://{bucket}/ckpt", cache, endpoint_url=self.url, **options)


def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in AWS_ENV.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
