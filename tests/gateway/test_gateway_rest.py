"""The REST calls (training runs, checkpoints, sessions, samplers) as the official `tinker`
SDK's RestClient makes them: a real `queue-tinker serve`, a real LoRA worker, real data made
by our own client for two tenants, each of which must see only its own things."""

from __future__ import annotations

import asyncio
import gc
import json
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx
import numpy as np
import pytest
import redis
import tinker
from procs import SDK_CLIENT_MARKS, gateway_process, lora_deployment, make_key
from rq.registry import ScheduledJobRegistry
from sqlalchemy import text

import queue_tinker
from queue_tinker import types
from queue_tinker.client.holder import decode_outcome
from queue_tinker.queue.control.expiry_jobs import expiry_job_id, housekeeping_queue
from queue_tinker.settings import Settings
from queue_tinker.store.db import make_engine, session_factory
from queue_tinker.store.record_writer import apply_records
from queue_tinker.types import OpKind, SamplingSessionRecord, codec
from queue_tinker.types.requests.training import LoraConfig

TINY = "queue-tinker/tiny-llama"
RANK = 4

pytestmark = SDK_CLIENT_MARKS


# --- the deployment and its data -------------------------------------------------------------


@dataclass(frozen=True)
class World:
    settings: Settings
    gateway: str
    key_a: str
    key_b: str
    session_a: str
    run_a: str  # made by our client: m-<hex>
    colon_run_a: str  # an SDK-style id: sess-<hex>:train:0
    run_b: str
    sampler_a: str
    sampler_b: str

    def path(self, run: str, checkpoint_id: str) -> str:
        return f"tinker://{run}/{checkpoint_id}"


def batch() -> list[types.Datum]:
    ids = list(b"rest calls list what was trained")
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": np.array(ids[1:], dtype=np.int64)},
        )
    ]


def service_for(settings: Settings, tenant: str) -> queue_tinker.ServiceClient:
    """Our client acting for `tenant` (QT_TENANT): its runs and session are the tenant's."""
    return queue_tinker.ServiceClient(settings.model_copy(update={"tenant": tenant}))


def run_with_id(service: queue_tinker.ServiceClient, model_id: str) -> Any:
    """A training run under an id of our choosing, as the gateway makes them for the SDK."""
    holder = service._holder
    config = LoraConfig(rank=RANK).model_dump()

    async def create() -> None:
        await holder.jobs.register_model(
            model_id,
            base_model=TINY,
            tenant_id=holder.tenant_id,
            session_id=holder.session_id,
            lora_config=config,
        )
        body = {"lora_config": config, "tenant_id": holder.tenant_id, "base_model": TINY}
        _, outcome = await holder.submit(model_id, OpKind.CREATE_MODEL, codec.encode(body))
        decode_outcome(await outcome, codec.decode)

    service._loop.run(create())
    return service.training_client(model_id)


