"""The fleet's history against real Redis: gateways sampling it race for each interval and
write it once, it is trimmed by age, its tokens per second are qt_tokens' difference, and the
dashboard's endpoint returns what was sampled."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from fastapi.testclient import TestClient
from procs import lora_deployment, make_key, queue_pings, running_workers

from queue_tinker import types
from queue_tinker.client import ServiceClient
from queue_tinker.gateway.app import create_app
from queue_tinker.queue.connection import RedisClient, connect
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.observe import history
from queue_tinker.queue.observe.history import read_history, redis_now_ms, take_sample
from queue_tinker.settings import Settings

API = "/api/v1/dashboard"


def sampled(settings: Settings, every_s: float, keep_s: float = 3_600) -> Settings:
    return settings.model_copy(
        update={"history_interval_s": every_s, "history_retention_s": keep_s}
    )


def stream_ms(settings: Settings, key: str) -> list[int]:
    """The sample times (ms) a history stream holds, oldest first."""
    client = redis.Redis.from_url(settings.redis_url or "")
    try:
        return [int(entry_id.split(b"-")[0]) for entry_id, _ in client.xrange(key)]
    finally:
        client.close()


async def with_clients(settings: Settings, count: int) -> list[RedisClient]:
    return [connect(settings.redis_url or "") for _ in range(count)]


def test_racing_samplers_write_each_interval_once(settings: Settings) -> None:
    """Eight samplers on two connections race for each of five intervals: exactly one writes
    each, and the streams hold one sample per interval at the interval's start."""
    config = sampled(settings, 0.5)
    keys = Keys(settings.key_prefix)
    asyncio.run(queue_pings(settings, "tiny", {"m-history": 1}))

    async def race() -> tuple[list[int], list[int]]:
        clients = await with_clients(settings, 2)
        try:
            start = await redis_now_ms(clients[0])
            winners, times = [], []
            for n in range(5):
                at_ms = start + n * 500
                won = await asyncio.gather(
                    *(take_sample(clients[i % 2], keys, config, at_ms) for i in range(8))
                )
                winners.append(sum(won))
                times.append(at_ms // 500 * 500)
            return winners, times
        finally:
            for client in clients:
                await client.aclose()

    winners, times = asyncio.run(race())
    assert winners == [1] * 5
    assert stream_ms(settings, keys.history_fleet()) == times
    assert stream_ms(settings, keys.history_base("tiny")) == times


def test_two_gateways_sample_once_an_interval(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """Two gateway apps, each running its sampler: the history gets one sample every
    interval, on the interval's boundaries, and neither sampler ever failed (a second write
    of an interval would: Redis refuses an entry id at or below the last)."""
    config = sampled(settings, 0.4)
    keys = Keys(settings.key_prefix)
    asyncio.run(queue_pings(settings, "tiny", {"m-history": 1}))
    with caplog.at_level(logging.WARNING), ExitStack() as gateways:
        for _ in range(2):
            gateways.enter_context(TestClient(create_app(config)))
        started = time.time()
        time.sleep(3.3)
        elapsed = time.time() - started
    times = stream_ms(settings, keys.history_fleet())
    assert [r.getMessage() for r in caplog.records if r.name == history.__name__] == []
    assert all(t % 400 == 0 for t in times)
    assert times == list(range(times[0], times[-1] + 1, 400))  # none missed, none twice
    assert len(times) >= int(elapsed / 0.4) - 1
    assert stream_ms(settings, keys.history_base("tiny")) == times


def test_the_sampler_stops_on_its_event_without_a_cancel(settings: Settings) -> None:
    """The gateway's shutdown sets the sampler's event: it ends within an interval on its
    own, so a cancellation redis-py swallows mid-command cannot leave it running."""
    config = sampled(settings, 0.05)

    async def run_then_stop() -> None:
        client = connect(settings.redis_url or "")
        try:
            stopping = asyncio.Event()
            task = asyncio.create_task(
                history.sample_forever(client, Keys(settings.key_prefix), config, stopping)
            )
            await asyncio.sleep(0.3)  # a few samples taken
            stopping.set()
            await asyncio.wait_for(task, timeout=2)
        finally:
            await client.aclose()

    asyncio.run(run_then_stop())
    assert len(stream_ms(settings, Keys(settings.key_prefix).history_fleet())) >= 3


def test_history_is_trimmed_to_its_retention(settings: Settings) -> None:
    """Samples every 100 ms for 3 s with a retention of 1 s: each stream keeps the last
    second (11 samples), expires a retention after its newest, and the history read back is
    that second."""
    config = sampled(settings, 0.1, keep_s=1.0)
    keys = Keys(settings.key_prefix)
    asyncio.run(queue_pings(settings, "tiny", {"m-history": 1}))

    async def sample_three_seconds() -> tuple[int, dict[str, Any], list[int]]:
        client = connect(settings.redis_url or "")
        try:
            # Sample times ending now, so the read's "last retention" is these samples'.
            end = await redis_now_ms(client) // 100 * 100
            for at_ms in range(end - 2_900, end + 1, 100):
                assert await take_sample(client, keys, config, at_ms)
            ttls = [await client.pttl(k) for k in (keys.history_fleet(), keys.history_base("tiny"))]
            return end, await read_history(client, keys, config), ttls
        finally:
            await client.aclose()

    end, read_back, ttls = asyncio.run(sample_three_seconds())
    kept = list(range(end - 1_000, end + 1, 100))
    assert stream_ms(settings, keys.history_fleet()) == kept
    assert stream_ms(settings, keys.history_base("tiny")) == kept
    assert all(0 < ttl <= 1_100 for ttl in ttls)
    read_at = round(read_back["now"] * 1000)
    assert read_back["fleet"]["t"] == [t / 1000 for t in kept if t >= read_at - 1_000]
    assert read_back["fleet"]["t"][-1] == end / 1000


@pytest.fixture
def lora(redis_url: str, database_url: str) -> Iterator[Settings]:
    with lora_deployment(redis_url, database_url, "queue-tinker/tiny-llama") as settings:
        yield settings


def test_tokens_per_second_is_the_counters_difference(lora: Settings) -> None:
    """A forward_backward of a known size between two samples 2 s apart: the second sample's
    tokens per second is its tokens over those 2 s; the first has none (nothing before it)."""
    config = sampled(lora, 2.0)
    keys = Keys(lora.key_prefix)
    tokens = list(range(3, 15))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(tokens[1:]),
            "weights": np.ones(len(tokens) - 1, dtype=np.float32),
        },
    )
    with ServiceClient(lora) as service:
        training = service.create_lora_training_client("queue-tinker/tiny-llama", rank=4)

        async def sample(at_ms: int) -> None:
            client = connect(lora.redis_url or "")
            try:
                assert await take_sample(client, keys, config, at_ms)
            finally:
                await client.aclose()

        start = int(time.time() * 1000) // 2_000 * 2_000
        asyncio.run(sample(start))
        training.forward_backward([datum, datum, datum], "cross_entropy").result(timeout=60)
        asyncio.run(sample(start + 2_000))

        async def read() -> dict[str, Any]:
            client = connect(lora.redis_url or "")
            try:
                return await read_history(client, keys, config)
            finally:
                await client.aclose()

        fleet = asyncio.run(read())["fleet"]
    assert fleet == {  # 3 data of 11 positions each, over 2 s
        "t": [start / 1000, start / 1000 + 2],
        "tokens_per_s": [None, 3 * (len(tokens) - 1) / 2],
    }


