"""The gateway's health endpoint against real Redis and Postgres (the overview is behind the
dashboard's auth now: tests/test_dashboard.py)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from queue_tinker.gateway.app import create_app
from queue_tinker.settings import Settings


def test_healthz_reports_both_backends(settings: Settings) -> None:
    """200 with redis and postgres ok."""
    with TestClient(create_app(settings)) as http:
        response = http.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"redis": "ok", "postgres": "ok"}


def test_healthz_names_the_backend_that_is_down(settings: Settings) -> None:
    """503 and an error for Postgres when it does not answer."""
    broken = settings.model_copy(
        update={"database_url": "postgresql://postgres@127.0.0.1:1/nothing"})
    with TestClient(create_app(broken)) as http:
        response = http.get("/healthz")
    assert response.status_code == 503
    assert response.json()["redis"] == "ok"
    assert response.json()["postgres"].startswith("error")