def train_one_step(tc: Any) -> None:
    tc.forward_backward(batch(), "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60)


def wait_for(what: str, check: Callable[[], bool], timeout: float = 20) -> None:
    """Until `check()` holds: the record is written behind the queue."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def get(world: World, key: str, path: str, **params: Any) -> httpx.Response:
    return httpx.get(world.gateway + path, headers={"X-API-Key": key}, params=params, timeout=10)


@pytest.fixture(scope="module")
def world(
    redis_url: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    with (
        lora_deployment(redis_url, database_url, TINY) as settings,
        gateway_process(settings, log) as gateway,
    ):
        tenant_a, tenant_b = (f"t-{uuid.uuid4().hex[:8]}" for _ in range(2))
        key_a, key_b = make_key(settings, tenant_a), make_key(settings, tenant_b)
        service_a, service_b = service_for(settings, tenant_a), service_for(settings, tenant_b)
        try:
            tc = service_a.create_lora_training_client(TINY, rank=RANK)
            train_one_step(tc)
            for name in ("doomed", "a", "b"):
                tc.save_state(name).result(timeout=60)
            sampler_path = tc.save_weights_for_sampler("s").result(timeout=60).path
            sampler_a = service_a.create_sampling_client(model_path=sampler_path)
            colon = run_with_id(service_a, f"sess-{uuid.uuid4().hex[:12]}:train:0")
            colon.save_state("c").result(timeout=60)
            tc_b = service_b.create_lora_training_client(TINY, rank=RANK)
            tc_b.save_state("theirs").result(timeout=60)
            sampler_b = service_b.create_sampling_client(base_model=TINY)
            world = World(
                settings,
                gateway,
                key_a,
                key_b,
                service_a._holder.session_id,
                tc.model_id,
                colon.model_id,
                tc_b.model_id,
                sampler_a.sampler_id,
                sampler_b.sampler_id,
            )
            wait_for(
                "A's checkpoints",
                lambda: (
                    get(world, key_a, "/api/v1/checkpoints").json()["cursor"]["total_count"] == 5
                ),
            )
            wait_for(
                "B's checkpoint",
                lambda: (
                    get(world, key_b, "/api/v1/checkpoints").json()["cursor"]["total_count"] == 1
                ),
            )
            wait_for(
                "A's session",
                lambda: (
                    get(world, key_a, f"/api/v1/sessions/{world.session_a}")
                    .json()
                    .get("sampler_ids")
                    == [world.sampler_a]
                ),
            )
            yield world
        finally:
            service_a.close()
            service_b.close()
            rq = redis.Redis.from_url(redis_url)
            queue = housekeeping_queue(settings.key_prefix)
            for key in rq.scan_iter(match=f"rq:*{queue}*", count=1000):
                rq.delete(key)
            rq.srem("rq:queues", f"rq:queue:{queue}")
            rq.close()


@contextmanager
def rest_client(world: World, key: str) -> Iterator[tinker.RestClient]:
    """One per tenant for the module: the SDK shares a single session-less holder per (base
    URL, key) in the whole process, and closing it ends every RestClient made on it."""
    rest = tinker.RestClient(base_url=world.gateway, api_key=key)
    try:
        yield rest
    finally:
        rest.holder.close()
        time.sleep(0.3)  # the SDK's background cleanup; collected here, under this module's
        gc.collect()  # warning filters, not in whichever test runs next


@pytest.fixture(scope="module")
def rest_a(world: World) -> Iterator[tinker.RestClient]:
    with rest_client(world, world.key_a) as rest:
        yield rest


@pytest.fixture(scope="module")
def rest_b(world: World) -> Iterator[tinker.RestClient]:
    with rest_client(world, world.key_b) as rest:
        yield rest


def deleted_at(settings: Settings, checkpoint_id: str) -> datetime | None:
    async def fetch() -> datetime | None:
        engine = make_engine(settings.database_url or "")
        try:
            async with engine.connect() as conn:
                query = text("SELECT deleted_at FROM checkpoints WHERE id = :id")
                found: datetime | None = (
                    await conn.execute(query, {"id": checkpoint_id})
                ).scalar_one()
                return found
        finally:
            await engine.dispose()

    return asyncio.run(fetch())


def checkpoint_ids(listing: tinker.types.CheckpointsListResponse) -> set[str]:
    return {c.tinker_path for c in listing.checkpoints}


# --- training runs ---------------------------------------------------------------------------


def test_runs_are_listed_and_read_by_their_owner_only(
    world: World, rest_a: tinker.RestClient, rest_b: tinker.RestClient
) -> None:
    runs = rest_a.list_training_runs().result(timeout=30)
    assert [r.training_run_id for r in runs.training_runs] == [world.colon_run_a, world.run_a]
    assert (runs.cursor.total_count, runs.cursor.offset, runs.cursor.limit) == (2, 0, 20)
    page = rest_a.list_training_runs(limit=1, offset=1).result(timeout=30)
    assert [r.training_run_id for r in page.training_runs] == [world.run_a]

    run = rest_a.get_training_run(world.run_a).result(timeout=30)
    assert (run.base_model, run.is_lora, run.lora_rank, run.corrupted) == (TINY, True, RANK, False)
    assert run.model_owner == runs.training_runs[1].model_owner != ""
    assert run.last_checkpoint is not None and run.last_checkpoint.checkpoint_id == "weights/b"
    assert run.last_sampler_checkpoint is not None
    assert run.last_sampler_checkpoint.tinker_path == world.path(world.run_a, "sampler_weights/s")
    assert run.last_request_time.tzinfo is not None
    colon = rest_a.get_training_run_by_tinker_path(world.path(world.colon_run_a, "weights/c"))
    assert colon.result(timeout=30).training_run_id == world.colon_run_a

    theirs = rest_b.list_training_runs().result(timeout=30)
    assert [r.training_run_id for r in theirs.training_runs] == [world.run_b]
    for run_id in (world.run_a, world.colon_run_a):
        with pytest.raises(tinker.NotFoundError):
            rest_b.get_training_run(run_id).result(timeout=30)
    with pytest.raises(tinker.NotFoundError):
        rest_a.get_training_run(world.run_b).result(timeout=30)


def test_checkpoints_of_a_run_and_of_the_user(
    world: World, rest_a: tinker.RestClient, rest_b: tinker.RestClient
) -> None:
    listing = rest_a.list_checkpoints(world.run_a).result(timeout=30)
    assert listing.cursor is None
    by_id = {c.checkpoint_id: c for c in listing.checkpoints}
    assert set(by_id) == {"weights/doomed", "weights/a", "weights/b", "sampler_weights/s"}
    assert [c.checkpoint_id for c in listing.checkpoints][:1] == ["sampler_weights/s"]
    assert by_id["weights/a"].checkpoint_type == "training"
    assert by_id["sampler_weights/s"].checkpoint_type == "sampler"
    for checkpoint_id, c in by_id.items():
        assert c.tinker_path == world.path(world.run_a, checkpoint_id)
        assert c.size_bytes and c.size_bytes > 0 and c.public is False and c.expires_at is None
    colon = rest_a.list_checkpoints(world.colon_run_a).result(timeout=30)
    assert [c.checkpoint_id for c in colon.checkpoints] == ["weights/c"]

    mine = rest_a.list_user_checkpoints().result(timeout=30)
    assert checkpoint_ids(mine) == checkpoint_ids(listing) | checkpoint_ids(colon)
    assert mine.cursor is not None and mine.cursor.total_count == 5
    page = rest_a.list_user_checkpoints(limit=2, offset=1).result(timeout=30)
    assert [c.tinker_path for c in page.checkpoints] == [
        c.tinker_path for c in mine.checkpoints[1:3]
    ]

    theirs = rest_b.list_user_checkpoints().result(timeout=30)
    assert checkpoint_ids(theirs) == {world.path(world.run_b, "weights/theirs")}
    with pytest.raises(tinker.NotFoundError):
        rest_b.list_checkpoints(world.run_a).result(timeout=30)


def test_delete_removes_the_files_and_the_listing(
    world: World, rest_a: tinker.RestClient, rest_b: tinker.RestClient
) -> None:
    path = world.path(world.run_a, "weights/doomed")
    directory = world.settings.storage_dir / world.run_a / "weights" / "doomed"
    assert (directory / "qt_meta.json").exists()

    with pytest.raises(tinker.NotFoundError):
        rest_b.delete_checkpoint_from_tinker_path(path).result(timeout=30)
    assert directory.exists()

    rest_a.delete_checkpoint(world.run_a, "weights/doomed").result(timeout=30)
    assert not directory.exists()
    assert not [p for p in directory.parent.iterdir() if "doomed" in p.name]  # no trash left
    assert deleted_at(world.settings, path) is not None
    assert path not in checkpoint_ids(rest_a.list_checkpoints(world.run_a).result(timeout=30))
    assert path not in checkpoint_ids(rest_a.list_user_checkpoints().result(timeout=30))
    with pytest.raises(tinker.NotFoundError):
        rest_a.delete_checkpoint_from_tinker_path(path).result(timeout=30)


def read_meta_expiry(world: World, run: str, checkpoint_id: str) -> float | None:
    directory = world.settings.storage_dir / run / checkpoint_id
    expires_at: float | None = json.loads((directory / "qt_meta.json").read_text())["expires_at"]
    return expires_at


def test_a_ttl_is_set_seen_and_cleared(
    world: World, rest_a: tinker.RestClient, rest_b: tinker.RestClient
) -> None:
    path = world.path(world.colon_run_a, "weights/c")
    with pytest.raises(tinker.NotFoundError):
        rest_b.set_checkpoint_ttl_from_tinker_path(path, 7200).result(timeout=30)
    assert read_meta_expiry(world, world.colon_run_a, "weights/c") is None

    before = time.time()
    rest_a.set_checkpoint_ttl_from_tinker_path(path, 7200).result(timeout=30)
    [listed] = rest_a.list_checkpoints(world.colon_run_a).result(timeout=30).checkpoints
    assert listed.expires_at is not None
    assert before + 7200 - 1 <= listed.expires_at.timestamp() <= time.time() + 7200 + 1
    meta_expiry = read_meta_expiry(world, world.colon_run_a, "weights/c")
    assert meta_expiry == pytest.approx(listed.expires_at.timestamp(), abs=1e-3)
    rq = redis.Redis.from_url(world.settings.redis_url or "")
    try:
        queue = housekeeping_queue(world.settings.key_prefix)
        registry = ScheduledJobRegistry(queue, connection=rq)
        assert expiry_job_id(queue, path) in registry.get_job_ids()
    finally:
        rq.close()

    rest_a.set_checkpoint_ttl_from_tinker_path(path, None).result(timeout=30)
    [listed] = rest_a.list_checkpoints(world.colon_run_a).result(timeout=30).checkpoints
    assert listed.expires_at is None
    assert read_meta_expiry(world, world.colon_run_a, "weights/c") is None

    for bad in (0, -5):
        with pytest.raises(tinker.UnprocessableEntityError, match="ttl_seconds"):
            rest_a.set_checkpoint_ttl_from_tinker_path(path, bad).result(timeout=30)


def test_weights_info_of_an_own_checkpoint(
    world: World, rest_a: tinker.RestClient, rest_b: tinker.RestClient
) -> None:
    path = world.path(world.run_a, "weights/a")
    info = rest_a.get_weights_info_by_tinker_path(path).result(timeout=30)
    assert (info.base_model, info.is_lora, info.lora_rank) == (TINY, True, RANK)
    assert info.train_attn is info.train_mlp is info.train_unembed is True
    with pytest.raises(tinker.NotFoundError):
        rest_b.get_weights_info_by_tinker_path(path).result(timeout=30)


# --- sessions and samplers -------------------------------------------------------------------


def test_sessions_list_their_runs_and_samplers(
    world: World, rest_a: tinker.RestClient, rest_b: tinker.RestClient
) -> None:
    assert world.session_a in rest_a.list_sessions().result(timeout=30).sessions
    assert world.session_a not in rest_b.list_sessions(limit=1000).result(timeout=30).sessions
    session = rest_a.get_session(world.session_a).result(timeout=30)
    assert session.training_run_ids == [world.run_a, world.colon_run_a]
    assert session.sampler_ids == [world.sampler_a]
    with pytest.raises(tinker.NotFoundError):
        rest_b.get_session(world.session_a).result(timeout=30)


def test_samplers_are_read_from_redis_then_postgres(
    world: World, rest_a: tinker.RestClient, rest_b: tinker.RestClient
) -> None:
    sampler = rest_a.get_sampler(world.sampler_a).result(timeout=30)
    assert (sampler.sampler_id, sampler.base_model) == (world.sampler_a, TINY)
    assert sampler.model_path == world.path(world.run_a, "sampler_weights/s")
    base = rest_b.get_sampler(world.sampler_b).result(timeout=30)
    assert (base.base_model, base.model_path) == (TINY, None)
    for rest, other in (
        (rest_b, world.sampler_a),
        (rest_a, world.sampler_b),
        (rest_a, world.run_a),
    ):  # a training run is no sampler
        with pytest.raises(tinker.NotFoundError):
            rest.get_sampler(other).result(timeout=30)

    # A sampler whose Redis meta is gone (Redis flushed) is still read from its row.
    tenant = rest_a.get_training_run(world.run_a).result(timeout=30).model_owner
    only_in_postgres = f"smp-{uuid.uuid4().hex}"
    record = SamplingSessionRecord(
        id=only_in_postgres,
        tenant_id=tenant,
        base_model=TINY,
        model_path=None,
        created_at=time.time(),
    )

    async def write() -> None:
        engine = make_engine(world.settings.database_url or "")
        try:
            await apply_records(session_factory(engine), [record])
        finally:
            await engine.dispose()

    asyncio.run(write())
    assert rest_a.get_sampler(only_in_postgres).result(timeout=30).base_model == TINY
    with pytest.raises(tinker.NotFoundError):
        rest_b.get_sampler(only_in_postgres).result(timeout=30)


# --- errors ----------------------------------------------------------------------------------


def test_rest_calls_need_a_key(world: World) -> None:
    for method, path in (
        ("GET", "/api/v1/training_runs"),
        ("GET", "/api/v1/checkpoints"),
        ("DELETE", f"/api/v1/training_runs/{world.run_a}/checkpoints/weights/a"),
    ):
        response = httpx.request(method, world.gateway + path, timeout=10)
        assert response.status_code == 401, (path, response.text)
        assert "X-API-Key" in response.json()["detail"]
    assert (world.settings.storage_dir / world.run_a / "weights" / "a").exists()


def test_bad_ids_get_an_error_that_names_them(world: World) -> None:
    headers = {"X-API-Key": world.key_a}
    bad_checkpoint = httpx.delete(
        f"{world.gateway}/api/v1/training_runs/{world.run_a}/checkpoints/external/a",
        headers=headers,
        timeout=10,
    )
    assert bad_checkpoint.status_code == 400
    assert "checkpoint_id" in bad_checkpoint.json()["detail"]  # a body: the SDK will not retry
    bad_path = httpx.post(
        f"{world.gateway}/api/v1/weights_info",
        headers=headers,
        json={"tinker_path": "s3://bucket/x"},
        timeout=10,
    )
    assert bad_path.status_code == 400 and "tinker_path" in bad_path.json()["detail"]
    missing = get(world, world.key_a, "/api/v1/training_runs/sess-nope:train:9")
    assert missing.status_code == 404 and "sess-nope:train:9" in missing.json()["detail"]
    bad_ttl = httpx.put(
        f"{world.gateway}/api/v1/training_runs/{world.run_a}/checkpoints/weights/a/ttl",
        headers=headers,
        json={"ttl_seconds": "soon"},
        timeout=10,
    )
    assert bad_ttl.status_code == 422 and "ttl_seconds" in bad_ttl.json()["detail"]
