"""Redis restarted with persistence on (append-only, as compose runs it): pending ops resume,
each published once, or their futures fail with a clear error; workers and clients ride the
restart out. Every test runs its own redis-server (never the machine's Redis), stops it with
SIGTERM or kills it with SIGKILL, and starts it again on the same port and directory, so it
reloads its append-only file."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import torch
from procs import RedisServer, WorkerProcess, redis_server, running_workers, wait_for_workers
from sqlalchemy import text
from training_runs import ADAM, BATCHES, TINY, adapter_weights, train

import queue_tinker as tinker
from queue_tinker.client import holder
from queue_tinker.errors import RedisUnavailableError
from queue_tinker.queue.keys import Keys
from queue_tinker.settings import Settings
from queue_tinker.store.db import make_engine

PREFIX = "qt-restart"


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def deployment(
    server: RedisServer, database_url: str, tmp_path: Path, **options: object
) -> Settings:
    values: dict[str, object] = {
        "lease_ttl_ms": 5_000,
        "heartbeat_ms": 500,
        "linger_ms": 60_000,
        **options,
    }
    return Settings(
        redis_url=server.url,
        database_url=database_url,
        key_prefix=PREFIX,
        data_dir=tmp_path / "data",
        **values,
    )  # type: ignore[arg-type]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as started:
        yield started


class Inspect:
    """Reads the test's Redis with a fresh connection each time (it restarts under us)."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server
        self.keys = Keys(PREFIX)

    def _client(self) -> redis.Redis:
        return redis.Redis(port=self.server.port, decode_responses=True)

    def jobs(self, job_ids: list[str]) -> list[dict[str, str]]:
        """The job hashes, without their binary fields."""
        with redis.Redis(port=self.server.port) as client:
            pipe = client.pipeline(transaction=False)
            for job_id in job_ids:
                pipe.hgetall(self.keys.job(job_id))
            return [
                {k.decode(): v.decode() for k, v in f.items() if k not in (b"result", b"payload")}
                for f in pipe.execute()
            ]

    def statuses(self, job_ids: list[str]) -> list[str]:
        return [fields.get("status", "") for fields in self.jobs(job_ids)]

    def results(self, job_ids: list[str]) -> list[bytes | None]:
        with redis.Redis(port=self.server.port) as client:  # results are binary
            return [client.hget(self.keys.job(j), "result") for j in job_ids]  # type: ignore[misc]

    def published(self) -> int:
        """Ops published since the start, by kind and status (publish.lua counts each once)."""
        with self._client() as client:
            return sum(int(n) for n in client.hgetall(self.keys.metrics_ops()).values())

    def workers(self) -> set[str]:
        with self._client() as client:
            return set(client.zrange(self.keys.workers(), 0, -1))


def recorded(database_url: str, job_ids: list[str]) -> dict[str, str]:
    """request id -> status in Postgres."""

    async def go() -> dict[str, str]:
        engine = make_engine(database_url)
        try:
            async with engine.connect() as conn:
                rows = await conn.execute(
                    text("SELECT id, status FROM requests WHERE id = ANY(:ids)"), {"ids": job_ids}
                )
                return {row.id: row.status for row in rows}
        finally:
            await engine.dispose()

    return asyncio.run(go())


def logged(caplog: pytest.LogCaptureFixture, needle: str) -> bool:
    return any(needle in record.getMessage() for record in caplog.records)


