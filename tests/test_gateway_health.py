"""The gateway's health and overview endpoints against real Redis and Postgres."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient
from procs import running_workers

from queue_tinker.client import ServiceClient
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


def test_overview_shows_workers_and_waiting_queues(settings: Settings, service: ServiceClient,
                                                   tmp_path: Path) -> None:
    """A live worker is listed; a model with ops waiting behind a slow op shows its depth."""
    with running_workers(settings, 1, tmp_path), TestClient(create_app(settings)) as http:
        client = service.create_lora_training_client("tiny", rank=4)
        futures = [client.ping(i, delay_ms=300) for i in range(3)]
        body = http.get("/api/v1/overview").json()
        assert [w["base_model"] for w in body["workers"]] == ["tiny"]
        queue = next(q for q in body["queues"] if q["model_id"] == client.model_id)
        assert queue["depth"] >= 2 and queue["oldest_wait_s"] >= 0
        for future in futures:
            future.result(timeout=20)
