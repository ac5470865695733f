"""The dashboard's JSON API behind the API keys: a real `queue-tinker serve`, two real
queue-only workers, real Redis and Postgres, and two tenants (plus an admin) whose views must
not cross; and the actions: retry a failed request, cancel a queued one, drain a worker."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from procs import WorkerProcess, gateway_process, make_key, wait_for_workers

import queue_tinker
from queue_tinker.cli.keys import run_keys
from queue_tinker.errors import RequestFailedError
from queue_tinker.queue.connection import connect
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.observe.records import RecordLog
from queue_tinker.settings import Settings
from queue_tinker.store import api_keys
from queue_tinker.store.db import make_engine, session_factory
from queue_tinker.store.record_writer import apply_records
from queue_tinker.types import CheckpointRecord, JobStatus, OpKind, RequestRecord, codec

BASE = "tiny"
API = "/api/v1/dashboard"


@dataclass
class Deployment:
    settings: Settings
    gateway: str
    workers: list[WorkerProcess]
    tenant_a: str
    tenant_b: str
    key_a: str
    key_b: str
    admin: str  # an admin key (of a third tenant)
    service_a: queue_tinker.ServiceClient
    service_b: queue_tinker.ServiceClient

    def get(self, key: str | None, path: str, **params: Any) -> httpx.Response:
        headers = {"X-API-Key": key} if key else {}
        return httpx.get(self.gateway + path, headers=headers, params=params, timeout=10)

    def post(self, key: str | None, path: str) -> httpx.Response:
        headers = {"X-API-Key": key} if key else {}
        return httpx.post(self.gateway + path, headers=headers, timeout=10)

    def ok(self, key: str, path: str, **params: Any) -> Any:
        response = self.get(key, path, **params)
        assert response.status_code == 200, response.text
        return response.json()

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.settings.redis_url or "")


def make_admin_key(settings: Settings, tenant: str) -> str:
    async def go() -> str:
        engine = make_engine(settings.database_url or "")
        try:
            return (await api_keys.create_key(session_factory(engine), tenant, admin=True))[1]
        finally:
            await engine.dispose()

    return asyncio.run(go())


def service_for(settings: Settings, tenant: str) -> queue_tinker.ServiceClient:
    """Our client acting for `tenant` (QT_TENANT): its runs and session are the tenant's."""
    return queue_tinker.ServiceClient(settings.model_copy(update={"tenant": tenant}))


def wait_for(what: str, check: Callable[[], Any], timeout: float = 15) -> Any:
    """Poll until `check()` is truthy (the record is written behind the queue); its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def recorded(dep: Deployment, key: str, request_id: str, status: str | None = None) -> Any:
    """The request's detail once the record has it (in `status`, if given)."""

    def check() -> Any:
        response = dep.get(key, f"{API}/requests/{request_id}")
        if response.status_code != 200:
            return None
        body = response.json()
        return body if status is None or body["status"] == status else None

    return wait_for(f"the record of {request_id}", check)


def failed(future: Any) -> RequestFailedError:
    with pytest.raises(RequestFailedError) as info:
        future.result(timeout=20)
    return info.value


