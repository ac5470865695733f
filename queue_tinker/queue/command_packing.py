"""Commands packed by hiredis on the asyncio connections.

redis-py's asyncio connections pack every command in Python (its sync connections use hiredis
when it is installed, as these do): an isinstance and an encode per argument, and a publish
script carries some twenty. hiredis packs the same bytes (tests/queue/test_command_packing.py)
in 3.4 µs where redis-py takes 16 µs for a forward_backward's publish (this 2-core VM): about
0.1 ms of event-loop CPU per training step on a worker, taken from the compute beside it.
"""

from __future__ import annotations

from typing import Any, cast

import hiredis
from redis.asyncio.connection import (
    AbstractConnection,
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
)
from redis.typing import EncodableT


def pack(args: tuple[EncodableT, ...]) -> bytes | None:
    """One command in the Redis protocol, as redis-py packs it (a first argument with spaces,
    "SCRIPT LOAD", split into words); None for arguments hiredis does not take (bytearray,
    and what redis-py refuses too): redis-py packs those, or says what is wrong."""
    first = args[0]
    if isinstance(first, str):
        args = (*first.encode().split(), *args[1:])
    elif isinstance(first, bytes) and b" " in first:
        args = (*first.split(), *args[1:])
    try:
        return bytes(hiredis.pack_command(cast(Any, args)))
    except TypeError:
        return None


class _HiredisPacking(AbstractConnection):
    def pack_command(self, *args: EncodableT) -> list[bytes]:
        packed = pack(args)
        return [packed] if packed is not None else super().pack_command(*args)


class HiredisConnection(_HiredisPacking, Connection):
    pass


class HiredisSSLConnection(_HiredisPacking, SSLConnection):
    pass


class HiredisUnixConnection(_HiredisPacking, UnixDomainSocketConnection):
    pass


PACKED_BY_HIREDIS: dict[type[AbstractConnection], type[AbstractConnection]] = {
    Connection: HiredisConnection,
    SSLConnection: HiredisSSLConnection,
    UnixDomainSocketConnection: HiredisUnixConnection,
}


def packed_by_hiredis(connection_class: type[AbstractConnection]) -> type[AbstractConnection]:
    """The connection class a URL chose, packing with hiredis (another class: as it is)."""
    return PACKED_BY_HIREDIS.get(connection_class, connection_class)