def restart_with_ops_pending(
    server: RedisServer,
    how: str,
    clients: list[tinker.TrainingClient],
    workers: list[WorkerProcess],
    caplog: pytest.LogCaptureFixture,
    round_: int,
) -> list[str]:
    """Pings queued and running on every model; Redis stopped (`how`) and started again, with
    one more per model submitted while it is down. Checks every result; returns the request
    ids."""
    look = Inspect(server)
    first_seq = 2 + round_ * 4  # a round: 3 pings per model, then 1 sent during the outage
    submitted = [
        (m, i, c.ping(f"{round_}-{m}-{i}", delay_ms=100))
        for i in range(3)
        for m, c in enumerate(clients)
    ]
    ids = [f.request_id for _, _, f in submitted]
    wait_until(lambda: {"done", "running"} <= set(look.statuses(ids)), "ops done and running")
    done_before = [j for j, s in zip(ids, look.statuses(ids), strict=True) if s == "done"]
    results_before = look.results(done_before)
    logs_before = [len(w.log()) for w in workers]
    caplog.clear()

    server.kill() if how == "kill-9" else server.stop()
    wait_until(
        lambda: all(
            "Redis unreachable" in w.log()[n:] for w, n in zip(workers, logs_before, strict=True)
        ),
        "the workers to notice",
    )
    with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
        during = [pool.submit(clients[m].ping, f"{round_}-{m}-during") for m in range(len(clients))]
        wait_until(lambda: logged(caplog, "Redis unreachable"), "a submit to retry")
        assert not any(f.done() for f in during)
        server.start()
        landed = [f.result(timeout=30) for f in during]

    for m, i, future in submitted:
        assert future.result(timeout=30) == {"data": f"{round_}-{m}-{i}", "seq": first_seq + i}
    for m, future in enumerate(landed):
        assert future.result(timeout=30) == {"data": f"{round_}-{m}-during", "seq": first_seq + 3}
    assert look.results(done_before) == results_before
    assert all(
        "reconnected to Redis" in w.log()[n:] for w, n in zip(workers, logs_before, strict=True)
    )
    assert logged(caplog, "results: reconnected to Redis")
    # The recorders blame the side that was away, not Postgres.
    assert not any(
        "recorder: Postgres" in w.log()[n:] for w, n in zip(workers, logs_before, strict=True)
    )
    return ids + [f.request_id for f in landed]


def test_pending_ops_complete_once_across_restarts(
    server: RedisServer, database_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Ops queued and running when Redis stops (SIGTERM, then kill -9) all complete after it
    comes back, each published once and run once (attempts 1); submits made while it is down
    land; results acknowledged before the restart are still there; the workers carried on
    (same processes, still registered) and the record reached Postgres."""
    caplog.set_level(logging.WARNING)
    settings = deployment(server, database_url, tmp_path)
    look = Inspect(server)
    with (
        running_workers(settings, 2, tmp_path) as workers,
        tinker.ServiceClient(settings) as service,
    ):
        worker_ids = look.workers()
        clients = [service.create_lora_training_client("tiny", rank=4) for _ in range(4)]
        ids = [
            *restart_with_ops_pending(server, "sigterm", clients, workers, caplog, 0),
            *restart_with_ops_pending(server, "kill-9", clients, workers, caplog, 1),
        ]
        jobs = look.jobs(ids)
        assert {(j["status"], j["attempts"]) for j in jobs} == {("done", "1")}, jobs
        assert look.published() == len(ids) + len(clients)  # + each model's create op
        assert look.workers() == worker_ids
        wait_until(
            lambda: recorded(database_url, ids) == dict.fromkeys(ids, "done"),
            "the record in Postgres",
        )


def test_a_lease_lost_during_the_outage_fences_its_worker(
    server: RedisServer, database_url: str, tmp_path: Path
) -> None:
    """Redis down longer than a lease while an op runs: the lease has lapsed in the reloaded
    data, so the worker's publish is refused; the op runs again under a new lease (attempts
    2) and its result is published once."""
    settings = deployment(server, database_url, tmp_path, lease_ttl_ms=1_000, heartbeat_ms=200)
    look = Inspect(server)
    with (
        running_workers(settings, 1, tmp_path) as (worker,),
        tinker.ServiceClient(settings) as service,
    ):
        client = service.create_lora_training_client("tiny", rank=4)
        slow = client.ping("slow", delay_ms=1_500)
        wait_until(lambda: look.statuses([slow.request_id]) == ["running"], "the op to start")
        server.kill()
        time.sleep(1.2)  # the outage itself: longer than the 1 s lease
        server.start()
        assert slow.result(timeout=30) == {"data": "slow", "seq": 2}
        (job,) = look.jobs([slow.request_id])
        # Run again under a new lease (2; more only if a loaded machine starved a heartbeat),
        # published once.
        assert int(job["attempts"]) >= 2, worker.log()
        assert look.published() == 2  # create_model and the slow op: once each
        assert "lost the lease" in worker.log() or "lapsed" in worker.log()
        assert client.ping("after").result(timeout=20) == {"data": "after", "seq": 3}


def test_redis_gone_for_good_fails_clearly_and_loses_nothing_acknowledged(
    server: RedisServer, database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the retry window a submit raises RedisUnavailableError and pending futures fail
    with it (naming the request) instead of hanging; a worker told to stop waits no longer
    than a lease, then exits saying why. Redis back with its data: the acknowledged ops run,
    and a resubmit under the same idempotency key gets the original result."""
    monkeypatch.setattr(holder, "ENQUEUE_RETRY_S", 1.0)
    settings = deployment(server, database_url, tmp_path, lease_ttl_ms=1_000, heartbeat_ms=200)
    look = Inspect(server)
    first = WorkerProcess(settings, "tiny", tmp_path / "w1.log")
    second: WorkerProcess | None = None
    try:
        wait_for_workers(settings, 1)
        with tinker.ServiceClient(settings) as service:
            client = service.create_lora_training_client("tiny", rank=4)
            running = client.ping("slow", delay_ms=800)
            queued = client.ping("queued", idempotency_key="queued-1")
            wait_until(
                lambda: look.statuses([running.request_id]) == ["running"], "the op to start"
            )
            server.stop()

            began = time.monotonic()
            with pytest.raises(RedisUnavailableError, match="Redis unreachable for 1 s"):
                client.ping("never")
            assert time.monotonic() - began < 5
            for future in (running, queued):
                with pytest.raises(RedisUnavailableError, match=future.request_id):
                    future.result(timeout=10)

            first.proc.terminate()
            assert first.proc.wait(timeout=15) != 0
            assert "gave up waiting" in first.log()

            server.start()
            second = WorkerProcess(settings, "tiny", tmp_path / "w2.log")
            again = client.ping("queued", idempotency_key="queued-1")
            assert again.request_id == queued.request_id
            assert again.result(timeout=30) == {"data": "queued", "seq": 3}
            wait_until(
                lambda: look.statuses([running.request_id]) == ["done"],
                "the running op to run again",
            )
            assert look.published() == 3  # create_model, slow, queued; "never" never landed
    finally:
        first.stop()
        if second is not None:
            assert second.stop() == 0, second.log()[-3000:]


