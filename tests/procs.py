"""Real worker processes for tests: started with the test's settings, stopped with SIGTERM."""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import httpx
import pytest
import redis
import tinker

from queue_tinker.queue.connection import connect, connect_sync
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.ops.jobs import JobQueue
from queue_tinker.settings import Settings, settings_env
from queue_tinker.store import api_keys
from queue_tinker.store.db import make_engine, session_factory
from queue_tinker.types import OpKind

REPO = Path(__file__).resolve().parent.parent
TASK_DUMP = Path(__file__).resolve().parent / "task_dump"

# For modules that drive the official tinker SDK: its clients close their HTTP connections from
# a background loop after a test has moved on, and the sockets they leave to the collector are
# the SDK's, not ours. conftest's sdk_sockets_collected collects them after each test, so no
# later test inherits the warnings.
SDK_CLIENT_MARKS = [
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
    pytest.mark.usefixtures("sdk_sockets_collected"),
]


def close_sdk_clients() -> None:
    """Close every tinker SDK client still open. The tinker-cookbook's loops make their own
    and never close them; their background threads would go on heart-beating a gateway that
    is gone, and after two minutes warn about it into whatever stream the log points at."""
    from tinker.lib.internal_client_holder import InternalClientHolder

    for holder in [o for o in gc.get_objects() if issubclass(type(o), InternalClientHolder)]:
        holder.close()


# How long an SDK client's close may take before its tasks are cancelled once more.
SDK_CLOSE_S = 30.0


@contextmanager
def sdk_client(base_url: str, api_key: str) -> Iterator[tinker.ServiceClient]:
    """The official tinker SDK's ServiceClient, closed on the way out as its own `with` block
    closes it ("success", or "errored" when the block raised), but bounded: close_sdk_client."""
    client = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    status: Literal["success", "errored"] = "errored"
    try:
        yield client
        status = "success"
    finally:
        close_sdk_client(client, status)


def close_sdk_client(client: tinker.ServiceClient, status: Literal["success", "errored"]) -> None:
    """Close an SDK client, waiting at most SDK_CLOSE_S. Its close cancels the client's
    background tasks and awaits them; under Python 3.11 a cancellation that arrives just as
    the awaited call completes can be lost (asyncio.wait_for, fixed in 3.12), and the close
    then waits forever for a task that goes on. Past SDK_CLOSE_S the client's tasks are
    printed and cancelled once more; a close still not done after that fails the test (the
    stack printed says what it waits on: an answer the gateway owes is ours to fix)."""
    closing = client.close(status)
    try:
        closing.result(SDK_CLOSE_S)
        return
    except TimeoutError:
        pass
    # The SDK's own attributes (tinker 0.38, pinned): the tasks its close cancels and awaits.
    holder = client._session_holder or client._rest_holder
    assert holder is not None
    tasks = [
        task
        for task in (
            holder._session_heartbeat_task,
            holder._client_dynamic_config_refresh_task,
            holder._cancel_drain_task,
            *holder._futures_poller_tasks,
        )
        if task is not None and not task.done()
    ]
    print(f"SDK close still waiting after {SDK_CLOSE_S:.0f} s; its loop's tasks:", file=sys.stderr)
    for task in asyncio.all_tasks(holder._loop):
        print(f"    {task!r}", file=sys.stderr)
        task.print_stack(limit=8, file=sys.stderr)
    for task in tasks:
        holder._loop.call_soon_threadsafe(task.cancel)
    closing.result(SDK_CLOSE_S)
    print(f"SDK close done after a second cancellation of {len(tasks)} tasks", file=sys.stderr)


