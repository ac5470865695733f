"""deploy/grafana/queue-tinker.json and deploy/prometheus/alerts.yaml name only series the
gateway's /metrics exports: every qt_ metric in their PromQL is a family a real scrape holds
(with the suffix its type gives: _total of a counter; _bucket, _sum, _count of a histogram)."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from procs import REPO, queue_pings, running_workers
from prometheus_client.parser import text_string_to_metric_families
from test_metrics import gateway

from queue_tinker.client import ServiceClient
from queue_tinker.settings import Settings

DASHBOARD = REPO / "deploy" / "grafana" / "queue-tinker.json"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yaml"
# The series each metric type adds to its family's name (Prometheus' exposition format).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
}
# A metric name in PromQL: not part of a longer name, nor a Grafana variable ($qt_...).
METRIC = re.compile(r"(?<![A-Za-z0-9_:$])qt_[A-Za-z0-9_:]*")


def dashboard_queries(dashboard: Any) -> Iterator[str]:
    """Every PromQL text of a Grafana dashboard: panels' `expr`, variables' queries."""
    if isinstance(dashboard, dict):
        for name, value in dashboard.items():
            if name in ("expr", "query", "definition") and isinstance(value, str):
                yield value
            else:
                yield from dashboard_queries(value)
    elif isinstance(dashboard, list):
        for item in dashboard:
            yield from dashboard_queries(item)


def alert_queries(rules: Any) -> Iterator[str]:
    for group in rules["groups"]:
        for rule in group["rules"]:
            yield rule["expr"]


def metric_names(queries: Iterator[str]) -> set[str]:
    return {name for query in queries for name in METRIC.findall(query)}


def exported_series(families: dict[str, str], name: str) -> bool:
    """Whether `name` is a series of an exported family: a gauge by its own name, a counter
    or histogram by its name and one of its type's suffixes."""
    if families.get(name) in ("gauge", "unknown"):
        return True
    return any(
        name == family + suffix
        for family, kind in families.items()
        for suffix in SUFFIXES.get(kind, ())
    )


def unknown_metrics(queries: Iterator[str], families: dict[str, str]) -> set[str]:
    return {name for name in metric_names(queries) if not exported_series(families, name)}


@pytest.fixture(scope="module")
def families(
    redis_url: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    """Family name -> type of one scrape of a gateway with a worker that ran a ping and work
    waiting on a base model no worker serves (so the op, latency, worker and demand families
    have samples)."""
    tmp = tmp_path_factory.mktemp("grafana")
    settings = Settings(
        redis_url=redis_url,
        database_url=database_url,
        key_prefix=f"qt-test-{uuid.uuid4().hex[:10]}",
        data_dir=tmp / "data",
        lease_ttl_ms=3_000,
        heartbeat_ms=500,
    )
    try:
        asyncio.run(queue_pings(settings, "absent", {"m-grafana-waiting": 1}))
        with running_workers(settings, 1, tmp), gateway(settings) as http:
            with ServiceClient(settings) as service:
                service.create_lora_training_client("tiny", rank=4).ping().result(timeout=20)
            response = http.get("/metrics")
        assert response.status_code == 200, response.text
        scraped = list(text_string_to_metric_families(response.text))
        with_samples = {f.name for f in scraped if f.samples}
        assert {"qt_ops", "qt_op_latency_seconds", "qt_workers", "qt_demand_models"} <= with_samples
        yield {f.name: f.type for f in scraped}
    finally:
        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(match=f"{settings.key_prefix}:*", count=1000):
            client.delete(key)
        client.close()


def test_the_dashboard_and_the_alerts_name_only_exported_metrics(families: dict[str, str]) -> None:
    """Every qt_ metric the Grafana dashboard and the alert rules query is exported, and they
    query what they are for: queue depth, oldest wait, tokens, workers, demand, op latency."""
    dashboard = json.loads(DASHBOARD.read_text())
    rules = yaml.safe_load(ALERTS.read_text())
    assert unknown_metrics(dashboard_queries(dashboard), families) == set()
    assert unknown_metrics(alert_queries(rules), families) == set()
    assert metric_names(dashboard_queries(dashboard)) >= {
        "qt_queue_depth",
        "qt_queue_oldest_wait_seconds",
        "qt_tokens_total",
        "qt_workers",
        "qt_demand_models",
        "qt_demand_unowned_models",
        "qt_op_latency_seconds_bucket",
    }
    assert metric_names(alert_queries(rules)) == {
        "qt_demand_models",
        "qt_workers",
        "qt_queue_oldest_wait_seconds",
    }


@pytest.mark.parametrize(
    ("where", "exported", "mutated"),
    [
        ("dashboard", "qt_queue_depth{", "qt_queue_depths{"),  # a name that does not exist
        ("dashboard", "qt_tokens_total", "qt_tokens"),  # a counter without its _total
        ("alerts", "(qt_workers)", "(qt_workers_total)"),  # a gauge read as a counter
        ("alerts", "qt_queue_oldest_wait_seconds", "qt_queue_oldest_wait_seconds_bucket"),
    ],
)
def test_a_mutated_copy_naming_a_missing_metric_fails(
    families: dict[str, str], tmp_path: Path, where: str, exported: str, mutated: str
) -> None:
    """A copy of the dashboard or the rules with a metric name changed into one /metrics does
    not export is caught, naming it."""
    source = DASHBOARD if where == "dashboard" else ALERTS
    text = source.read_text()
    assert exported in text
    copy = tmp_path / source.name
    copy.write_text(text.replace(exported, mutated))
    if where == "dashboard":
        queries = dashboard_queries(json.loads(copy.read_text()))
    else:
        queries = alert_queries(yaml.safe_load(copy.read_text()))
    assert unknown_metrics(queries, families) == {METRIC.findall(mutated)[0]}


def test_the_alert_rules_say_what_they_watch() -> None:
    """Each rule has a name, a `for` that keeps a blip from firing, a severity and a summary."""
    rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
    assert [r["alert"] for r in rules] == [
        "QueueTinkerWorkWithoutWorker",
        "QueueTinkerOldestWaitHigh",
    ]
    for rule in rules:
        assert re.fullmatch(r"\d+m", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning")
        assert "{{ $labels.base_model }}" in rule["annotations"]["summary"]
