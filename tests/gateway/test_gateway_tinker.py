"""The gateway as the official `tinker` SDK sees it (docs/tinker-http-protocol.md): a real
`queue-tinker serve` process, a real worker, the SDK unchanged. Grows with the protocol."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import tinker
from procs import SDK_CLIENT_MARKS, gateway_process, make_key, running_workers
from sqlalchemy import text

from queue_tinker.client.service import ServiceClient
from queue_tinker.settings import Settings
from queue_tinker.store import api_keys
from queue_tinker.store.db import make_engine, session_factory

pytestmark = SDK_CLIENT_MARKS


@contextmanager
def rest_client(gateway: str, key: str) -> Iterator[tinker.RestClient]:
    rest = tinker.RestClient(base_url=gateway, api_key=key)
    try:
        yield rest
    finally:
        rest.holder.close()


@pytest.fixture
def gateway(settings: Settings, tmp_path: Path) -> Iterator[str]:
    """The base URL of a `queue-tinker serve` process on the test's deployment."""
    with gateway_process(settings, tmp_path / "gateway.log") as url:
        yield url


def test_the_sdk_reads_server_capabilities_with_a_key(
    settings: Settings, gateway: str, tmp_path: Path
) -> None:
    key = make_key(settings, f"t-{uuid.uuid4().hex[:8]}")
    with (
        running_workers(settings, 1, tmp_path, base_model="tiny"),
        rest_client(gateway, key) as rest,
    ):
        capabilities = rest.get_server_capabilities().result(timeout=30)
        with ServiceClient(settings) as ours:  # the Python client reads the same registry
            served = ours.get_server_capabilities().supported_models
            assert [m.model_name for m in served] == ["tiny"]
    assert [m.model_name for m in capabilities.supported_models] == ["tiny"]


@pytest.mark.parametrize("key", ["tml-not-a-key", None])
def test_a_missing_or_invalid_key_gets_401(
    settings: Settings, gateway: str, key: str | None
) -> None:
    headers = {"X-API-Key": key} if key else {}
    for method, path in (
        ("POST", "/api/v1/client/config"),
        ("POST", "/api/v1/create_session"),
        ("GET", "/api/v1/get_server_capabilities"),
    ):
        response = httpx.request(method, gateway + path, headers=headers, json={}, timeout=10)
        assert response.status_code == 401, (path, response.text)
        assert "API key" in response.json()["detail"] or "X-API-Key" in response.json()["detail"]
    if key:
        with pytest.raises(tinker.AuthenticationError), rest_client(gateway, key) as rest:
            rest.get_server_capabilities().result(timeout=30)


def test_a_revoked_key_stops_working_within_the_cache_time(
    settings: Settings, tmp_path: Path
) -> None:
    cached = settings.model_copy(update={"api_key_cache_s": 1.0})
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    key = make_key(cached, tenant)

    async def revoke() -> None:
        engine = make_engine(cached.database_url or "")
        try:
            sessions = session_factory(engine)
            [listed] = await api_keys.list_keys(sessions, tenant)
            await api_keys.revoke_key(sessions, listed.id)
        finally:
            await engine.dispose()

    with gateway_process(cached, tmp_path / "gateway.log") as url:

        def status() -> int:
            return httpx.post(
                f"{url}/api/v1/client/config", headers={"X-API-Key": key}, json={}, timeout=10
            ).status_code

        assert status() == 200  # and now cached
        asyncio.run(revoke())
        revoked_at = time.monotonic()
        while status() == 200:
            assert time.monotonic() - revoked_at < 1.0 + 2, "still accepted past the cache time"
            time.sleep(0.1)
        assert status() == 401


def test_a_session_belongs_to_the_keys_tenant(settings: Settings, gateway: str) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    headers = {"X-API-Key": make_key(settings, tenant)}
    config = httpx.post(
        f"{gateway}/api/v1/client/config",
        headers=headers,
        json={"sdk_version": "0.38.0"},
        timeout=10,
    )
    assert config.status_code == 200 and config.json()["pjwt_auth_enabled"] is False
    created = httpx.post(
        f"{gateway}/api/v1/create_session",
        headers=headers,
        json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0", "type": "create_session"},
        timeout=10,
    ).json()
    session_id = created["session_id"]
    beat = httpx.post(
        f"{gateway}/api/v1/session_heartbeat",
        headers=headers,
        json={"session_id": session_id, "type": "session_heartbeat"},
        timeout=10,
    )
    assert beat.status_code == 200
    # Another tenant's heartbeat for this session is refused like an unknown session's.
    stranger = {"X-API-Key": make_key(settings, f"t-{uuid.uuid4().hex[:8]}")}
    assert (
        httpx.post(
            f"{gateway}/api/v1/session_heartbeat",
            headers=stranger,
            json={"session_id": session_id},
            timeout=10,
        ).status_code
        == 404
    )
    # The SDK validates the telemetry answer with its own model.
    telemetry = httpx.post(
        f"{gateway}/api/v1/telemetry",
        headers=headers,
        json={"events": [], "session_id": session_id},
        timeout=10,
    )
    tinker.types.TelemetryResponse.model_validate(telemetry.json())

    async def owner() -> str | None:
        engine = make_engine(settings.database_url or "")
        try:
            async with engine.connect() as conn:
                return (
                    await conn.execute(
                        text("SELECT tenant_id FROM sessions WHERE id = :s"), {"s": session_id}
                    )
                ).scalar()
        finally:
            await engine.dispose()

    deadline = time.monotonic() + 10
    while (found := asyncio.run(owner())) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert found == tenant