@pytest.fixture(scope="module")
def dep(
    redis_url: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    logs = tmp_path_factory.mktemp("dashboard")
    data_dir = Path(tempfile.mkdtemp(prefix="qt-dash-"))
    settings = Settings(
        redis_url=redis_url,
        database_url=database_url,
        key_prefix=f"qt-test-{uuid.uuid4().hex[:10]}",
        data_dir=data_dir,
        lease_ttl_ms=3_000,
        heartbeat_ms=300,
        linger_ms=60_000,
    )
    workers = [WorkerProcess(settings, BASE, logs / f"worker-{i}.log") for i in range(2)]
    services: list[queue_tinker.ServiceClient] = []
    try:
        wait_for_workers(settings, 2)
        with gateway_process(settings, logs / "gateway.log") as gateway:
            tenant_a, tenant_b = (f"t-{uuid.uuid4().hex[:8]}" for _ in range(2))
            services += [service_for(settings, tenant_a), service_for(settings, tenant_b)]
            yield Deployment(
                settings,
                gateway,
                workers,
                tenant_a,
                tenant_b,
                make_key(settings, tenant_a),
                make_key(settings, tenant_b),
                make_admin_key(settings, f"ops-{uuid.uuid4().hex[:6]}"),
                *services,
            )
    finally:
        for service in services:
            service.close()
        codes = [w.stop() for w in workers]
        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(match=f"{settings.key_prefix}:*", count=1000):
            client.delete(key)
        client.close()
        shutil.rmtree(data_dir, ignore_errors=True)
        for worker, code in zip(workers, codes, strict=True):
            assert code == 0, worker.log()[-3000:]


# --- the page and the key ------------------------------------------------------------------


def test_the_page_loads_without_a_key_and_every_data_route_needs_one(dep: Deployment) -> None:
    """/dashboard and its two files need no key; every JSON route and action answers 401
    without a key or with a bad one; the old unauthenticated /api/v1/overview is gone."""
    page = dep.get(None, "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'src="dashboard/dashboard.js"' in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    script = dep.get(None, "/dashboard/dashboard.js")
    assert script.status_code == 200 and "X-API-Key" in script.text
    assert "javascript" in script.headers["content-type"]
    assert dep.get(None, "/dashboard/dashboard.css").status_code == 200
    assert dep.get(None, "/dashboard/dashboard.py").status_code == 404
    assert dep.get(None, "/api/v1/overview").status_code == 404

    reads = [
        "overview",
        "history",
        "requests",
        "requests/r-1",
        "runs",
        "runs/m-1/loss",
        "checkpoints",
    ]
    actions = ["requests/r-1/retry", "requests/r-1/cancel", "workers/w-1/drain"]
    for key in (None, "tml-not-a-key", "sk-wrong-shape"):
        for path in reads:
            response = dep.get(key, f"{API}/{path}")
            assert response.status_code == 401, (key, path, response.text)
        for path in actions:
            response = dep.post(key, f"{API}/{path}")
            assert response.status_code == 401, (key, path, response.text)
    assert "X-API-Key" in dep.get(None, f"{API}/overview").json()["detail"]


def test_admin_keys_are_made_and_listed_as_such(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`keys create` with admin set makes an admin key (its lookup says so); `keys list`
    shows which keys are admins; a plain key is not one."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"

    def keys(action: str, **extra: Any) -> str:
        args = argparse.Namespace(action=action, tenant=tenant, name=None, **extra)
        assert asyncio.run(run_keys(database_url, args)) == 0
        return capsys.readouterr().out

    admin_key = keys("create", admin=True).strip()
    plain_key = keys("create").strip()  # no `admin` attribute at all: a plain key

    async def owners() -> list[api_keys.KeyOwner | None]:
        engine = make_engine(database_url)
        try:
            sessions = session_factory(engine)
            return [await api_keys.owner_of_key(sessions, k) for k in (admin_key, plain_key)]
        finally:
            await engine.dispose()

    assert asyncio.run(owners()) == [
        api_keys.KeyOwner(tenant, True),
        api_keys.KeyOwner(tenant, False),
    ]
    listed = [line.split() for line in keys("list").splitlines()]
    assert listed[0][:4] == ["id", "tenant", "prefix", "admin"]
    assert [(row[2], row[3]) for row in listed[1:]] == [
        (admin_key[:12], "yes"),
        (plain_key[:12], "no"),
    ]


# --- what each key sees --------------------------------------------------------------------


def test_overview_is_scoped_to_the_tenant_and_hides_other_tenants_on_workers(
    dep: Deployment,
) -> None:
    """Each tenant's overview lists only its queues and limits; workers are all listed, but
    another tenant's resident models and current op are hidden; the admin sees everything."""
    tc_a = dep.service_a.create_lora_training_client(BASE, rank=4)
    tc_b = dep.service_b.create_lora_training_client(BASE, rank=4)
    busy_b = tc_b.ping("slow", delay_ms=2_500)
    behind_b = tc_b.ping("behind")
    busy_a = tc_a.ping("slow", delay_ms=3_000)

    def both_busy() -> Any:
        body = dep.ok(dep.admin, f"{API}/overview")
        running = [w for w in body["workers"] if w["current_op"] == f"ping:{busy_b.request_id}"]
        queued = {q["model_id"] for q in body["queues"]}
        # Resident models come with the workers' heartbeats: wait for one that lists both.
        resident = {m for w in body["workers"] for m in w["resident"]}
        both = {tc_a.model_id, tc_b.model_id}
        return body if running and both <= queued and both <= resident else None

    admin = wait_for("B's slow ping to run while both queues wait", both_busy)
    seen_a = dep.ok(dep.key_a, f"{API}/overview")
    seen_b = dep.ok(dep.key_b, f"{API}/overview")

    assert {tc_a.model_id, tc_b.model_id} <= {q["model_id"] for q in admin["queues"]}
    queue_b = next(q for q in admin["queues"] if q["model_id"] == tc_b.model_id)
    assert queue_b["depth"] >= 2 and queue_b["tenant_id"] == dep.tenant_b
    assert queue_b["state"] == "active" and queue_b["oldest_wait_s"] >= 0
    assert admin["caller"]["admin"] is True
    for seen, mine, theirs, tenant in (
        (seen_a, tc_a, tc_b, dep.tenant_a),
        (seen_b, tc_b, tc_a, dep.tenant_b),
    ):
        assert seen["caller"] == {"tenant_id": tenant, "admin": False}
        assert {q["tenant_id"] for q in seen["queues"]} == {tenant}
        assert mine.model_id in {q["model_id"] for q in seen["queues"]}
        assert [t["tenant_id"] for t in seen["tenants"]] == [tenant]
        assert sorted(w["id"] for w in seen["workers"]) == sorted(w["id"] for w in admin["workers"])
        resident = {m for w in seen["workers"] for m in w["resident"]}
        assert theirs.model_id not in resident and mine.model_id in resident
        assert sum(w["resident_hidden"] for w in seen["workers"]) >= 1
    everything = dep.ok(dep.admin, f"{API}/overview")["workers"]  # after A saw its own
    assert {tc_a.model_id, tc_b.model_id} <= {m for w in everything for m in w["resident"]}
    # B's running op: its kind only, to A; in full to B and the admin.
    (hidden,) = [w for w in seen_a["workers"] if w["current_op_hidden"]]
    assert hidden["current_op"] == "ping:"
    assert f"ping:{busy_b.request_id}" in {w["current_op"] for w in seen_b["workers"]}
    for future in (busy_a, busy_b, behind_b):
        future.result(timeout=20)


def test_requests_runs_and_checkpoints_are_scoped_to_the_tenant(dep: Deployment) -> None:
    """A tenant's key lists and opens only its own requests, runs, loss curves and
    checkpoints (another tenant's read as missing: 404); the admin's key sees both."""
    tc_a = dep.service_a.create_lora_training_client(BASE, rank=4)
    tc_b = dep.service_b.create_lora_training_client(BASE, rank=4)
    ping_a, ping_b = tc_a.ping("a"), tc_b.ping("b")
    ping_a.result(timeout=20)
    ping_b.result(timeout=20)
    asyncio.run(add_checkpoints(dep, {tc_a.model_id: dep.tenant_a, tc_b.model_id: dep.tenant_b}))
    # Several recorders write behind (the gateway's, each worker's): wait for the runs too.
    for key, run in ((dep.key_a, tc_a.model_id), (dep.key_b, tc_b.model_id)):
        wait_for(
            f"the record of {run}",
            lambda key=key, run=run: (
                run in {r["id"] for r in dep.ok(key, f"{API}/runs", limit=500)["runs"]}
            ),
        )
    recorded(dep, dep.key_a, ping_a.request_id, "done")
    recorded(dep, dep.key_b, ping_b.request_id, "done")

    for key, mine, theirs, mine_ping, their_ping, tenant in (
        (dep.key_a, tc_a, tc_b, ping_a, ping_b, dep.tenant_a),
        (dep.key_b, tc_b, tc_a, ping_b, ping_a, dep.tenant_b),
    ):
        rows = dep.ok(key, f"{API}/requests", limit=500)["requests"]
        assert {r["tenant_id"] for r in rows} == {tenant}
        assert mine_ping.request_id in {r["id"] for r in rows}
        assert dep.get(key, f"{API}/requests/{their_ping.request_id}").status_code == 404
        assert dep.ok(key, f"{API}/requests/{mine_ping.request_id}")["model_id"] == mine.model_id
        runs = {r["id"]: r for r in dep.ok(key, f"{API}/runs", limit=500)["runs"]}
        assert mine.model_id in runs and theirs.model_id not in runs
        assert {r["tenant_id"] for r in runs.values()} == {tenant}
        assert dep.get(key, f"{API}/runs/{theirs.model_id}/loss").status_code == 404
        assert dep.ok(key, f"{API}/runs/{mine.model_id}/loss")["points"] == []  # no training
        paths = {
            c["tinker_path"] for c in dep.ok(key, f"{API}/checkpoints", limit=500)["checkpoints"]
        }
        assert paths >= {f"tinker://{mine.model_id}/weights/w1"}
        assert not any(theirs.model_id in p for p in paths)
        assert dep.get(key, f"{API}/checkpoints", run=theirs.model_id).status_code == 404
        own = dep.ok(key, f"{API}/checkpoints", run=mine.model_id)["checkpoints"]
        assert [(c["checkpoint_id"], c["kind"]) for c in own] == [
            ("sampler_weights/s1", "sampler"),
            ("weights/w1", "state"),
        ]  # newest first

    rows = dep.ok(dep.admin, f"{API}/requests", limit=500)["requests"]
    assert {ping_a.request_id, ping_b.request_id} <= {r["id"] for r in rows}
    runs = {r["id"] for r in dep.ok(dep.admin, f"{API}/runs", limit=500)["runs"]}
    assert {tc_a.model_id, tc_b.model_id} <= runs
    assert dep.ok(dep.admin, f"{API}/requests/{ping_b.request_id}")["tenant_id"] == dep.tenant_b
    admin_paths = {
        c["run_id"] for c in dep.ok(dep.admin, f"{API}/checkpoints", limit=500)["checkpoints"]
    }
    assert {tc_a.model_id, tc_b.model_id} <= admin_paths


async def add_checkpoints(dep: Deployment, runs: dict[str, str]) -> None:
    """A state and (a second later) a sampler checkpoint record per run, through the record
    writer the recorder uses (a queue-only worker writes no checkpoints)."""
    now = time.time()
    records = [
        CheckpointRecord(
            id=f"tinker://{run}/{segment}/{name}",
            model_id=run,
            tenant_id=tenant,
            name=name,
            kind=kind,
            path=f"/nowhere/{run}/{name}",
            size_bytes=1234,
            created_at=now + offset,
        )
        for run, tenant in runs.items()
        for segment, name, kind, offset in (
            ("weights", "w1", "state", 0.0),
            ("sampler_weights", "s1", "sampler", 1.0),
        )
    ]
    engine = make_engine(dep.settings.database_url or "")
    try:
        await apply_records(session_factory(engine), records)
    finally:
        await engine.dispose()


def test_requests_filter_and_the_traceback_is_one_request_away(dep: Deployment) -> None:
    """Filters by status, kind and model; a failed request lists its error, and its detail
    carries the worker's traceback for a server error (none for a user error)."""
    tc = dep.service_a.create_lora_training_client(BASE, rank=4)
    done = tc.ping("fine")
    done.result(timeout=20)
    bad_input = tc.ping("bad", delay_ms=-5)
    failed(bad_input)
    # A ping whose body is not a mapping breaks the worker's code: a server error.
    holder = dep.service_a._holder
    broken_id, outcome = dep.service_a._loop.run(
        holder.submit(tc.model_id, OpKind.PING, codec.encode([1, 2, 3]))
    )
    dep.service_a._loop.run(asyncio.wait_for(outcome, 20))
    recorded(dep, dep.key_a, broken_id, "failed")
    recorded(dep, dep.key_a, bad_input.request_id, "failed")
    recorded(dep, dep.key_a, done.request_id, "done")
    wait_for(
        "the create_model record",
        lambda: dep.ok(dep.key_a, f"{API}/requests", model=tc.model_id, kind="create_model")[
            "requests"
        ],
    )

    rows = dep.ok(dep.key_a, f"{API}/requests", model=tc.model_id, status="failed")["requests"]
    assert {r["id"] for r in rows} == {bad_input.request_id, broken_id}
    by_id = {r["id"]: r for r in rows}
    assert "delay_ms" in by_id[bad_input.request_id]["error"]
    assert by_id[broken_id]["has_detail"] and not by_id[bad_input.request_id]["has_detail"]
    assert "error_detail" not in by_id[broken_id]  # the list stays small
    (ok,) = dep.ok(dep.key_a, f"{API}/requests", model=tc.model_id, status="done", kind="ping")[
        "requests"
    ]
    assert ok["id"] == done.request_id and ok["latency_s"] >= 0
    assert ok["run_s"] is None or ok["latency_s"] >= ok["run_s"] >= 0  # inline: no start
    assert ok["worker_id"] and ok["finished_at"] >= ok["queued_at"]
    assert [
        r["kind"]
        for r in dep.ok(dep.key_a, f"{API}/requests", model=tc.model_id, kind="create_model")[
            "requests"
        ]
    ] == ["create_model"]
    assert dep.get(dep.key_a, f"{API}/requests", status="lost").status_code == 422

    server = dep.ok(dep.key_a, f"{API}/requests/{broken_id}")
    assert server["error_category"] == "server"
    assert "Traceback" in server["error_detail"] and "AttributeError" in server["error_detail"]
    user = dep.ok(dep.key_a, f"{API}/requests/{bad_input.request_id}")
    assert user["error_category"] == "user" and not user["error_detail"]


# --- actions -------------------------------------------------------------------------------


def test_retry_queues_a_failed_request_again(dep: Deployment) -> None:
    """Retrying a failed request runs its op again as a new request at the end of the model's
    queue; only the owner (or an admin) can, and only a failed request."""
    tc = dep.service_a.create_lora_training_client(BASE, rank=4)
    bad = tc.ping("bad", delay_ms=-1)
    failed(bad)
    later = tc.ping("later")
    later.result(timeout=20)
    original = recorded(dep, dep.key_a, bad.request_id, "failed")

    assert dep.post(dep.key_b, f"{API}/requests/{bad.request_id}/retry").status_code == 404
    assert dep.post(dep.key_a, f"{API}/requests/nothing-here/retry").status_code == 404
    response = dep.post(dep.key_a, f"{API}/requests/{bad.request_id}/retry")
    assert response.status_code == 200, response.text
    new_id = response.json()["retry_request_id"]
    assert new_id != bad.request_id

    retried = recorded(dep, dep.key_a, new_id, "failed")  # the same op fails the same way
    assert retried["model_id"] == tc.model_id and retried["kind"] == "ping"
    assert retried["seq"] > recorded(dep, dep.key_a, later.request_id)["seq"] > original["seq"]
    assert retried["worker_id"] and retried["started_at"] and retried["attempts"] >= 1
    assert retried["error"] == original["error"]

    not_failed = dep.post(dep.key_a, f"{API}/requests/{later.request_id}/retry")
    assert not_failed.status_code == 400 and "only a failed request" in not_failed.json()["detail"]
    by_admin = dep.post(dep.admin, f"{API}/requests/{bad.request_id}/retry")
    assert by_admin.status_code == 200 and by_admin.json()["retry_request_id"] != new_id


def test_cancel_fails_a_queued_request_and_the_queue_goes_on(dep: Deployment) -> None:
    """A request waiting behind a slow one is cancelled: its future fails with "cancelled",
    the ops around it run; another tenant cannot cancel it, and a finished one cannot be."""
    tc = dep.service_a.create_lora_training_client(BASE, rank=4)
    slow = tc.ping("slow", delay_ms=1_500)
    waiting = tc.ping("waiting")
    after = tc.ping("after")

    assert dep.post(dep.key_b, f"{API}/requests/{waiting.request_id}/cancel").status_code == 404
    response = dep.post(dep.key_a, f"{API}/requests/{waiting.request_id}/cancel")
    assert response.status_code == 200, response.text
    assert "cancelled" in failed(waiting).message
    assert slow.result(timeout=20)["data"] == "slow"
    assert after.result(timeout=20)["data"] == "after"

    again = dep.post(dep.key_a, f"{API}/requests/{waiting.request_id}/cancel")
    assert (
        again.status_code == 400 and "only a request waiting in its queue" in again.json()["detail"]
    )
    assert dep.post(dep.key_a, f"{API}/requests/{after.request_id}/cancel").status_code == 400
    row = recorded(dep, dep.key_a, waiting.request_id, "failed")
    assert "cancelled" in row["error"] and row["worker_id"] is None


def test_drain_needs_an_admin_and_hands_the_models_to_another_worker(dep: Deployment) -> None:
    """A tenant key may not drain (403); an admin's drain makes the worker exit 0, and its
    model's next op runs on the other worker."""
    keys = Keys(dep.settings.key_prefix)
    tc = dep.service_a.create_lora_training_client(BASE, rank=4)
    tc.ping("first").result(timeout=20)
    with dep.redis() as client:
        owner = client.get(keys.model_lease(tc.model_id)).decode().split("|")[0]
    workers = {w["id"]: w for w in dep.ok(dep.admin, f"{API}/overview")["workers"]}
    (process,) = [p for p in dep.workers if p.pid == workers[owner]["pid"]]

    denied = dep.post(dep.key_a, f"{API}/workers/{owner}/drain")
    assert denied.status_code == 403 and "admin key" in denied.json()["detail"]
    assert dep.post(dep.admin, f"{API}/workers/no-such-worker/drain").status_code == 400
    assert dep.post(dep.admin, f"{API}/workers/{owner}/drain").status_code == 200
    assert process.proc.wait(20) == 0, process.log()[-3000:]

    second = tc.ping("second")
    assert second.result(timeout=20)["data"] == "second"
    with dep.redis() as client:
        ran_on = client.hget(keys.job(second.request_id), "worker_id").decode()
    assert ran_on != owner and ran_on in workers
    assert owner not in {w["id"] for w in dep.ok(dep.admin, f"{API}/overview")["workers"]}


# --- dead letters ----------------------------------------------------------------------------
def test_dead_lettered_records_are_shown_to_whom_they_belong(dep: Deployment) -> None:
    """A record Postgres refused (buried by the recorder's own code) appears in the overview's
    dead_letters with its reason, for an admin and for its tenant, not for another tenant;
    with none, the count is 0 (the page hides the card)."""
    assert dep.ok(dep.admin, f"{API}/overview")["dead_letters"] == {"count": 0, "recent": []}
    record = RequestRecord(
        id=f"req-{uuid.uuid4().hex}",
        model_id="m-dead",
        seq=1,
        kind=OpKind.PING,
        status=JobStatus.DONE,
        tenant_id=dep.tenant_a,
        queued_at=time.time(),
    )

    async def bury() -> None:
        client = connect(dep.settings.redis_url or "")
        try:
            await RecordLog(client, Keys(dep.settings.key_prefix)).bury(
                record, "DataError: invalid byte sequence"
            )
        finally:
            await client.aclose()

    asyncio.run(bury())
    try:
        for key, count in ((dep.admin, 1), (dep.key_a, 1), (dep.key_b, 0)):
            dead = dep.ok(key, f"{API}/overview")["dead_letters"]
            assert dead["count"] == count
            if count:
                [shown] = dead["recent"]
                assert shown["id"] == record.id and shown["tenant_id"] == dep.tenant_a
                assert shown["type"] == "request"
                assert shown["reason"] == "DataError: invalid byte sequence"
    finally:
        client = redis.Redis.from_url(dep.settings.redis_url or "")
        client.delete(Keys(dep.settings.key_prefix).dead_records())
        client.close()


def test_a_diverged_loss_is_shown_not_a_500(dep: Deployment) -> None:
    """A forward_backward whose loss was -inf and a NaN one (recorded as JSONB strings) come
    back from the run's loss curve and the runs list as "-Infinity" / "NaN", beside the finite
    ones, with 200."""
    tc = dep.service_a.create_lora_training_client(BASE, rank=4)
    tc.ping("made").result(timeout=20)
    # The run's row is written behind the queue: the loss curve of a run not yet recorded is a
    # 404, which is not what this test is about.
    wait_for(
        "the run's record",
        lambda: dep.get(dep.key_a, f"{API}/runs/{tc.model_id}/loss").status_code == 200,
    )
    now = time.time()
    records = [
        RequestRecord(
            id=f"req-{uuid.uuid4().hex}",
            model_id=tc.model_id,
            seq=100 + i,
            kind=OpKind.FORWARD_BACKWARD,
            status=JobStatus.DONE,
            tenant_id=dep.tenant_a,
            queued_at=now,
            finished_at=now,
            metrics={"loss:sum": loss},
        )
        for i, loss in enumerate([2.5, float("-inf"), float("nan")])
    ]

    async def write() -> None:
        engine = make_engine(dep.settings.database_url or "")
        try:
            await apply_records(session_factory(engine), records)
        finally:
            await engine.dispose()

    asyncio.run(write())
    curve = dep.ok(dep.key_a, f"{API}/runs/{tc.model_id}/loss")
    assert [p["loss"] for p in curve["points"]] == [2.5, "-Infinity", "NaN"]
    [run] = [r for r in dep.ok(dep.key_a, f"{API}/runs")["runs"] if r["id"] == tc.model_id]
    assert run["last_loss"] == "NaN"
