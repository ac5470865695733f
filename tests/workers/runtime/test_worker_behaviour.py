"""Real worker processes: idempotent resubmits, stalled owners fenced out, graceful stop,
bad input failing only its own request."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import redis
from procs import WorkerProcess, failover_settings, running_workers, wait_for_workers

from queue_tinker.client import ServiceClient
from queue_tinker.errors import ErrorCategory, RequestFailedError
from queue_tinker.queue.keys import Keys
from queue_tinker.settings import Settings


def wait_until(predicate, timeout: float = 20, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def job_fields(settings: Settings, job_id: str) -> dict[str, str]:
    client = redis.Redis.from_url(settings.redis_url or "")
    try:
        fields = client.hgetall(Keys(settings.key_prefix).job(job_id))
        return {
            k.decode(): v.decode() for k, v in fields.items() if k not in (b"result", b"payload")
        }
    finally:
        client.close()


def lease_holder(settings: Settings, model_id: str) -> str | None:
    client = redis.Redis.from_url(settings.redis_url or "", decode_responses=True)
    try:
        token = client.get(Keys(settings.key_prefix).model_lease(model_id))
        return token.split("|")[0] if token else None  # type: ignore[union-attr]
    finally:
        client.close()


def worker_pid(settings: Settings, worker_id: str) -> int:
    client = redis.Redis.from_url(settings.redis_url or "", decode_responses=True)
    try:
        return int(client.hget(Keys(settings.key_prefix).worker(worker_id), "pid"))  # type: ignore[arg-type]
    finally:
        client.close()


def test_resubmit_with_same_idempotency_key_runs_once(
    settings: Settings, service: ServiceClient, tmp_path: Path
) -> None:
    """Same key: the same request id and result, and only one op in the model's log."""
    with running_workers(settings, 1, tmp_path):
        client = service.create_lora_training_client("tiny", rank=4)
        first = client.ping("a", idempotency_key="step-1")
        again = client.ping("b", idempotency_key="step-1")
        assert again.request_id == first.request_id
        assert first.result(30) == again.result(30) == {"data": "a", "seq": 2}
        assert job_fields(settings, first.request_id)["attempts"] == "1"
        assert client.ping("c").result(30)["seq"] == 3  # the resubmit took no seq


def test_stalled_owner_cannot_publish_after_takeover(
    redis_url: str, database_url: str, key_prefix: str, tmp_path: Path
) -> None:
    """SIGSTOP the owner mid-op: another worker takes over and publishes; the stale one,
    resumed, is fenced out and drops the model."""
    settings = Settings(
        redis_url=redis_url,
        database_url=database_url,
        key_prefix=key_prefix,
        lease_ttl_ms=1_000,
        heartbeat_ms=200,
        linger_ms=60_000,
    )
    service = ServiceClient(settings)
    try:
        with running_workers(settings, 2, tmp_path) as workers:
            client = service.create_lora_training_client("tiny", rank=4)
            slow = client.ping("slow", delay_ms=1_500)
            wait_until(
                lambda: job_fields(settings, slow.request_id).get("status") == "running",
                what="the slow op to start",
            )
            owner = job_fields(settings, slow.request_id)["worker_id"]
            stalled = next(w for w in workers if w.pid == worker_pid(settings, owner))
            os.kill(stalled.pid, signal.SIGSTOP)
            try:
                assert slow.result(timeout=20) == {"data": "slow", "seq": 2}
            finally:
                os.kill(stalled.pid, signal.SIGCONT)
            taken_over = job_fields(settings, slow.request_id)
            assert taken_over["worker_id"] != owner and taken_over["attempts"] == "2"
            # The stalled worker wakes, finishes its copy of the op and tries to publish.
            wait_until(
                lambda: "lost the lease" in stalled.log() or "lapsed" in stalled.log(),
                what="the stale worker to notice it was fenced out",
            )
            time.sleep(2.0)  # its sleeping op completes; its publish must be refused
            assert job_fields(settings, slow.request_id) == taken_over
            assert lease_holder(settings, client.model_id) == taken_over["worker_id"]
            assert client.ping("after").result(20) == {"data": "after", "seq": 3}
            assert job_fields(settings, slow.request_id) == taken_over
    finally:
        service.close()


