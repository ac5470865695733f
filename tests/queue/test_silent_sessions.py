"""Samples of a client that went silent (queue/control/silent_sessions.py), on real Redis and
the real scripts: a session that sent heartbeats and then none past the timeout has its queued
samples cancelled and its running ones stopped; sessions still heard from, never heard from,
or finished keep theirs."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from procs import lora_deployment
from redis.asyncio import Redis
from redis.exceptions import ResponseError
from test_queue_core import BASE, dispatcher

from queue_tinker.queue.control import silent_sessions
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.ops.jobs import JobQueue
from queue_tinker.settings import Settings
from queue_tinker.types import JobStatus, OpKind

TINY = "queue-tinker/tiny-llama"

TIMEOUT_S = 0.5


@pytest.fixture
def keys(key_prefix: str) -> Keys:
    return Keys(key_prefix)


async def sampler_with_samples(
    jobs: JobQueue, keys: Keys, session_id: str, count: int, number: int = 0
) -> tuple[str, list[str]]:
    """Sampling session `number` of `session_id` (noted as the gateway notes it) with `count`
    samples queued: (its id, the samples' request ids)."""
    sampler_id = f"{session_id}:sample:{number}"
    await jobs.register_sampling_session(
        sampler_id, base_model=BASE, tenant_id="t", session_id=session_id, model_path=None
    )
    await silent_sessions.note_sampler(jobs.redis, keys, session_id, sampler_id, ttl_s=60)
    job_ids = []
    for i in range(count):
        enqueued = await jobs.enqueue(sampler_id, OpKind.SAMPLE, b"", job_id=f"{session_id}-{i}")
        job_ids.append(enqueued.job_id)
    return sampler_id, job_ids


async def statuses(jobs: JobQueue, job_ids: list[str]) -> list[str]:
    return [(await jobs.job(job_id))[0]["status"] for job_id in job_ids]


async def test_a_silent_sessions_samples_are_cancelled_and_the_others_kept(
    aredis: Redis, keys: Keys
) -> None:
    jobs = JobQueue(aredis, keys, result_ttl_s=60)
    silent, alive, unheard = "sess-silent", "sess-alive", "sess-unheard"
    sampler, (running, *queued) = await sampler_with_samples(jobs, keys, silent, 3)
    kept = [(await sampler_with_samples(jobs, keys, s, 2))[1] for s in (alive, unheard)]
    worker = dispatcher(aredis, keys, "wA")  # runs the silent session's first sample
    lease = await worker.claim(sampler)
    assert lease is not None
    ops, _, _ = await worker.read({sampler: 0}, b"0-0", block_ms=100)
    assert (await worker.start(lease, ops[0])).run and ops[0].job_id == running
    for session in (silent, alive):
        await silent_sessions.heard_from(aredis, keys, session)
    await asyncio.sleep(TIMEOUT_S + 0.1)
    await silent_sessions.heard_from(aredis, keys, alive)

    (silenced,) = await silent_sessions.silence_lapsed(aredis, keys, TIMEOUT_S)
    assert silenced.session_id == silent
    assert silenced.cancelled == {running: "running", queued[0]: "queued", queued[1]: "queued"}
    reason = f"the client of session {silent} went silent (no session_heartbeat for 0.5 s)"
    reason += ": cancelled"
    for job_id in queued:
        _, outcome = await jobs.job(job_id)
        assert outcome is not None and outcome.status is JobStatus.FAILED
        assert outcome.error == f"{reason} before it ran"
    # The running one is stopped by its worker: asked on its control stream, kept on the job.
    (control,) = await aredis.xrange(keys.worker_control("wA"))
    assert control[1][b"command"] == b"cancel" and control[1][b"job"] == running.encode()
    stop_reason = await aredis.hget(keys.job(running), "stop_reason")
    assert stop_reason == f"{reason} while it ran".encode()
    for job_ids in kept:
        assert await statuses(jobs, job_ids) == ["queued", "queued"]
    assert await silent_sessions.silence_lapsed(aredis, keys, TIMEOUT_S) == []  # acted on once


async def test_a_finished_session_is_not_taken_for_gone(aredis: Redis, keys: Keys) -> None:
    jobs = JobQueue(aredis, keys, result_ttl_s=60)
    _, job_ids = await sampler_with_samples(jobs, keys, "sess-done", 2)
    await silent_sessions.heard_from(aredis, keys, "sess-done")
    await silent_sessions.forget(aredis, keys, "sess-done")
    await asyncio.sleep(TIMEOUT_S + 0.1)
    assert await silent_sessions.silence_lapsed(aredis, keys, TIMEOUT_S) == []
    assert await statuses(jobs, job_ids) == ["queued", "queued"]


async def test_a_look_that_fails_midway_hands_the_session_back(aredis: Redis, keys: Keys) -> None:
    """Redis refuses a read while a silent session's samples are being cancelled (here: a
    sampler's meta key of the wrong type): the look fails, the session goes back to the
    heartbeat set with its last heartbeat, and the next look cancels its samples."""
    jobs = JobQueue(aredis, keys, result_ttl_s=60)
    _, job_ids = await sampler_with_samples(jobs, keys, "sess-retry", 2, number=5)
    broken = "sess-retry:sample:1"  # looked at first
    await silent_sessions.note_sampler(aredis, keys, "sess-retry", broken, ttl_s=60)
    await aredis.set(keys.model_meta(broken), "not a hash")
    await silent_sessions.heard_from(aredis, keys, "sess-retry")
    heard = await aredis.zscore(keys.session_heartbeats(), "sess-retry")
    await asyncio.sleep(TIMEOUT_S + 0.1)
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await silent_sessions.silence_lapsed(aredis, keys, TIMEOUT_S)
    assert await aredis.zscore(keys.session_heartbeats(), "sess-retry") == heard
    await aredis.delete(keys.model_meta(broken))
    (silenced,) = await silent_sessions.silence_lapsed(aredis, keys, TIMEOUT_S)
    assert silenced.cancelled == dict.fromkeys(job_ids, "queued")
    assert await statuses(jobs, job_ids) == ["failed", "failed"]


# --- through the gateway: a client stops heartbeating mid-way ------------------------------
GATEWAY_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def deployment(redis_url: str, database_url: str) -> Iterator[Settings]:
    with lora_deployment(
        redis_url, database_url, TINY, session_heartbeat_timeout_s=GATEWAY_TIMEOUT_S
    ) as settings:
        yield settings


def open_sampler(http: httpx.Client) -> tuple[str, str, float]:
    """A new session, heard from once, with a sampling session on the tiny model: (session,
    sampler, when it was heard from)."""
    session = http.post("/create_session", json={"tags": []}).json()["session_id"]
    assert http.post("/session_heartbeat", json={"session_id": session}).status_code == 200
    heard = time.monotonic()
    sampler = http.post(
        "/create_sampling_session",
        json={"session_id": session, "sampling_session_seq_id": 0, "base_model": TINY},
    ).json()["sampling_session_id"]
    return session, sampler, heard


def asample(http: httpx.Client, sampler: str, seq_id: int, n: int, max_tokens: int) -> str:
    body = {
        "sampling_session_id": sampler,
        "seq_id": seq_id,
        "num_samples": n,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [3, 4, 5]}]},
        "sampling_params": {"max_tokens": max_tokens, "stop": [], "seed": seq_id},
    }
    return str(http.post("/asample", json=body).json()["request_id"])


