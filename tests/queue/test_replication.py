"""Writes a replica holds before they are acknowledged (QT_REDIS_URL `?replicas=`), against a
real primary and replicas watched by Sentinels: an enqueue returns once a replica has the op,
a result wakes its future only once a replica has it, and with no replica left a write is
refused as an outage rather than acknowledged."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
from procs import RedisServer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis_ha import RedisSet, redis_set

from queue_tinker.queue.connection import connect, target
from queue_tinker.queue.dispatch.dispatcher import Dispatcher, Outcome
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.ops.jobs import JobQueue
from queue_tinker.queue.results.listener import ResultListener
from queue_tinker.types import JobStatus, OpKind

PAUSE_S = 1.0


@pytest.fixture(scope="module")
def ha(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisSet]:
    with redis_set(tmp_path_factory.mktemp("ha"), replicas=1, sentinels=1) as found:
        yield found


def test_the_sentinel_url_names_the_sentinels_the_service_and_the_replicas() -> None:
    """The documented form, read back; a bad one says what it expected."""
    found = target("redis+sentinel://:pw@s1:26380,s2/qt/2?replicas=1&replica_timeout_ms=250")
    assert found.sentinels == (("s1", 26380), ("s2", 26379))
    assert (found.service, found.db, found.password) == ("qt", 2, "pw")
    assert (found.replication.replicas, found.replication.timeout_ms) == (1, 250)
    assert target("redis://h:1/0?replicas=2").url == "redis://h:1/0"
    with pytest.raises(ValueError, match="host:port"):
        target("redis+sentinel://s1:26379")


@contextmanager
def stopped_for(server: RedisServer, seconds: float) -> Iterator[None]:
    """The server stopped (SIGSTOP: it takes no replication stream) for `seconds` from now,
    then let go again, in the background."""
    assert server.proc is not None
    server.proc.send_signal(signal.SIGSTOP)
    timer = threading.Timer(
        seconds, lambda: server.proc and server.proc.send_signal(signal.SIGCONT)
    )
    timer.start()
    try:
        yield
    finally:
        timer.join()


async def test_an_op_and_its_result_wait_for_a_replica_before_anyone_hears_of_them(
    ha: RedisSet, key_prefix: str
) -> None:
    """Through the Sentinels' primary with replicas=1, the replica stopped for PAUSE_S: the
    enqueue returns only once it is back and holds the op, and the published result wakes its
    future only once the replica holds the result too."""
    keys = Keys(key_prefix)
    client = connect(ha.url(replicas=1, timeout_ms=200))
    replica_server = next(s for s in ha.servers if s is not ha.primary())
    replica = redis.Redis(port=replica_server.port)
    try:
        jobs = JobQueue(client, keys, result_ttl_s=60)
        await jobs.register_model(
            "m", base_model="b", tenant_id="t", session_id=None, lora_config={}
        )
        with stopped_for(replica_server, PAUSE_S):
            began = time.monotonic()
            enqueued = await jobs.enqueue("m", OpKind.PING, b"x", job_id="j1")
            assert time.monotonic() - began >= PAUSE_S * 0.9, "acknowledged without a replica"
        assert replica.exists(keys.job(enqueued.job_id))
        listener = ResultListener(client, keys, jobs)
        waiting = asyncio.ensure_future(listener.wait("j1", "m"))
        worker = Dispatcher(
            client, keys, worker_id="w", base_model="b", lease_ttl_ms=5_000, result_ttl_s=60
        )
        lease = await worker.claim("m")
        assert lease is not None
        (op,) = await worker.read_range("m", 0, 1)
        with stopped_for(replica_server, PAUSE_S):
            began = time.monotonic()
            await worker.publish(lease, op, Outcome(JobStatus.DONE, result=b"ok"), trim_upto=None)
            outcome = await asyncio.wait_for(waiting, 10)
            assert time.monotonic() - began >= PAUSE_S * 0.9, "woken before a replica had it"
        assert outcome.result == b"ok"
        assert replica.hget(keys.job("j1"), "status") == b"done"
        await listener.close()
    finally:
        replica.close()
        await client.aclose()


async def test_with_no_replica_to_hold_it_a_write_is_an_outage_not_an_acknowledgement(
    tmp_path: Path, key_prefix: str
) -> None:
    """replicas=1 against a primary whose one replica is down: the enqueue raises Redis's
    connection error (which callers ride out as an outage) after its WAITs, never returns."""
    with redis_set(tmp_path, replicas=1, sentinels=1) as lone:
        next(s for s in lone.servers if s is not lone.primary()).stop()
        client = connect(lone.url(replicas=1, timeout_ms=50))
        try:
            jobs = JobQueue(client, Keys(key_prefix), result_ttl_s=60)
            with pytest.raises(RedisConnectionError, match="replica"):
                await jobs.register_model(
                    "m", base_model="b", tenant_id="t", session_id=None, lora_config={}
                )
        finally:
            await client.aclose()
