"""The gateway's health endpoint against real Redis and Postgres (the overview is behind the
dashboard's auth now: tests/gateway/test_dashboard.py)."""

from __future__ import annotations

import asyncio
import time

from fastapi.testclient import TestClient
from faults import TcpProxy, postgres_proxy, wait_until
from procs import make_key
from redis.connection import parse_url

from queue_tinker.gateway.app import create_app
from queue_tinker.settings import Settings
from queue_tinker.store import api_keys
from queue_tinker.store.db import make_engine, session_factory


def test_healthz_reports_both_backends(settings: Settings) -> None:
    """200 with redis and postgres ok."""
    with TestClient(create_app(settings)) as http:
        response = http.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"redis": "ok", "postgres": "ok"}


def test_healthz_names_the_backend_that_is_down(settings: Settings) -> None:
    """503 and an error for Postgres when it does not answer."""
    broken = settings.model_copy(
        update={"database_url": "postgresql://postgres@127.0.0.1:1/nothing"}
    )
    with TestClient(create_app(broken)) as http:
        response = http.get("/healthz")
    assert response.status_code == 503
    assert response.json()["redis"] == "ok"
    assert response.json()["postgres"].startswith("error")


def test_a_store_outage_is_a_503_with_retry_after(settings: Settings) -> None:
    """Postgres or Redis away mid-request: 503 naming the store, with Retry-After (the SDK
    retries those with the same body), not a 500 that reads as a bug; 200 again once back."""
    key = make_key(settings, "t-outage")
    headers = {"X-API-Key": key}
    redis_proxy = TcpProxy(redis_upstream(settings.redis_url or "")).start()
    try:
        with postgres_proxy(settings.database_url or "") as (pg_proxy, database_url):
            proxied = settings.model_copy(
                update={
                    "database_url": database_url,
                    "redis_url": f"redis://127.0.0.1:{redis_proxy.port}/{redis_db(settings)}",
                }
            )
            with TestClient(create_app(proxied)) as http:
                runs, capabilities = "/api/v1/training_runs", "/api/v1/get_server_capabilities"
                assert http.get(runs, headers=headers).status_code == 200  # the key is known

                # Each store cut in turn, under a route that needs it.
                for store, proxy, path in (
                    ("Postgres", pg_proxy, runs),
                    ("Redis", redis_proxy, capabilities),
                ):
                    proxy.outage()
                    down = http.get(path, headers=headers)
                    assert down.status_code == 503, down.text
                    assert down.json() == {"detail": f"{store} is unreachable; retry shortly"}
                    assert down.headers["Retry-After"] == "2"
                    proxy.restore()
                    wait_until(
                        f"{store} back",
                        lambda p=path: http.get(p, headers=headers).status_code == 200,
                        timeout=30,
                    )
    finally:
        redis_proxy.close()


def revoke_all(settings: Settings, tenant: str) -> None:
    async def go() -> None:
        engine = make_engine(settings.database_url or "")
        try:
            sessions = session_factory(engine)
            for info in await api_keys.list_keys(sessions, tenant):
                await api_keys.revoke_key(sessions, info.id)
        finally:
            await engine.dispose()

    asyncio.run(go())


def test_an_outage_never_brings_back_a_revoked_or_stale_key(settings: Settings) -> None:
    """With Postgres cut, a key seen revoked stays 401 (it got 200 before); a key Postgres
    vouched for works for QT_API_KEY_OUTAGE_S after that check, then gets 503."""
    revoked, other = make_key(settings, "t-revoked"), make_key(settings, "t-stale")
    path = "/api/v1/get_server_capabilities"  # needs Redis only, once the key is known
    with postgres_proxy(settings.database_url or "") as (pg_proxy, database_url):
        proxied = settings.model_copy(
            update={"database_url": database_url, "api_key_cache_s": 0.1, "api_key_outage_s": 2.0}
        )
        with TestClient(create_app(proxied)) as http:
            for key in (revoked, other):
                assert http.get(path, headers={"X-API-Key": key}).status_code == 200
            revoke_all(settings, "t-revoked")
            time.sleep(0.2)  # past the cache
            assert http.get(path, headers={"X-API-Key": revoked}).status_code == 401
            assert http.get(path, headers={"X-API-Key": other}).status_code == 200
            checked = time.monotonic()
            pg_proxy.outage()
            assert http.get(path, headers={"X-API-Key": revoked}).status_code == 401
            assert (
                http.post("/api/v1/create_session", headers={"X-API-Key": revoked}).status_code
                == 401
            )
            assert http.get(path, headers={"X-API-Key": other}).status_code == 200
            time.sleep(max(0.0, checked + 2.2 - time.monotonic()))
            stale = http.get(path, headers={"X-API-Key": other})
            assert stale.status_code == 503, stale.text
            pg_proxy.restore()


def redis_upstream(url: str) -> tuple[str, int] | str:
    """Where the Redis of `url` listens: (host, port), or a unix socket's path."""
    parts = parse_url(url)
    return (
        parts["path"]
        if "path" in parts
        else (parts.get("host", "127.0.0.1"), parts.get("port", 6379))
    )


def redis_db(settings: Settings) -> int:
    return int(parse_url(settings.redis_url or "").get("db", 0))
