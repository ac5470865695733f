"""A Redis that fails over, made of real processes on loopback: a primary, replicas, and
Sentinels watching them (redis-server --sentinel), with timeouts of about a second so a
failover takes a few seconds."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis
from procs import REDIS_SERVER, RedisServer, free_port

SERVICE = "qt"
DOWN_AFTER_MS = 1_000
FAILOVER_TIMEOUT_MS = 3_000


class SentinelServer:
    """One Sentinel watching the primary on `primary_port` (it rewrites its own config file)."""

    def __init__(self, data_dir: Path, primary_port: int) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        data_dir.mkdir(parents=True, exist_ok=True)
        config = data_dir / "sentinel.conf"
        config.write_text(
            "\n".join(
                [
                    f"port {self.port}",
                    "bind 127.0.0.1",
                    f"dir {data_dir}",
                    f"logfile {data_dir / 'sentinel.log'}",
                    f"sentinel monitor {SERVICE} 127.0.0.1 {primary_port} 2",
                    f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}",
                    f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}",
                    f"sentinel parallel-syncs {SERVICE} 2",
                    "",
                ]
            )
        )
        self.proc = subprocess.Popen(
            [REDIS_SERVER, str(config), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def primary_port(self) -> int | None:
        """The port this Sentinel names as the primary now."""
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=1)
        try:
            found = client.sentinel_get_master_addr_by_name(SERVICE)
            return int(found[1]) if found else None
        except redis.RedisError:
            return None
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class RedisSet:
    """The servers (the first started as the primary) and the Sentinels watching them."""

    servers: list[RedisServer]
    sentinels: list[SentinelServer] = field(default_factory=list)

    def url(self, replicas: int = 1, timeout_ms: int = 500) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return (
            f"redis+sentinel://{hosts}/{SERVICE}/0?replicas={replicas}"
            f"&replica_timeout_ms={timeout_ms}"
        )

    def primary(self) -> RedisServer:
        """The server the Sentinels agree is the primary now."""
        ports = {s.primary_port() for s in self.sentinels}
        (port,) = ports
        return next(server for server in self.servers if server.port == port)

    def wait_for_failover(self, old: RedisServer, timeout: float = 30) -> RedisServer:
        """Block until every Sentinel names a new primary other than `old`; that server."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ports = {s.primary_port() for s in self.sentinels}
            if len(ports) == 1 and None not in ports and old.port not in ports:
                return self.primary()
            time.sleep(0.1)
        raise TimeoutError(f"no failover from port {old.port} within {timeout:.0f} s")

    def wait_until_replicated(self, count: int, timeout: float = 30) -> None:
        """Block until the primary has `count` replicas online (their first sync done)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            port = self.primary().port if self.sentinels else self.servers[0].port
            client = redis.Redis(port=port, socket_timeout=1)
            try:
                info = client.info("replication")
                online = [
                    k
                    for k, v in info.items()
                    if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online"
                ]
                if len(online) >= count:
                    return
            except redis.RedisError:
                pass
            finally:
                client.close()
            time.sleep(0.1)
        raise TimeoutError(f"the primary has fewer than {count} replicas after {timeout:.0f} s")


@contextmanager
def redis_set(root: Path, replicas: int = 2, sentinels: int = 3) -> Iterator[RedisSet]:
    """A primary, `replicas` replicas and `sentinels` Sentinels; all stopped on the way out."""
    with ExitStack() as stack:
        primary = RedisServer(root / "redis-0")
        primary.start()
        stack.callback(lambda: primary.proc is not None and primary.stop())
        found = RedisSet([primary])
        for i in range(replicas):
            replica = RedisServer(root / f"redis-{i + 1}", replica_of=primary.port)
            replica.start()
            stack.callback(lambda r=replica: r.proc is not None and r.stop())  # type: ignore[misc]
            found.servers.append(replica)
        found.wait_until_replicated(replicas)
        for i in range(sentinels):
            sentinel = SentinelServer(root / f"sentinel-{i}", primary.port)
            stack.callback(sentinel.stop)
            found.sentinels.append(sentinel)
        deadline = time.monotonic() + 20
        while {s.primary_port() for s in found.sentinels} != {primary.port}:
            assert time.monotonic() < deadline, "the Sentinels did not agree on the primary"
            time.sleep(0.1)
        yield found