def test_sigterm_finishes_the_current_op_then_releases(
    settings: Settings, service: ServiceClient, tmp_path: Path
) -> None:
    """A stopping worker publishes the op it is running, hands its models back, exits 0."""
    worker = WorkerProcess(settings, "tiny", tmp_path / "worker.log")
    try:
        wait_for_workers(settings, 1)
        client = service.create_lora_training_client("tiny", rank=4)
        slow = client.ping("slow", delay_ms=1_000)
        wait_until(
            lambda: job_fields(settings, slow.request_id).get("status") == "running",
            what="the op to start",
        )
        worker.proc.terminate()
        assert worker.proc.wait(20) == 0, worker.log()
        assert slow.result(timeout=1) == {"data": "slow", "seq": 2}
        assert lease_holder(settings, client.model_id) is None
        client_redis = redis.Redis.from_url(settings.redis_url or "")
        assert client_redis.zcard(Keys(settings.key_prefix).workers()) == 0
        client_redis.close()
    finally:
        worker.stop()


def test_bad_input_fails_only_its_request(
    settings: Settings, service: ServiceClient, tmp_path: Path
) -> None:
    """An invalid op fails with a user error naming the field; the model and worker carry on."""
    with running_workers(settings, 1, tmp_path):
        client = service.create_lora_training_client("tiny", rank=4)
        other = service.create_lora_training_client("tiny", rank=4)
        bad = client.ping("x", delay_ms=-5)
        good = client.ping("y")
        with pytest.raises(RequestFailedError, match="delay_ms") as caught:
            bad.result(timeout=20)
        assert caught.value.category is ErrorCategory.USER
        assert caught.value.request_id == bad.request_id
        assert good.result(timeout=20) == {"data": "y", "seq": 3}
        assert other.ping("z").result(timeout=20) == {"data": "z", "seq": 2}


def test_heartbeats_keep_the_lease_through_a_long_op(
    redis_url: str, database_url: str, key_prefix: str, tmp_path: Path
) -> None:
    """An op three times longer than the lease TTL runs once: heartbeats beat during compute,
    so the other worker never takes the model over."""
    settings = Settings(
        redis_url=redis_url,
        database_url=database_url,
        key_prefix=key_prefix,
        lease_ttl_ms=800,
        heartbeat_ms=200,
        linger_ms=60_000,
    )
    service = ServiceClient(settings)
    try:
        with running_workers(settings, 2, tmp_path):
            client = service.create_lora_training_client("tiny", rank=4)
            slow = client.ping("slow", delay_ms=2_400)
            assert slow.result(timeout=20) == {"data": "slow", "seq": 2}
            assert job_fields(settings, slow.request_id)["attempts"] == "1"
    finally:
        service.close()


def test_an_op_that_ends_every_worker_running_it_fails_unrun_after_max_attempts(
    redis_url: str, database_url: str, key_prefix: str, tmp_path: Path
) -> None:
    """An op whose worker dies under it each time (kill -9 whenever it starts) runs
    QT_MAX_OP_ATTEMPTS times; the next owner fails it unrun, saying why, instead of dying in
    turn. The model's later ops run on that owner, which lives on."""
    settings = failover_settings(
        redis_url, database_url, key_prefix, tmp_path, lease_ttl_ms=1_000, max_op_attempts=2
    )
    service = ServiceClient(settings)
    workers = [WorkerProcess(settings, "tiny", tmp_path / "worker-0.log")]
    try:
        wait_for_workers(settings, 1)
        client = service.create_lora_training_client("tiny", rank=4)
        assert client.ping("before").result(timeout=20) == {"data": "before", "seq": 2}
        doomed = client.ping("doomed", delay_ms=60_000)
        for attempt in (1, 2):
            wait_until(
                lambda n=attempt: job_fields(settings, doomed.request_id).get("attempts") == str(n),
                what=f"start {attempt} of the op",
            )
            owner = job_fields(settings, doomed.request_id)["worker_id"]
            os.kill(worker_pid(settings, owner), signal.SIGKILL)
            workers.append(WorkerProcess(settings, "tiny", tmp_path / f"worker-{attempt}.log"))
        with pytest.raises(
            RequestFailedError, match="started 2 times and never finished"
        ) as caught:
            doomed.result(timeout=30)
        assert caught.value.category is ErrorCategory.SERVER
        assert "QT_MAX_OP_ATTEMPTS" in str(caught.value)
        fields = job_fields(settings, doomed.request_id)
        assert (fields["status"], fields["attempts"]) == ("failed", "3")
        assert client.ping("after").result(timeout=20) == {"data": "after", "seq": 4}
        assert job_fields(settings, doomed.request_id)["worker_id"] == lease_holder(
            settings, client.model_id
        )
    finally:
        service.close()
        codes = [w.stop() for w in workers]
        assert codes[-1] == 0, workers[-1].log()[-3000:]
