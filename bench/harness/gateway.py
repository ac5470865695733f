"""The HTTP gateway for a benchmark: a `queue-tinker serve` process on a run's settings
(`gateway_proc`), an API key for the official `tinker` SDK (`make_key`) and the gateway's access
log counted by endpoint (`requests_by_endpoint`).

This mirrors parts of tests/procs.py on purpose: bench does not import tests.
"""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from bench.harness.services import child_env
from bench.harness.workers import Proc
from queue_tinker.local.embedded import free_port
from queue_tinker.settings import Settings

HEALTH_PATH = "/api/v1/healthz"
# uvicorn's access log line: `INFO:     127.0.0.1:50312 - "POST /api/v1/optim_step HTTP/1.1" 200`
ACCESS_LINE = re.compile(r'"(GET|POST|PUT|DELETE) (/\S*) HTTP/[\d.]+" (\d+)')


@contextmanager
def gateway_proc(
    settings: Settings, log_path: Path, timeout: float = 60
) -> Iterator[tuple[Proc, str]]:
    """A `queue-tinker serve` process (production defaults: uvicorn, access log at INFO) on the
    deployment of `settings`, answering its health check before the body runs; yields the
    process and its base URL, stops it afterwards."""
    port = free_port()
    serve = [sys.executable, "-m", "queue_tinker.cli", "serve", "--host", "127.0.0.1"]
    proc = Proc([*serve, "--port", str(port)], child_env(settings), log_path)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while not _healthy(url):
            if proc.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not come up:\n{proc.log()[-3000:]}")
            time.sleep(0.1)
        yield proc, url
    finally:
        # uvicorn shuts down cleanly on SIGTERM, then re-raises the signal: -15 is a clean exit.
        code = proc.stop()
        if code not in (0, -signal.SIGTERM):
            print(
                f"warning: gateway {proc.pid} exited with {code}:\n{proc.log()[-2000:]}",
                file=sys.stderr,
            )


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + HEALTH_PATH, timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def make_key(settings: Settings, tenant: str) -> str:
    """A new API key (`tml-...`) of `tenant`, created in the deployment's Postgres."""
    from queue_tinker.store import api_keys
    from queue_tinker.store.db import make_engine, session_factory

    async def create() -> str:
        engine = make_engine(settings.database_url or "")
        try:
            return (await api_keys.create_key(session_factory(engine), tenant))[1]
        finally:
            await engine.dispose()

    return asyncio.run(create())


def requests_by_endpoint(log_text: str) -> Counter[str]:
    """How many requests the gateway answered, by `METHOD /path status`, from its log."""
    return Counter(f"{m[1]} {m[2]} {m[3]}" for m in ACCESS_LINE.finditer(log_text))