def child_env(settings: Settings) -> dict[str, str]:
    """The environment that makes a child process see the same settings."""
    env = settings_env(settings, os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a hung worker killed with SIGABRT dumps its stacks
    return env


def run_script(
    args: list[str], env: dict[str, str], timeout: float, logs: Sequence[Path] = ()
) -> subprocess.CompletedProcess[str]:
    """Run a Python script to its end. One still running after `timeout` (kept under the
    test's own limit) is sent SIGUSR1, so tests/task_dump prints its asyncio tasks, then
    SIGABRT, so faulthandler prints where each of its threads waits, and the test fails with
    that, its output so far and the tails of `logs`."""
    python_path = os.pathsep.join(p for p in (str(TASK_DUMP), env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, *args],
        env={**env, "PYTHONFAULTHANDLER": "1", "PYTHONPATH": python_path},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        proc.send_signal(signal.SIGABRT)
        out, err = proc.communicate()
        tails = "".join(
            f"\n--- {log} ---\n{log.read_text(errors='replace')[-6000:]}"
            for log in logs
            if log.exists()
        )
        pytest.fail(
            f"{args[0]} ran past {timeout} s\n--- stdout ---\n{out[-4000:]}\n"
            f"--- stderr ---\n{err[-12000:]}{tails}"
        )
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def aborted_by_the_sdk_at_exit(proc: subprocess.CompletedProcess[str]) -> bool:
    """Whether a script on the tinker SDK was aborted after its end by the SDK's HTTP transport.
    pyqwest (0.12, the SDK's default) hands results to the SDK's event loop from its tokio
    threads; one that does so while the interpreter shuts down takes the GIL, Python ends that
    thread with pthread_exit, and glibc aborts the process when the unwinding meets its Rust
    frames (gdb: tokio-rt-worker, take_gil -> PyThread_exit_thread -> __pthread_unwind ->
    abort). faulthandler then lists Python's threads with no current one and no Python frame:
    the abort came from a thread Python does not know, after the script's last line."""
    if proc.returncode != -signal.SIGABRT or "Fatal Python error: Aborted" not in proc.stderr:
        return False
    dump = proc.stderr.split("Fatal Python error: Aborted", 1)[1]
    return "Current thread" not in dump and 'File "' not in dump and "<no Python frame>" in dump


class WorkerProcess:
    def __init__(
        self,
        settings: Settings,
        base_model: str,
        log_path: Path,
        engine: str = "queue-only",
        ranks: int = 1,
        wrapper: Sequence[str] = (),
    ) -> None:
        """`wrapper`: argv the worker's command runs under and that execs it (so `pid` is the
        worker's), e.g. `ip netns exec <namespace>` for a host of its own."""
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            [
                *wrapper,
                sys.executable,
                "-m",
                "queue_tinker.cli",
                "worker",
                "--base-model",
                base_model,
                "--device",
                "cpu",
                "--engine",
                engine,
                f"--ranks={ranks}",  # > 1: a sharded worker group, this process its launcher
            ],
            env=child_env(settings),
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def children(self) -> list[int]:
        """Pids of the process's children (a worker group's ranks, rank 0 first)."""
        text = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text()
        return [int(pid) for pid in text.split()]

    def stop(self, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # in case a test left it stopped
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGABRT)
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def wait_for_workers(settings: Settings, count: int, timeout: float = 30) -> list[str]:
    """Block until `count` workers are registered; their ids."""
    client = connect_sync(settings.redis_url or "")  # a plain or a Sentinel URL
    keys = Keys(settings.key_prefix)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ids = [w.decode() for w in client.zrange(keys.workers(), 0, -1)]
            if len(ids) >= count:
                return ids
            time.sleep(0.05)
    finally:
        client.close()
    raise TimeoutError(f"only saw fewer than {count} workers register within {timeout}s")


@contextmanager
def running_workers(
    settings: Settings, count: int, log_dir: Path, base_model: str = "tiny"
) -> Iterator[list[WorkerProcess]]:
    procs = [WorkerProcess(settings, base_model, log_dir / f"worker-{i}.log") for i in range(count)]
    try:
        wait_for_workers(settings, count)
        yield procs
    finally:
        codes = [p.stop() for p in procs]
        for proc, code in zip(procs, codes, strict=True):
            assert code == 0, f"worker exited with {code}:\n{proc.log()[-3000:]}"


def assert_nothing_dead_lettered(redis_url: str, key_prefix: str) -> None:
    """Nothing the service accepted may end on the dead-letter stream (records Postgres
    refused): checked when every deployment and every test's key prefix is torn down, so the
    fault, fuzz and hostile-input suites all hold to it."""
    client = connect_sync(redis_url)
    try:
        dead = client.xrange(Keys(key_prefix).dead_records(), count=5)
    finally:
        client.close()
    assert not dead, f"records were dead-lettered: {dead}"


@contextmanager
def lora_deployment(
    redis_url: str,
    database_url: str,
    base_model: str,
    also: tuple[str, ...] = (),
    **overrides: object,
) -> Iterator[Settings]:
    """Settings of a deployment with one LoRA worker on `base_model`, and one on each model of
    `also` (for a test module: torch loads in seconds, not milliseconds); its keys and files
    are removed afterwards."""
    data_dir = Path(tempfile.mkdtemp(prefix="qt-lora-"))
    options: dict[str, object] = {
        "lease_ttl_ms": 3_000,
        "heartbeat_ms": 500,
        "linger_ms": 60_000,
        **overrides,
    }
    settings = Settings(
        redis_url=redis_url,
        database_url=database_url,
        key_prefix=f"qt-test-{uuid.uuid4().hex[:10]}",
        data_dir=data_dir,
        **options,
    )  # type: ignore[arg-type]
    logs = [data_dir / "worker.log"] + [data_dir / f"worker-{i + 1}.log" for i in range(len(also))]
    workers = [
        WorkerProcess(settings, model, log, engine="lora")
        for model, log in zip((base_model, *also), logs, strict=True)
    ]
    try:
        wait_for_workers(settings, len(workers), timeout=90)
        yield settings
        assert_nothing_dead_lettered(redis_url, settings.key_prefix)
    finally:
        codes = [worker.stop() for worker in workers]
        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(match=f"{settings.key_prefix}:*", count=1000):
            client.delete(key)
        client.close()
        failed = [(code, worker.log()) for code, worker in zip(codes, workers, strict=True) if code]
        shutil.rmtree(data_dir, ignore_errors=True)
        assert not failed, failed[0][1][-12000:]


def failover_settings(
    redis_url: str, database_url: str, key_prefix: str, tmp_path: Path, **overrides: int
) -> Settings:
    """A deployment whose dead worker's leases lapse in 2 s (its models move on quickly)."""
    options: dict[str, int] = {"lease_ttl_ms": 2_000, "heartbeat_ms": 400, "linger_ms": 60_000}
    return Settings(
        redis_url=redis_url,
        database_url=database_url,
        key_prefix=key_prefix,
        data_dir=tmp_path / "data",
        **{**options, **overrides},  # type: ignore[arg-type]
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def gateway_process(settings: Settings, log_path: Path) -> Iterator[str]:
    """A `queue-tinker serve` process on the deployment of `settings`; yields its base URL."""
    port = free_port()
    log = log_path.open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "queue_tinker.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        env=child_env(settings),
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/api/v1/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        finally:
            log.close()


@contextmanager
def housekeeper_process(settings: Settings, log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A `queue-tinker housekeeper` process on the deployment of `settings`, stopped (SIGTERM,
    then SIGKILL) on the way out."""
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "queue_tinker.cli", "housekeeper"],
            env=child_env(settings),
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def make_key(settings: Settings, tenant: str) -> str:
    """A new API key (`tml-...`) of `tenant`, created in the deployment's Postgres."""

    async def go() -> str:
        engine = make_engine(settings.database_url or "")
        try:
            return (await api_keys.create_key(session_factory(engine), tenant))[1]
        finally:
            await engine.dispose()

    return asyncio.run(go())


REDIS_SERVER = "/usr/bin/redis-server"


class RedisServer:
    """A redis-server of the test's own (never the machine's Redis on 6379): a free port, a
    temporary directory, append-only persistence as compose runs it. Stop it (SIGTERM: Redis
    writes the AOF and exits) or kill it (SIGKILL), then start it again on the same port and
    directory: it reloads the AOF."""

    def __init__(self, data_dir: Path, replica_of: int | None = None) -> None:
        """`replica_of`: the port of the primary this server replicates (None: a primary)."""
        self.data_dir = data_dir
        self.port = free_port()
        self.replica_of = replica_of
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        self.proc = subprocess.Popen(
            [
                REDIS_SERVER,
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--dir",
                str(self.data_dir),
                "--logfile",
                str(self.data_dir / "redis.log"),
                "--daemonize",
                "no",
                "--save",
                "",
                "--appendonly",
                "yes",
                # fsync before each reply, as compose: with everysec a kill -9 while the disk
                # is busy (a parallel test run) loses acknowledged writes.
                "--appendfsync",
                "always",
                # A replica's first sync starts at once (Redis waits 5 s for others to join).
                "--repl-diskless-sync-delay",
                "0",
                *(
                    ()
                    if self.replica_of is None
                    else ("--replicaof", "127.0.0.1", str(self.replica_of))
                ),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=2)
        deadline = time.monotonic() + timeout
        try:
            while True:  # no event tells us it listens: ask until it answers (10-50 ms)
                assert self.proc.poll() is None, self.log()
                try:
                    # LOADING (reading the AOF) raises BusyLoadingError, a ConnectionError.
                    if int(client.info("server")["process_id"]) == self.proc.pid:
                        return self.url
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
                assert time.monotonic() < deadline, f"redis-server did not start:\n{self.log()}"
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM: Redis flushes the AOF, closes every connection and exits."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final fsync; what is in the AOF is what was written."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        self.proc = None

    def log(self) -> str:
        path = self.data_dir / "redis.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


@contextmanager
def redis_server(data_dir: Path) -> Iterator[RedisServer]:
    server = RedisServer(data_dir)
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def queue_pings(
    settings: Settings, base_model: str, pings: dict[str, int], tenant: str = "default"
) -> None:
    """Register each model (of `tenant`) on `base_model` and queue that many pings on it: work
    waiting in Redis, no worker needed."""
    client = connect(settings.redis_url or "")
    try:
        jobs = JobQueue(client, Keys(settings.key_prefix), result_ttl_s=60)
        for model_id, count in pings.items():
            await jobs.register_model(
                model_id,
                base_model=base_model,
                tenant_id=tenant,
                session_id=None,
                lora_config={"rank": 4},
            )
            for i in range(count):
                await jobs.enqueue(model_id, OpKind.PING, b"", job_id=f"{model_id}-j{i}")
    finally:
        await client.aclose()
