"""GET /metrics against real Redis, workers and the gateway: the numbers are what happened."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import redis
import yaml
from fastapi.testclient import TestClient
from procs import REPO, lora_deployment, queue_pings, running_workers
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from queue_tinker import types
from queue_tinker.client import ServiceClient
from queue_tinker.errors import RequestFailedError
from queue_tinker.gateway.app import create_app
from queue_tinker.gateway.metrics import metrics_router
from queue_tinker.queue.connection import connect
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.ops.jobs import JobQueue
from queue_tinker.settings import Settings
from queue_tinker.types import OpKind

PING_DELAY_S = 0.06


@contextmanager
def gateway(settings: Settings) -> Iterator[TestClient]:
    """The gateway app in process, with /metrics (included here if create_app does not yet)."""
    app = create_app(settings)
    if not any(getattr(route, "path", None) == "/metrics" for route in app.routes):
        app.include_router(metrics_router(settings, Keys(settings.key_prefix)))
    with TestClient(app) as http:
        yield http


def scrape(http: TestClient, **headers: str) -> list[Sample]:
    """Every sample of one scrape, after checking the exposition parses and is documented."""
    response = http.get("/metrics", headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=")
    samples = []
    for family in text_string_to_metric_families(response.text):
        assert family.name.startswith("qt_"), family.name
        assert len(family.documentation) > 20, family.name  # a help text that explains
        samples += family.samples
    return samples


def scrape_until(
    http: TestClient, ready: Callable[[list[Sample]], bool], timeout_s: float = 1.5
) -> list[Sample]:
    """Scrape until `ready` holds: workers report what they do with each heartbeat (500 ms)."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(http)
        if ready(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


def value(samples: list[Sample], name: str, **labels: str) -> float | None:
    """The value of the one sample with this name and exactly these labels (None: absent)."""
    found = [s.value for s in samples if s.name == name and s.labels == labels]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def live_worker_ids(settings: Settings) -> set[str]:
    client = redis.Redis.from_url(settings.redis_url or "")
    try:
        return {w.decode() for w in client.zrange(Keys(settings.key_prefix).workers(), 0, -1)}
    finally:
        client.close()


def test_ops_latency_and_workers_match_what_ran(
    settings: Settings, service: ServiceClient, tmp_path: Path
) -> None:
    """5 pings → 5 done and a latency histogram of 5 above the ping's delay; a failed ping is
    counted as failed; the workers gauge is the live workers."""
    with running_workers(settings, 2, tmp_path), gateway(settings) as http:
        client = service.create_lora_training_client("tiny", rank=4)
        for future in [client.ping(i, delay_ms=int(PING_DELAY_S * 1000)) for i in range(5)]:
            future.result(timeout=20)
        samples = scrape(http)
        assert value(samples, "qt_ops_total", kind="ping", status="done") == 5
        assert value(samples, "qt_ops_total", kind="ping", status="failed") is None
        assert value(samples, "qt_ops_total", kind="create_model", status="done") == 1
        # All finished: the served base model's queue reads 0 (not a vanished series).
        assert value(samples, "qt_queue_depth", base_model="tiny", state="active") == 0
        assert value(samples, "qt_queue_oldest_wait_seconds", base_model="tiny") == 0
        assert value(samples, "qt_op_latency_seconds_count", kind="ping") == 5
        total = value(samples, "qt_op_latency_seconds_sum", kind="ping")
        assert total is not None and total >= 5 * PING_DELAY_S
        buckets = sorted(
            (float(s.labels["le"]), s.value)
            for s in samples
            if s.name == "qt_op_latency_seconds_bucket" and s.labels["kind"] == "ping"
        )
        assert buckets[-1] == (float("inf"), 5)
        assert [n for _, n in buckets] == sorted(n for _, n in buckets)  # cumulative
        # Each ping waited at least its delay, so no bucket below it holds any.
        assert all(n == 0 for le, n in buckets if le < PING_DELAY_S)

        worker_ids = live_worker_ids(settings)
        assert len(worker_ids) == 2
        assert value(samples, "qt_workers", base_model="tiny", device="cpu") == 2
        per_worker = {s.labels["worker"] for s in samples if s.name == "qt_worker_memory_bytes"}
        assert per_worker == worker_ids

        with pytest.raises(RequestFailedError, match="delay_ms"):
            client.ping(delay_ms=-1).result(timeout=20)
        samples = scrape(http)
        assert value(samples, "qt_ops_total", kind="ping", status="failed") == 1
        assert value(samples, "qt_ops_total", kind="ping", status="done") == 5

        # While a slow ping runs: one busy worker owning the model, which is one op deep.
        slow = client.ping(delay_ms=2_000)
        samples = scrape_until(http, lambda s: value(s, "qt_workers_busy", base_model="tiny") == 1)
        owned = [s.value for s in samples if s.name == "qt_worker_owned_models"]
        assert sorted(owned) == [0, 1]
        assert value(samples, "qt_queue_depth", base_model="tiny", state="active") == 1
        assert value(samples, "qt_queue_models", base_model="tiny", state="active") == 1
        slow.result(timeout=20)


def test_queue_depth_is_the_real_depth_while_no_worker_serves(settings: Settings) -> None:
    """Ops of a base model no worker serves: depth, models and oldest wait under
    paused_capacity, equal to what Redis holds; no worker gauge for it."""
    keys = Keys(settings.key_prefix)

    async def queue_three() -> int:
        client = connect(settings.redis_url or "")
        try:
            jobs = JobQueue(client, keys, result_ttl_s=60)
            await jobs.register_model(
                "m-metrics-waiting",
                base_model="absent",
                tenant_id="default",
                session_id=None,
                lora_config={"rank": 4},
            )
            for i in range(3):
                await jobs.enqueue("m-metrics-waiting", OpKind.PING, b"", job_id=f"j{i}")
            await asyncio.sleep(0.1)  # so the oldest has waited a measurable time
            meta = await client.hgetall(keys.model_meta("m-metrics-waiting"))
            return int(meta[b"last_seq"]) - int(meta.get(b"done_seq", 0))
        finally:
            await client.aclose()

    real_depth = asyncio.run(queue_three())
    assert real_depth == 3
    with gateway(settings) as http:
        samples = scrape(http)
    labels = {"base_model": "absent", "state": "paused_capacity"}
    assert value(samples, "qt_queue_depth", **labels) == real_depth
    assert value(samples, "qt_queue_models", **labels) == 1
    oldest = value(samples, "qt_queue_oldest_wait_seconds", base_model="absent")
    assert oldest is not None and oldest >= 0.1
    assert not [s for s in samples if s.name == "qt_workers"]


def test_bearer_token_is_enforced(settings: Settings) -> None:
    """With QT_METRICS_TOKEN set, /metrics answers 401 without the right bearer token."""
    with gateway(settings.model_copy(update={"metrics_token": "s3cret"})) as http:
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert http.get("/metrics", headers={"Authorization": "s3cret"}).status_code == 401
        scrape(http, Authorization="Bearer s3cret")
    with gateway(settings) as http:  # unset: open
        scrape(http)


def test_an_empty_metrics_token_opens_nothing(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """QT_METRICS_TOKEN="" is refused by the settings, and a gateway given an empty token
    anyway does not let a bare `Authorization: Bearer` scrape."""
    monkeypatch.setenv("QT_METRICS_TOKEN", "")
    with pytest.raises(ValueError, match="metrics_token"):
        Settings()
    monkeypatch.delenv("QT_METRICS_TOKEN")
    with gateway(settings.model_copy(update={"metrics_token": ""})) as http:
        assert http.get("/metrics", headers={"Authorization": "Bearer"}).status_code == 401
        assert http.get("/metrics", headers={"Authorization": "Bearer "}).status_code == 401


def test_tokens_count_what_the_engine_processed(redis_url: str, database_url: str) -> None:
    """forward_backward on a real LoRA worker: qt_tokens_total{kind} and
    qt_tenant_tokens_total{tenant} grow by the batch's input tokens, each time."""
    with (
        lora_deployment(redis_url, database_url, "queue-tinker/tiny-llama") as settings,
        ServiceClient(settings) as service,
        gateway(settings) as http,
    ):
        training = service.create_lora_training_client("queue-tinker/tiny-llama", rank=4)
        tokens = list(range(3, 15))  # ids, not text: the tokenizer takes seconds to import
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": np.array(tokens[1:]),
                "weights": np.ones(len(tokens) - 1, dtype=np.float32),
            },
        )
        per_step = 2 * (len(tokens) - 1)  # two data of the same length
        for step in (1, 2):
            training.forward_backward([datum, datum], "cross_entropy").result(timeout=60)
            samples = scrape(http)
            assert value(samples, "qt_tokens_total", kind="forward_backward") == step * per_step
            assert value(samples, "qt_tenant_tokens_total", tenant="default") == step * per_step
        assert value(samples, "qt_ops_total", kind="forward_backward", status="done") == 2
        assert value(samples, "qt_tokens_total", kind="create_model") is None  # no tokens


