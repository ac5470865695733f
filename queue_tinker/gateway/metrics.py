"""GET /metrics: the queue, the demand per base model, the workers and the op counters in the
Prometheus text format.

Every scrape reads Redis afresh (`queue_overview` + `read_metrics`) and renders through a
collector registered in a new `CollectorRegistry`: the numbers live in Redis, shared by every
gateway replica, so there is no process-local state to drift between scrapes or replicas.
"""

from __future__ import annotations

import secrets
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from queue_tinker.gateway.off_loop import OffLoopRoute
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.observe.fleet import BaseModelLoad, fleet_load, known_base_models
from queue_tinker.queue.observe.metrics import MetricsSnapshot, read_metrics
from queue_tinker.queue.observe.overview import queue_overview
from queue_tinker.settings import Settings


class QueueCollector(Collector):
    """One scrape's worth of numbers: an overview, the base models known to the deployment and
    a metrics snapshot, read just before."""

    def __init__(
        self, overview: dict[str, Any], known_bases: set[str], snapshot: MetricsSnapshot
    ) -> None:
        self.overview = overview
        self.known_bases = known_bases
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        served = {w["base_model"] for w in self.overview["workers"]}
        yield from queue_families(self.overview["queues"], served)
        yield from demand_families(fleet_load(self.overview, self.known_bases))
        yield from worker_families(self.overview["workers"])
        yield from op_families(self.snapshot)


def queue_families(queues: list[dict[str, Any]], served: set[str]) -> Iterator[Metric]:
    # A base model that live workers serve reports an empty active queue as 0 rather than no
    # series at all, so graphs drop to zero and `qt_queue_depth > N` alerts resolve.
    depth: dict[tuple[str, str], int] = {(base, "active"): 0 for base in served}
    models: dict[tuple[str, str], int] = dict.fromkeys(depth, 0)
    oldest: dict[str, float] = dict.fromkeys(served, 0.0)
    for q in queues:
        labels = (q["base_model"], q["state"])
        depth[labels] = depth.get(labels, 0) + q["depth"]
        models[labels] = models.get(labels, 0) + 1
        if q["oldest_wait_s"] is not None:
            oldest[q["base_model"]] = max(oldest.get(q["base_model"], 0.0), q["oldest_wait_s"])
    depth_family = GaugeMetricFamily(
        "qt_queue_depth",
        "Ops queued or running and not yet finished, summed over the models "
        "of a base model, by why they wait (active, paused_capacity: no live worker serves "
        "the base model, paused_rate_limit: the tenant is over its limits).",
        labels=["base_model", "state"],
    )
    models_family = GaugeMetricFamily(
        "qt_queue_models",
        "Models with unfinished ops, by base model and by why they wait.",
        labels=["base_model", "state"],
    )
    for labels in sorted(depth):
        depth_family.add_metric(labels, depth[labels])
        models_family.add_metric(labels, models[labels])
    oldest_family = GaugeMetricFamily(
        "qt_queue_oldest_wait_seconds",
        "Age of the oldest unfinished op of any model of the "
        "base model (time since it was queued; 0 when none waits); grows while ops are stuck.",
        labels=["base_model"],
    )
    for base in sorted(oldest):
        oldest_family.add_metric([base], oldest[base])
    yield from (depth_family, models_family, oldest_family)


def demand_families(load: dict[str, BaseModelLoad]) -> Iterator[Metric]:
    # Every base model known to the deployment reports, 0 when idle: a scaler (KEDA's
    # Prometheus trigger) must read 0 to scale its workers to zero, not an empty answer.
    models = GaugeMetricFamily(
        "qt_demand_models",
        "Models of the base model with unfinished (queued or running) ops, whatever their "
        "state: the work its workers are wanted for. A worker serves several models at once, "
        "so a scaler divides this by how many (KEDA: AverageValue, its threshold).",
        labels=["base_model"],
    )
    unowned = GaugeMetricFamily(
        "qt_demand_unowned_models",
        "Of qt_demand_models, the models no live worker holds the lease of: waiting for an "
        "owner (no live worker serves the base model, or its tenant's training-runs limit "
        "parks it; with workers up, a claim takes well under a second).",
        labels=["base_model"],
    )
    for base in sorted(load):
        models.add_metric([base], load[base].models)
        unowned.add_metric([base], load[base].unowned)
    yield from (models, unowned)