def test_the_endpoint_returns_what_was_sampled(settings: Settings, tmp_path: Path) -> None:
    """Two samples of a fleet with a worker on one base model and queued work on another:
    the dashboard's history answers them, to an admin-less key as to any, and 401 without a
    key; base models with no sample are left out."""
    keys = Keys(settings.key_prefix)
    config = sampled(settings, 1.0)
    asyncio.run(queue_pings(settings, "absent", {"m-wait-a": 2, "m-wait-b": 1}))
    with running_workers(settings, 1, tmp_path, base_model="tiny"):

        async def two_samples() -> int:
            client = connect(settings.redis_url or "")
            try:
                start = await redis_now_ms(client) // 1_000 * 1_000
                for at_ms in (start, start + 1_000):
                    assert await take_sample(client, keys, config, at_ms)
                return start
            finally:
                await client.aclose()

        start = asyncio.run(two_samples())
    key = make_key(settings, "someone")
    # This gateway samples nothing itself (0): the endpoint reads what the samplers wrote.
    with TestClient(create_app(sampled(settings, 0.0))) as http:
        assert http.get(f"{API}/history").status_code == 401
        response = http.get(f"{API}/history", headers={"X-API-Key": key})
    assert response.status_code == 200, response.text
    body = response.json()
    times = [start / 1000, start / 1000 + 1]
    assert body["interval_s"] == 0.0 and body["retention_s"] == config.history_retention_s
    assert body["fleet"] == {"t": times, "tokens_per_s": [None, 0.0]}
    by_base = {b["base_model"]: b for b in body["base_models"]}
    assert set(by_base) == {"absent", "tiny"}
    assert by_base["absent"]["t"] == times and by_base["absent"]["depth"] == [3, 3]
    assert by_base["absent"]["workers"] == [0, 0]
    assert all(w >= 0.0 for w in by_base["absent"]["oldest_wait_s"])
    assert by_base["absent"]["oldest_wait_s"][1] >= by_base["absent"]["oldest_wait_s"][0]
    assert by_base["tiny"] == {
        "base_model": "tiny",
        "t": times,
        "depth": [0, 0],
        "oldest_wait_s": [0.0, 0.0],
        "workers": [1, 1],
    }