def demand(samples: list[Sample], base_model: str) -> tuple[float | None, float | None]:
    """(qt_demand_models, qt_demand_unowned_models) of the base model."""
    return (
        value(samples, "qt_demand_models", base_model=base_model),
        value(samples, "qt_demand_unowned_models", base_model=base_model),
    )


def test_demand_follows_the_work_and_falls_to_zero(
    settings: Settings, service: ServiceClient, tmp_path: Path
) -> None:
    """Three models with queued pings and no worker: demand 3, all 3 unowned; a worker comes
    and runs them: demand 0 (a series, not none); a slow ping while it runs: demand 1, owned;
    the worker gone and nothing queued, the base model still reports 0."""
    asyncio.run(queue_pings(settings, "tiny", {"m-demand-a": 2, "m-demand-b": 1, "m-demand-c": 1}))
    with gateway(settings) as http:
        samples = scrape(http)
        assert demand(samples, "tiny") == (3, 3)
        assert value(samples, "qt_queue_depth", base_model="tiny", state="paused_capacity") == 4
        with running_workers(settings, 1, tmp_path):
            samples = scrape_until(http, lambda s: demand(s, "tiny")[0] == 0, timeout_s=20)
            assert demand(samples, "tiny") == (0, 0)
            slow = service.create_lora_training_client("tiny", rank=4).ping(delay_ms=2_000)
            samples = scrape_until(
                http, lambda s: value(s, "qt_workers_busy", base_model="tiny") == 1
            )
            assert demand(samples, "tiny") == (1, 0)
            slow.result(timeout=20)
            assert demand(scrape(http), "tiny") == (0, 0)
        assert demand(scrape(http), "tiny") == (0, 0)  # no worker, no work: still a series