def worker_families(workers: list[dict[str, Any]]) -> Iterator[Metric]:
    live: dict[tuple[str, str], int] = defaultdict(int)
    busy: dict[str, int] = defaultdict(int)
    for w in workers:
        live[(w["base_model"], w["device"])] += 1
        busy[w["base_model"]] += 1 if w["current_op"] else 0
    live_family = GaugeMetricFamily(
        "qt_workers",
        "Live workers (heartbeat within 3 lease lifetimes), by base model and device.",
        labels=["base_model", "device"],
    )
    for labels in sorted(live):
        live_family.add_metric(labels, live[labels])
    busy_family = GaugeMetricFamily(
        "qt_workers_busy",
        "Live workers running an op right now, by base model.",
        labels=["base_model"],
    )
    for base in sorted(busy):
        busy_family.add_metric([base], busy[base])
    owned = GaugeMetricFamily(
        "qt_worker_owned_models",
        "Models a worker holds the lease of (it runs their ops).",
        labels=["worker", "base_model"],
    )
    resident = GaugeMetricFamily(
        "qt_worker_resident_models",
        "Models whose adapter a worker keeps in memory (owned ones and idle ones it lingers on).",
        labels=["worker", "base_model"],
    )
    memory = GaugeMetricFamily(
        "qt_worker_memory_bytes",
        "Resident memory of a worker process (host RAM), as of its last heartbeat.",
        labels=["worker", "base_model", "device"],
    )
    device_memory = GaugeMetricFamily(
        "qt_worker_device_memory_bytes",
        "Accelerator (GPU) memory a worker has in use, as of its last heartbeat; 0 on the CPU.",
        labels=["worker", "base_model", "device"],
    )
    for w in sorted(workers, key=lambda w: w["id"]):
        owned.add_metric([w["id"], w["base_model"]], w["owned"])
        resident.add_metric([w["id"], w["base_model"]], len(w["resident"]))
        worker_labels = [w["id"], w["base_model"], w["device"]]
        memory.add_metric(worker_labels, w["memory_bytes"])
        device_memory.add_metric(worker_labels, w.get("device_memory_bytes", 0))
    yield from (live_family, busy_family, owned, resident, memory, device_memory)


def op_families(snapshot: MetricsSnapshot) -> Iterator[Metric]:
    ops = CounterMetricFamily(
        "qt_ops",
        "Ops finished since the deployment began, by kind and outcome (done, failed).",
        labels=["kind", "status"],
    )
    for op in sorted(snapshot.ops, key=lambda o: (o.kind, o.status)):
        ops.add_metric([op.kind, op.status], op.count)
    latency = HistogramMetricFamily(
        "qt_op_latency_seconds",
        "Time from queued to finished of each finished op (queue wait plus run time), by kind.",
        labels=["kind"],
    )
    for hist in sorted(snapshot.latency, key=lambda h: h.kind):
        latency.add_metric(
            [hist.kind], [(floatToGoString(le), n) for le, n in hist.buckets], hist.sum_s
        )
    tokens = CounterMetricFamily(
        "qt_tokens",
        "Tokens processed by finished ops, by kind; tokens per second is "
        "rate(qt_tokens_total[1m]).",
        labels=["kind"],
    )
    for kind in sorted(snapshot.tokens):
        tokens.add_metric([kind], snapshot.tokens[kind])
    tenant_tokens = CounterMetricFamily(
        "qt_tenant_tokens",
        "Tokens processed by finished ops, by tenant; "
        "rate(qt_tenant_tokens_total[1m]) is a tenant's tokens per second.",
        labels=["tenant"],
    )
    for tenant in sorted(snapshot.tenant_tokens):
        tenant_tokens.add_metric([tenant], snapshot.tenant_tokens[tenant])
    yield from (ops, latency, tokens, tenant_tokens)


def _check_token(request: Request, token: str | None) -> None:
    """With QT_METRICS_TOKEN set, only `Authorization: Bearer <token>` may scrape."""
    if token is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, value = given.partition(" ")
    # compare_digest: the time taken says nothing about how much of the token matched. An
    # empty token (the settings refuse one; model_copy does not check) never lets anyone in.
    if (
        scheme.lower() != "bearer"
        or not token
        or not secrets.compare_digest(value.strip().encode(), token.encode())
    ):
        raise HTTPException(
            401,
            "GET /metrics needs Authorization: Bearer <QT_METRICS_TOKEN>",
            headers={"WWW-Authenticate": "Bearer"},
        )


def metrics_router(settings: Settings, keys: Keys) -> APIRouter:
    router = APIRouter(route_class=OffLoopRoute)

    @router.get("/metrics", include_in_schema=False)
    async def metrics(request: Request) -> Response:
        """Prometheus exposition of the deployment (every tenant: an operator's view)."""
        _check_token(request, settings.metrics_token)
        redis = request.app.state.redis
        overview = await queue_overview(redis, keys, settings, tenants=False)  # not shown
        known_bases = await known_base_models(redis, keys)
        snapshot = await read_metrics(redis, keys)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(QueueCollector(overview, known_bases, snapshot))
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return router