def outcome(http: httpx.Client, request_id: str) -> dict[str, Any]:
    while True:
        answer = http.post(
            "/retrieve_future",
            json={"request_id": request_id},
            headers={"X-Stainless-Read-Timeout": "30"},
        ).json()
        if answer.get("type") != "try_again":
            return dict(answer)


def test_a_client_that_stops_heartbeating_has_its_samples_cancelled(
    gateway: str, key: str, deployment: Settings
) -> None:
    """A client heard from once queues forty samples of 64 x 240 tokens (half a minute of this
    worker's time) and falls silent: within the timeout and a look after it, every one of them
    still unfinished fails as cancelled, naming the session. A client that keeps heartbeating
    beside it gets its sample."""
    with httpx.Client(base_url=gateway + "/api/v1", headers={"X-API-Key": key}, timeout=60) as http:
        silent, silent_sampler, fell_silent = open_sampler(http)
        alive, alive_sampler, _ = open_sampler(http)
        requests = [asample(http, silent_sampler, i, 64, 240) for i in range(40)]
        wanted = asample(http, alive_sampler, 0, 1, 5)
        stop = threading.Event()

        def keep_alive() -> None:
            while not stop.wait(0.5):
                http.post("/session_heartbeat", json={"session_id": alive})

        beating = threading.Thread(target=keep_alive)
        beating.start()
        try:
            last = outcome(http, requests[-1])
            waited = time.monotonic() - fell_silent
            answers = [outcome(http, r) for r in requests]
            assert "sequences" in outcome(http, wanted)
        finally:
            stop.set()
            beating.join()
    reason = f"the client of session {silent} went silent (no session_heartbeat for 3 s)"
    assert last["category"] == "user" and last["error"].startswith(f"{reason}: cancelled"), last
    assert GATEWAY_TIMEOUT_S <= waited < GATEWAY_TIMEOUT_S + 10, waited
    cancelled = [a for a in answers if "error" in a]
    assert len(cancelled) >= 30, [a.get("error", "done") for a in answers]
    assert all(a["error"].startswith(f"{reason}: cancelled") for a in cancelled)
    log = (deployment.data_dir / "gateway.log").read_text()
    assert f"session {silent}: no heartbeat for 3 s; its client is taken for gone" in log
