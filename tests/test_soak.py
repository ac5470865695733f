"""A short soak (bench/soak.py is the long one): 20 clients over 50 models for 15 s against
real worker processes. No future gets stuck, every op is done exactly once, and the workers'
memory does not grow with the ops they run."""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
import threading
import time
from collections import defaultdict
from pathlib import Path

import redis
from procs import running_workers

from queue_tinker.client import ServiceClient, TrainingClient
from queue_tinker.queue.keys import Keys
from queue_tinker.settings import Settings

CLIENTS, MODELS, SECONDS = 20, 50, 15.0
RATE = 12.0  # pings per second per client, at random (Poisson) times: 240/s in all
DELAYS_MS = (0, 0, 0, 1, 5)  # mostly inline (the queue's own cost), some on the compute thread
STUCK_AFTER_S = 60.0  # a future unresolved this long is stuck, whatever the machine's load
WARM_UP_S = 5.0
# Worker memory may grow steadily by this much after the warm-up (steady_growth_mib).
# Measured here with two busy cores beside the test: 0.08-0.16 MiB in 6 runs, where the plain
# growth (last sample minus the first) was 0.09-1.16 MiB (1.56 in one CI run): the allocator
# takes a new heap or arena in one step of up to ~1 MiB. With a leak of 2 KB per op put into
# the worker on purpose (about 1,200 ops each after the warm-up): 2.6-3.0 MiB in 3 runs.
MAX_GROWTH_MIB = 1.0


class Rss:
    """VmRSS of some processes, sampled every half second on a thread."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.samples: list[tuple[float, list[int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Rss:
        self._began = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.samples.append(
                (time.monotonic() - self._began, [self._rss(pid) for pid in self.pids])
            )
            if self._stop.wait(0.5):
                return

    @staticmethod
    def _rss(pid: int) -> int:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError(f"no VmRSS for {pid}")

    def steady_growth_mib(self, after_s: float) -> list[float]:
        """Per process: the median growth from one sample to the next after `after_s`, times
        the number of steps. A leak grows the RSS at every step; the allocator taking a new
        heap or arena grows it once, which the median leaves out."""
        rows = [s for t, s in self.samples if t >= after_s]
        return [
            statistics.median(b[i] - a[i] for a, b in itertools.pairwise(rows))
            * (len(rows) - 1)
            / 2**20
            for i in range(len(self.pids))
        ]


class Tally:
    def __init__(self) -> None:
        self.job_ids: list[str] = []
        self.seqs: defaultdict[str, list[int]] = defaultdict(list)
        self.stuck: list[str] = []
        self.wrong: list[str] = []


async def one_client(
    models: list[TrainingClient], deadline: float, rng: random.Random, tally: Tally
) -> None:
    async def ping(tc: TrainingClient, n: int) -> None:
        future = await tc.ping_async(n, delay_ms=rng.choice(DELAYS_MS))
        try:
            result = await future.result_async(timeout=STUCK_AFTER_S)
        except TimeoutError:
            tally.stuck.append(future.request_id)
            return
        tally.job_ids.append(future.request_id)
        tally.seqs[tc.model_id].append(result["seq"])
        if result["data"] != n:
            tally.wrong.append(future.request_id)

    tasks, n, next_at = [], 0, time.monotonic()
    while next_at < deadline:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))  # the next arrival
        next_at += rng.expovariate(RATE)
        tasks.append(asyncio.create_task(ping(models[n % len(models)], n)))
        n += 1
    await asyncio.gather(*tasks)


async def soak(services: list[ServiceClient], tally: Tally) -> None:
    models = [
        await services[i % CLIENTS].create_lora_training_client_async("tiny", rank=4)
        for i in range(MODELS)
    ]
    deadline = time.monotonic() + SECONDS
    rng = random.Random(5)
    await asyncio.gather(
        *[
            one_client(models[c::CLIENTS], deadline, random.Random(rng.random()), tally)
            for c in range(CLIENTS)
        ]
    )


def not_done_once(settings: Settings, job_ids: list[str]) -> tuple[int, int]:
    """(jobs whose hash is not done with attempts 1, pings published)."""
    keys = Keys(settings.key_prefix)
    client = redis.Redis.from_url(settings.redis_url or "")
    try:
        pipe = client.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(keys.job(job_id), ["status", "attempts"])
        bad = sum(1 for fields in pipe.execute() if fields != [b"done", b"1"])
        return bad, int(client.hget(keys.metrics_ops(), "ping|done") or 0)  # type: ignore[arg-type]
    finally:
        client.close()


def test_twenty_clients_over_fifty_models(settings: Settings, tmp_path: Path) -> None:
    """20 clients over 50 models for 15 s, two queue-only workers: no future stuck, every ping
    answered with its own data, run and published exactly once (attempts 1, each model's
    results numbered without a gap or a repeat), and worker memory flat after the warm-up."""
    tally = Tally()
    with running_workers(settings, 2, tmp_path) as workers:
        services = [ServiceClient(settings) for _ in range(CLIENTS)]
        try:
            with Rss([w.pid for w in workers]) as rss:
                asyncio.run(soak(services, tally))
        finally:
            for service in services:
                service.close()
    assert tally.stuck == [] and tally.wrong == []
    assert len(tally.job_ids) > CLIENTS * RATE * SECONDS / 2
    assert not_done_once(settings, tally.job_ids) == (0, len(tally.job_ids))
    assert len(tally.seqs) == MODELS
    for seqs in tally.seqs.values():
        assert sorted(seqs) == list(range(2, len(seqs) + 2))
    growth = rss.steady_growth_mib(WARM_UP_S)
    assert max(growth) < MAX_GROWTH_MIB, f"worker RSS grew {growth} MiB over {rss.samples}"