def test_lora_training_loses_no_step_across_a_kill_9_of_redis(
    server: RedisServer, database_url: str, tmp_path: Path
) -> None:
    """A LoRA run with steps queued and running when Redis is killed ends exactly where an
    uninterrupted run ends: same losses, same adapter weights."""
    settings = deployment(
        server, database_url, tmp_path, lease_ttl_ms=3_000, snapshot_every_steps=3
    )
    worker = WorkerProcess(settings, TINY, tmp_path / "worker.log", engine="lora")
    try:
        wait_for_workers(settings, 1, timeout=90)
        with tinker.ServiceClient(settings) as service:
            interrupted = service.create_lora_training_client(TINY, rank=4, seed=11)
            before = train(interrupted, 2)
            pending = [
                (
                    interrupted.forward_backward(BATCHES[step % len(BATCHES)], "cross_entropy"),
                    interrupted.optim_step(ADAM),
                )
                for step in range(2, 5)
            ]
            server.kill()
            wait_until(lambda: "Redis unreachable" in worker.log(), "the worker to notice")
            server.start()
            during = []
            for fb, opt in pending:
                during.append(fb.result(timeout=60).loss)
                opt.result(timeout=60)
            after = train(interrupted, 2, start=5)

            straight = service.create_lora_training_client(TINY, rank=4, seed=11)
            assert train(straight, 7) == before + during + after
            got = adapter_weights(service, interrupted, "end")
            want = adapter_weights(service, straight, "end")
            for key, value in want.items():
                torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-8, msg=key)
        assert "reconnected to Redis" in worker.log()
    finally:
        assert worker.stop() == 0, worker.log()[-3000:]
