"""Fault injection for tests: worker processes to SIGKILL, and a TCP proxy that can play a
Postgres outage.

The machine's Postgres serves other tests (and CI), so it is never stopped. Processes under
test reach it through `TcpProxy` instead; `outage()` then does to them what a stopped server
does: every open connection is cut (reset) and new ones are refused (the port stops
listening), until `restore()` listens again on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import redis
from procs import WorkerProcess
from sqlalchemy.engine import make_url

from queue_tinker.queue.keys import Keys
from queue_tinker.settings import Settings

T = TypeVar("T")
CHUNK = 64 * 1024


def wait_until(
    what: str, ready: Callable[[], T | None], timeout: float = 60, every: float = 0.02
) -> T:
    """Poll `ready` until it returns something (not None/False); fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = ready()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout}s")
        time.sleep(every)


# --- worker processes ----------------------------------------------------------------------
class Fleet:
    """The LoRA worker processes of one deployment: started, found by the lease they hold,
    killed."""

    def __init__(self, settings: Settings, base_model: str, log_dir: Path) -> None:
        self.settings = settings
        self.base_model = base_model
        self.log_dir = log_dir
        self.keys = Keys(settings.key_prefix)
        self.redis = redis.Redis.from_url(settings.redis_url or "")
        self.procs: list[WorkerProcess] = []
        self.killed: list[WorkerProcess] = []

    def start(self) -> WorkerProcess:
        log = self.log_dir / f"worker-{len(self.procs)}.log"
        proc = WorkerProcess(self.settings, self.base_model, log, engine="lora")
        self.procs.append(proc)
        return proc

    def live(self) -> list[WorkerProcess]:
        """Running workers that have registered (their model is loaded: they can take over)."""
        ids = self.redis.zrange(self.keys.workers(), 0, -1)
        pids = {
            int(p) for p in (self.redis.hget(self.keys.worker(w.decode()), "pid") for w in ids) if p
        }
        return [p for p in self.procs if p.proc.poll() is None and p.pid in pids]

    def owner(self, model_id: str) -> WorkerProcess | None:
        """The worker holding the model's lease now (`<worker id>|<epoch>`)."""
        token = self.redis.get(self.keys.model_lease(model_id))
        if token is None:
            return None
        pid = self.redis.hget(self.keys.worker(token.decode().split("|")[0]), "pid")
        return next((p for p in self.procs if pid and p.pid == int(pid)), None)

    def kill(self, proc: WorkerProcess) -> None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.proc.wait(10)
        self.killed.append(proc)

    def logs(self) -> str:
        return "\n".join(p.log() for p in self.procs)

    def close(self) -> dict[int, int]:
        """Stop every worker; the exit code of each one that was not killed."""
        codes = {p.pid: p.stop() for p in self.procs}
        self.redis.close()
        return {pid: code for pid, code in codes.items() if pid not in {k.pid for k in self.killed}}


class Publications:
    """Counts, per job id, the outcomes published on a model's events channel."""

    def __init__(self, redis_url: str, channel: str) -> None:
        self.counts: Counter[str] = Counter()
        self._redis = redis.Redis.from_url(redis_url)
        self._pubsub = self._redis.pubsub()
        self._pubsub.subscribe(channel)
        wait_until("the subscription", lambda: self._pubsub.get_message(timeout=0.5))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while not self._stop.is_set():
            message = self._pubsub.get_message(timeout=0.1)
            if message and message["type"] == "message":
                job_id = msgpack.unpackb(message["data"], raw=True)[0].decode()
                self.counts[job_id] += 1

    def close(self) -> Counter[str]:
        self._stop.set()
        self._thread.join(5)
        self._pubsub.close()
        self._redis.close()
        return self.counts


# --- Postgres outage ------------------------------------------------------------------------


class TcpProxy:
    """127.0.0.1:<port> forwarded to `upstream` (host, port) or a unix socket path, on its
    own thread and event loop."""

    def __init__(self, upstream: tuple[str, int] | str) -> None:
        self.upstream = upstream
        self.port = 0
        self.accepted = 0  # connections taken since start, for tests to see traffic
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="qt-tcp-proxy", daemon=True
        )
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.Task[None]] = set()
        self._transports: set[asyncio.BaseTransport] = set()

    # --- control, from any thread ---------------------------------------------------------
    def start(self) -> TcpProxy:
        self._thread.start()
        self._call(self._listen())
        return self

    def outage(self) -> None:
        """Cut every connection and stop listening: connects are refused from now on."""
        self._call(self._cut())

    def restore(self) -> None:
        """Listen again on the same port."""
        self._call(self._listen())

    def close(self) -> None:
        if self._thread.is_alive():
            self._call(self._cut())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        if not self._loop.is_running():
            self._loop.close()

    def _call(self, coro: Any) -> Any:
        done: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return done.result(10)

    # --- on the proxy's loop ---------------------------------------------------------------
    async def _listen(self) -> None:
        self._server = await asyncio.start_server(
            self._link, "127.0.0.1", self.port, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def _cut(self) -> None:
        if self._server is not None:
            self._server.close()  # the listening socket goes at once: connects are refused
            self._server = None
        for transport in list(self._transports):
            transport.abort()  # an RST, as a host whose server died would answer
        self._transports.clear()
        links = list(self._links)
        for task in links:
            task.cancel()
        await asyncio.gather(*links, return_exceptions=True)

    async def _link(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._links.add(task)
        self.accepted += 1
        upstream_writer: asyncio.StreamWriter | None = None
        self._transports.add(client_writer.transport)
        try:
            if isinstance(self.upstream, str):
                upstream_reader, upstream_writer = await asyncio.open_unix_connection(self.upstream)
            else:
                upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
            self._transports.add(upstream_writer.transport)
            await asyncio.gather(
                _pump(client_reader, upstream_writer), _pump(upstream_reader, client_writer)
            )
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            for writer in (client_writer, upstream_writer):
                if writer is not None:
                    self._transports.discard(writer.transport)
                    writer.transport.abort()
            self._links.discard(task)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy one direction until EOF, then pass the EOF on (half-close)."""
    while data := await reader.read(CHUNK):
        writer.write(data)
        await writer.drain()
    with contextlib.suppress(OSError):
        if writer.can_write_eof():
            writer.write_eof()


def postgres_upstream(database_url: str) -> tuple[str, int] | str:
    """Where a Postgres URL's server listens: (host, port), or the unix socket path of a URL
    with `?host=/dir` (the embedded pgserver gives those)."""
    url = make_url(database_url)
    port = url.port or 5432
    host = url.query.get("host")
    if isinstance(host, str) and host.startswith("/"):
        return f"{host}/.s.PGSQL.{port}"
    return (url.host or "127.0.0.1", port)


def via_proxy(database_url: str, proxy: TcpProxy) -> str:
    """The same database and credentials, reached through `proxy`."""
    url = make_url(database_url)
    query = {k: v for k, v in url.query.items() if k != "host"}
    return url.set(host="127.0.0.1", port=proxy.port, query=query).render_as_string(
        hide_password=False
    )


@contextmanager
def postgres_proxy(database_url: str) -> Iterator[tuple[TcpProxy, str]]:
    """A proxy in front of the Postgres of `database_url`, and the URL that goes through it."""
    proxy = TcpProxy(postgres_upstream(database_url)).start()
    try:
        yield proxy, via_proxy(database_url, proxy)
    finally:
        proxy.close()
