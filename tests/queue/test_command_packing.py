"""The asyncio Redis connections pack commands with hiredis (queue/command_packing.py): the same
bytes redis-py's own packer makes, for every kind of argument the queue sends, and the same
errors for what it refuses; the clients connect() makes use them against a real Redis."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import DataError

from queue_tinker.queue.command_packing import (
    HiredisConnection,
    HiredisSSLConnection,
    HiredisUnixConnection,
    pack,
    packed_by_hiredis,
)
from queue_tinker.queue.connection import connect

COMMANDS: list[tuple[object, ...]] = [
    ("SET", "key", b"\x00\xffbinary", 7),
    ("EVALSHA", "a" * 40, 2, "k1", b"k2", 0.1, 1e-05, 2.5, -3, 10**20, "é ünïcode"),
    ("SCRIPT LOAD", "return 1"),  # a command name of two words
    (b"CONFIG GET", b"maxmemory"),
    ("XADD", "stream", "*", "payload", b"x" * 100_000, "n", 0),  # past the chunking cutoff
    ("SET", "k", memoryview(b"view")),
    ("SET", "k", bytearray(b"bytearray")),  # hiredis refuses it: redis-py packs it
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: str(c[0]))
def test_packed_bytes_equal_redis_pys_own(command: tuple[object, ...]) -> None:
    theirs = b"".join(bytes(part) for part in Connection().pack_command(*command))  # type: ignore[arg-type]
    ours = b"".join(bytes(part) for part in HiredisConnection().pack_command(*command))  # type: ignore[arg-type]
    assert ours == theirs
    if not isinstance(command[-1], bytearray):
        assert pack(command) == theirs  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [None, True, object()])
def test_what_redis_py_refuses_is_refused_alike(bad: object) -> None:
    with pytest.raises(DataError, match="Invalid input of type"):
        HiredisConnection().pack_command("SET", "k", bad)  # type: ignore[arg-type]


def test_every_connection_kind_of_a_url_packs_with_hiredis() -> None:
    assert packed_by_hiredis(Connection) is HiredisConnection
    assert packed_by_hiredis(SSLConnection) is HiredisSSLConnection
    assert packed_by_hiredis(UnixDomainSocketConnection) is HiredisUnixConnection
    assert packed_by_hiredis(HiredisConnection) is HiredisConnection  # another class: as it is


def test_the_queues_clients_talk_to_redis_through_it(redis_url: str) -> None:
    """Commands, a pipeline of scripts and pub/sub through a client connect() made."""

    async def run() -> None:
        client = connect(redis_url)
        try:
            assert client.connection_pool.connection_class is HiredisConnection
            key = "qt-test:command-packing"
            value = bytes(range(256)) * 100
            await client.set(key, value, ex=60)
            assert await client.get(key) == value
            script = client.register_script("return {KEYS[1], ARGV[1], tonumber(ARGV[2]) * 2}")
            async with client.pipeline(transaction=False) as pipe:
                for i in range(3):
                    pipe.evalsha(await client.script_load(script.script), 1, key, "é", i + 0.5)
                replies = await pipe.execute()
            assert replies == [[key.encode(), "é".encode(), 2 * i + 1] for i in range(3)]
            pubsub = client.pubsub()
            await pubsub.subscribe("qt-test:command-packing:channel")
            await client.publish("qt-test:command-packing:channel", b"\x00message")
            message = None
            while message is None or message["type"] != "message":
                message = await pubsub.get_message(timeout=5)
                assert message is not None
            assert message["data"] == b"\x00message"
            await pubsub.aclose()
            await client.delete(key)
        finally:
            await client.aclose()

    asyncio.run(run())