@dataclass(frozen=True)
class KedaTrigger:
    """What the KEDA ScaledObject of the workers scales on (AverageValue on
    max(qt_demand_models{base_model="X"}))."""

    threshold: float  # models one worker serves at once
    activation: float  # activationThreshold: at or below it, no worker at all
    min_replicas: int
    max_replicas: int


# The tiny model's workers' ScaledObject (held to it below).
SCALED_OBJECTS = REPO / "deploy" / "k8s" / "base" / "workers" / "scaledobject.yaml"
KEDA = KedaTrigger(threshold=4, activation=0, min_replicas=0, max_replicas=8)


def test_the_keda_rule_is_the_workers_scaledobject() -> None:
    """Every workers' ScaledObject scales on qt_demand_models with the trigger the test below
    computes (AverageValue, threshold 4, activation 0, from 0 replicas); the tiny model's
    caps at KEDA.max_replicas."""
    objects = [o for o in yaml.safe_load_all(SCALED_OBJECTS.read_text()) if o]
    assert objects
    for spec in (o["spec"] for o in objects):
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        assert "qt_demand_models{" in trigger["metadata"]["query"]
        assert float(trigger["metadata"]["threshold"]) == KEDA.threshold
        assert float(trigger["metadata"]["activationThreshold"]) == KEDA.activation
        assert spec["minReplicaCount"] == KEDA.min_replicas
    (tiny,) = [o["spec"] for o in objects if "tiny-llama" in o["metadata"]["name"]]
    assert tiny["maxReplicaCount"] == KEDA.max_replicas


def keda_replicas(metric: float, trigger: KedaTrigger) -> int:
    """The workers KEDA and its HPA ask for (the HPA's 10 % tolerance aside): none while the
    metric is at or below the activation threshold (with minReplicaCount 0), else, for an
    AverageValue target, ceil(metric / threshold), within [max(1, min), max]."""
    if metric <= trigger.activation and trigger.min_replicas == 0:
        return 0
    wanted = math.ceil(metric / trigger.threshold)
    return min(trigger.max_replicas, max(1, trigger.min_replicas, wanted))


def test_keda_scales_the_workers_from_the_scraped_demand(
    settings: Settings, tmp_path: Path
) -> None:
    """The replicas KEDA's rule gives from the scraped max(qt_demand_models{base_model}) as
    models come: 0 before any, 1 for 1 to 4 models, 2 for 5, 3 for 9, the cap (8) for 40;
    and 0 again once workers have run every op."""
    wanted: list[tuple[int, int]] = []
    made = 0
    with gateway(settings) as http:

        def scraped_replicas() -> tuple[int, int]:
            samples = scrape(http)
            metric = sum(
                s.value
                for s in samples
                if s.name == "qt_demand_models" and s.labels.get("base_model") == "scaled"
            )
            return int(metric), keda_replicas(metric, KEDA)

        wanted.append(scraped_replicas())
        for total in (1, 4, 5, 9, 40):
            asyncio.run(
                queue_pings(settings, "scaled", {f"m-keda-{i}": 1 for i in range(made, total)})
            )
            made = total
            wanted.append(scraped_replicas())
        with running_workers(settings, 2, tmp_path, base_model="scaled"):
            deadline = time.monotonic() + 30
            while scraped_replicas() != (0, 0) and time.monotonic() < deadline:
                time.sleep(0.1)
            wanted.append(scraped_replicas())
    assert wanted == [(0, 0), (1, 1), (4, 1), (5, 2), (9, 3), (40, 8), (0, 0)]
