"""Through the real tinker SDK, a real gateway and a real LoRA worker: cancel_future stopping a
sample that is already running (the worker drops its rows at the next decode step), and
copy_weights (a checkpoint the caller can read, copied into its own tenant)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
import tinker
from procs import SDK_CLIENT_MARKS, make_key
from test_sdk_protocol import key_tenant, text_batch
from tinker import types

from queue_tinker.gateway.tinker.sample_futures import SDK_CANCEL_REASON
from queue_tinker.queue.keys import Keys
from queue_tinker.settings import Settings

TINY = "queue-tinker/tiny-llama"
PROMPT = types.ModelInput.from_ints(list(b"cancel"))

pytestmark = SDK_CLIENT_MARKS


@pytest.fixture
def jobs(deployment: Settings) -> Iterator[JobHashes]:
    client = redis.Redis.from_url(deployment.redis_url or "")
    yield JobHashes(client, Keys(deployment.key_prefix))
    client.close()


class JobHashes:
    """The queue's own record of a sampling session's ops (the SDK hides request ids)."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client, self.keys = client, keys

    def submitted(self, sampler_id: str, timeout: float = 60) -> str:
        """The request id of the session's one sample in flight: the gateway lists it for the
        client's batched polls (retrieve_futures) until a poll reports it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pending = self.client.smembers(self.keys.sample_pending(sampler_id, 0))
            if pending:
                (request_id,) = pending
                return str(request_id.decode())
            time.sleep(0.01)
        raise AssertionError(f"{sampler_id} has no sample in flight after {timeout} s")

    def get(self, job_id: str) -> dict[str, str]:
        fields = self.client.hgetall(self.keys.job(job_id))
        return {
            k.decode(): v.decode() for k, v in fields.items() if k not in (b"result", b"payload")
        }

    def wait_running(self, job_id: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.get(job_id).get("status") != "running":
            assert time.monotonic() < deadline, f"{job_id} never ran: {self.get(job_id)}"
            time.sleep(0.005)


def cancel_future(gateway: str, key: str, request_id: str) -> httpx.Response:
    """What the SDK sends for an abandoned sample (InternalClientHolder._send_cancel_request)."""
    return httpx.post(
        f"{gateway}/api/v1/cancel_future",
        headers={"X-API-Key": key},
        json={"request_id": request_id},
        timeout=30,
    )


# --- cancel_future of a running sample -------------------------------------------------------
def test_cancel_future_stops_a_running_sample_and_its_loop_mates_go_on(
    sdk_service: tinker.ServiceClient, gateway: str, key: str, deployment: Settings, jobs: JobHashes
) -> None:
    """A sample of 1,024 x 240 tokens (16 batches of the CPU loop's 64 rows) is cancelled once
    it runs: it fails as cancelled within a few quanta, long before its first batch could
    finish, while a sample that shared its decode loop completes with the tokens it gets
    alone; another tenant's cancel is refused, a cancel of a finished op is a no-op, and the
    worker serves the next sample."""
    kept_params = types.SamplingParams(max_tokens=240, seed=11, stop=[])
    sampler = sdk_service.create_sampling_client(base_model=TINY).result()
    other = sdk_service.create_sampling_client(base_model=TINY).result()
    alone = sampler.sample(PROMPT, 2, kept_params).result(timeout=120)  # also makes the loop

    kept = sampler.sample(PROMPT, 2, kept_params)
    kept_id = jobs.submitted(sampler._sampling_session_id)
    jobs.wait_running(kept_id)  # it holds 2 rows: the long one joins beside it
    long = other.sample(PROMPT, 1024, types.SamplingParams(max_tokens=240, seed=12, stop=[]))
    long_id = jobs.submitted(other._sampling_session_id)
    jobs.wait_running(long_id)
    time.sleep(0.2)  # a few decode steps of both

    stranger = make_key(deployment, f"stranger-{uuid.uuid4().hex[:6]}")
    assert cancel_future(gateway, stranger, long_id).status_code == 404
    asked = time.monotonic()
    answer = cancel_future(gateway, key, long_id)
    assert answer.status_code == 200, answer.text
    with pytest.raises(tinker.RequestFailedError, match="cancelled by the client") as failed:
        long.result(timeout=60)
    waited = time.monotonic() - asked
    assert f"{SDK_CANCEL_REASON} while it ran" in str(failed.value)
    record = jobs.get(long_id)
    assert record["status"] == "failed" and record["error_category"] == "user"
    # 240 steps of 64 rows would end its first batch; it left long before.
    assert waited < 5.0, waited

    got = kept.result(timeout=120)
    assert [s.tokens for s in got.sequences] == [s.tokens for s in alone.sequences]
    kept_record = jobs.get(kept_id)
    assert json.loads(kept_record["metrics"])["batch_sequences:max"] > 2  # it shared the loop
    assert float(kept_record["finished_at"]) > float(record["finished_at"])  # it outlived it

    assert cancel_future(gateway, key, long_id).status_code == 200  # finished: a no-op
    assert cancel_future(gateway, key, kept_id).status_code == 200
    assert jobs.get(kept_id)["status"] == "done"
    after = other.sample(PROMPT, 1, types.SamplingParams(max_tokens=3, stop=[]))
    assert len(after.result(timeout=120).sequences[0].tokens) == 3


# --- copy_weights ----------------------------------------------------------------------------
def greedy(sampler: Any) -> list[int]:
    params = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    return list(sampler.sample(PROMPT, 1, params).result(timeout=120).sequences[0].tokens)


def test_copy_weights_makes_a_copy_that_loads_samples_and_outlives_its_source(
    sdk_service: tinker.ServiceClient, gateway: str, key: str, deployment: Settings
) -> None:
    """A copy of a sampler checkpoint samples what the source samples, a copy of a state
    checkpoint starts a run, both are listed as the caller's (with the TTL asked for), a
    retry under the same idempotency key makes the same copy, and the copies still work
    after the sources are deleted."""
    tenant = key_tenant(deployment, key)
    trainer = sdk_service.create_lora_training_client(base_model=TINY, rank=2, seed=3).result()
    trainer.forward_backward(text_batch(2), "cross_entropy").result(timeout=120)
    trainer.optim_step(types.AdamParams(learning_rate=0.05)).result(timeout=120)
    weights = trainer.save_weights_for_sampler("src").result(timeout=120).path
    state = trainer.save_state("src-state").result(timeout=120).path
    rest = tinker.RestClient(base_url=gateway, api_key=key)

    copied = rest.copy_weights(weights, tenant, ttl_seconds=7_200).result()
    copied_state = rest.copy_weights(state, tenant).result()
    assert copied.startswith("tinker://copy-") and copied.endswith("/sampler_weights/src")
    assert copied_state.endswith("/weights/src-state")
    expected = greedy(sdk_service.create_sampling_client(model_path=weights).result())
    assert greedy(sdk_service.create_sampling_client(model_path=copied).result()) == expected
    listed = {c.tinker_path: c for c in rest.list_user_checkpoints().result().checkpoints}
    assert listed[copied].expires_at is not None and listed[copied_state].expires_at is None
    copied_run = rest.get_training_run_by_tinker_path(copied).result()
    assert copied_run.base_model == TINY

    body = {"source_path": weights, "destination_project_id": tenant}
    again = [
        httpx.post(
            f"{gateway}/api/v1/copy_weights",
            headers={"X-API-Key": key, "X-Idempotency-Key": "copy-once"},
            json=body,
            timeout=30,
        ).json()["tinker_path"]
        for _ in range(2)
    ]
    assert again[0] == again[1] != copied

    for source in (weights, state):
        rest.delete_checkpoint_from_tinker_path(source).result()
    with pytest.raises(tinker.BadRequestError, match="no checkpoint"):
        sdk_service.create_sampling_client(model_path=weights).result()
    assert greedy(sdk_service.create_sampling_client(model_path=copied).result()) == expected
    from_copy = sdk_service.create_training_client_from_state(copied_state).result()
    assert from_copy.forward(text_batch(1), "cross_entropy").result(timeout=120).metrics


def test_copy_weights_reads_only_what_the_caller_may_and_refuses_what_is_not_offered(
    sdk_service: tinker.ServiceClient, gateway: str, key: str, deployment: Settings
) -> None:
    """Another tenant's private checkpoint is a 404 naming source_path until its owner
    publishes it; then that tenant copies it into its own tenant. A foreign project, a run
    slot in a session and a cross-account token are refused naming the field."""
    tenant = key_tenant(deployment, key)
    trainer = sdk_service.create_lora_training_client(base_model=TINY, rank=2, seed=4).result()
    weights = trainer.save_weights_for_sampler("shared").result(timeout=120).path
    owner = tinker.RestClient(base_url=gateway, api_key=key)
    other_key = make_key(deployment, f"copier-{uuid.uuid4().hex[:6]}")
    other_tenant = key_tenant(deployment, other_key)
    other = tinker.RestClient(base_url=gateway, api_key=other_key)
    with pytest.raises(tinker.NotFoundError, match="source_path"):
        other.copy_weights(weights, other_tenant).result()
    owner.publish_checkpoint_from_tinker_path(weights).result()
    copied = other.copy_weights(weights, other_tenant).result()
    mine = {c.tinker_path for c in other.list_user_checkpoints().result().checkpoints}
    assert copied in mine
    assert copied not in {c.tinker_path for c in owner.list_user_checkpoints().result().checkpoints}

    def refused(body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
        return httpx.post(
            f"{gateway}/api/v1/copy_weights",
            headers={"X-API-Key": key, **(headers or {})},
            json={"source_path": weights, **body},
            timeout=30,
        )

    for body, headers, field in [
        ({"destination_project_id": "proj-elsewhere"}, None, "destination_project_id"),
        ({"session_id": "sess-x", "model_seq_id": 0}, None, "session_id"),
        ({"destination_project_id": tenant}, {"X-Tinker-Weights-Access-Token": "t"}, "Token"),
        ({"destination_project_id": tenant, "ttl_seconds": 0}, None, "ttl_seconds"),
        ({"source_path": "tinker://nope/weights/x"}, None, "source_path"),
        ({"source_path": "s3://bucket/x"}, None, "source_path"),
    ]:
        answer = refused(body, headers)
        assert answer.status_code in (400, 404, 422), (body, answer.text)
        assert field in answer.json()["detail"], (body, answer.text)
    # What to pass instead, where the SDK takes it (it sends no copy without a project id).
    elsewhere = refused({"destination_project_id": "proj-elsewhere"}).json()["detail"]
    assert f"TINKER_PROJECT_ID={tenant}" in elsewhere, elsewhere
