"""Hosts of their own for tests: a network namespace per host, joined to the root namespace by
a veth pair on a private link-local /30, with a TCP forwarder in this process that carries the
host's connections to the services on 127.0.0.1 (Redis, Postgres and the S3 server listen
there only). A host reaches nothing else: no shared loopback, no shared disk (each gets its own
data directory). Cutting a host's link (`ip link set ... down` on the root side) leaves its
processes running and its connections open, as a partition does."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import random
import shutil
import subprocess
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from queue_tinker.local.processes import pid_alive

IP = shutil.which("ip") or "/usr/sbin/ip"
NAME_PREFIX = "qtnh"  # namespaces named qtnh<pid>x<hex>: a dead pid marks one left by an abort
COMMAND_TIMEOUT_S = 10.0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [IP, *args], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=check
    )


def why_not_available() -> str | None:
    """None where this process can make namespaces and veth pairs; else why not (a skip
    reason)."""
    if not os.path.exists(IP):
        return "no `ip` command (iproute2) to make network namespaces"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_NET_ADMIN)"
    probe = f"{NAME_PREFIX}{os.getpid()}xprobe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def sweep_abandoned() -> None:
    """Delete the namespaces (and so their veth pairs) of test runs whose process is gone."""
    listed = _ip("netns", "list", check=False).stdout.split()
    for name in listed:
        pid = name.removeprefix(NAME_PREFIX).split("x", 1)[0]
        if name.startswith(NAME_PREFIX) and pid.isdigit() and not pid_alive(int(pid)):
            _ip("netns", "del", name, check=False)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /30 of 169.254.0.0/16 that no address of the root namespace is in (parallel runs
    pick their own)."""
    used = _ip("-4", "-o", "addr", "show", check=False).stdout
    taken = [
        ipaddress.ip_interface(word).network
        for line in used.splitlines()
        for word in line.split()
        if "/" in word and word[0].isdigit()
    ]
    for _ in range(100):
        subnet = ipaddress.ip_network(
            f"169.254.{random.randint(1, 254)}.{4 * random.randint(0, 63)}/30"
        )
        if not any(subnet.overlaps(other) for other in taken):
            return subnet
    raise RuntimeError("no free link-local /30 for a test host")


@dataclass
class Host:
    """One namespace: `gateway` is the root side's address (where the forwarder listens),
    `address` the host's own."""

    namespace: str
    root_link: str
    gateway: str
    address: str

    def command(self, *argv: str) -> list[str]:
        """argv run inside the host's namespace (`ip netns exec` execs it: same pid)."""
        return [IP, "netns", "exec", self.namespace, *argv]

    def cut(self) -> None:
        """Take the host's link down: its packets go nowhere until restore()."""
        _ip("link", "set", self.root_link, "down")

    def restore(self) -> None:
        _ip("link", "set", self.root_link, "up")


@contextlib.contextmanager
def host(label: str) -> Iterator[Host]:
    """A fresh namespace joined by a veth pair; deleted (with the pair) on the way out, also
    when the test fails."""
    sweep_abandoned()
    tag = uuid.uuid4().hex[:6]
    namespace = f"{NAME_PREFIX}{os.getpid()}x{tag}{label}"
    root_link, host_link = f"qtr{tag}{label}"[:15], f"qth{tag}{label}"[:15]
    subnet = _free_subnet()
    gateway, address = (str(a) for a in list(subnet.hosts())[:2])
    _ip("netns", "add", namespace)
    try:
        _ip("link", "add", root_link, "type", "veth", "peer", "name", host_link, "netns", namespace)
        _ip("addr", "add", f"{gateway}/30", "dev", root_link)
        _ip("link", "set", root_link, "up")
        _ip("-n", namespace, "addr", "add", f"{address}/30", "dev", host_link)
        _ip("-n", namespace, "link", "set", host_link, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        yield Host(namespace, root_link, gateway, address)
    finally:
        _ip("netns", "del", namespace, check=False)  # takes the veth pair with it
        _ip("link", "del", root_link, check=False)


@dataclass
class Forwarder:
    """TCP forwarding from (gateway address, port) to 127.0.0.1 ports, on an event loop of its
    own thread. stop() closes the listeners and every connection."""

    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    _servers: list[asyncio.Server] = field(default_factory=list)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.loop.run_forever, name="qt-netns-forwarder")
        self._thread.start()

    def listen(self, address: str, port: int, target_port: int) -> None:
        """Accept on address:port, connect each to 127.0.0.1:target_port."""

        async def start() -> asyncio.Server:
            return await asyncio.start_server(
                lambda r, w: self._pipe(r, w, target_port), address, port
            )

        server = asyncio.run_coroutine_threadsafe(start(), self.loop).result(COMMAND_TIMEOUT_S)
        self._servers.append(server)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, target_port: int
    ) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._copy(reader, up_writer), self._copy(up_reader, writer))

    async def _copy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    def stop(self) -> None:
        async def close() -> None:
            for server in self._servers:
                server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread is not None:
            asyncio.run_coroutine_threadsafe(close(), self.loop).result(COMMAND_TIMEOUT_S)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(COMMAND_TIMEOUT_S)
        self.loop.close()


def through(url: str, gateway: str) -> str:
    """`url` (a redis://, postgresql:// or http:// URL on 127.0.0.1) as a host behind
    `gateway` reaches it: the same port on the gateway address."""
    parts = urlsplit(url)
    netloc = parts.netloc.replace(parts.hostname or "", gateway, 1)
    return urlunsplit(parts._replace(netloc=netloc))


def port_of(url: str, default: int) -> int:
    return urlsplit(url).port or default
