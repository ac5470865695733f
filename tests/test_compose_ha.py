"""docker-compose.ha.yml: layered on docker-compose.yml, Redis gets two replicas and three
Sentinels, and every queue-tinker process reaches it through the Sentinels, waiting for a
replica before it acknowledges (tests/queue/test_redis_failover.py runs the same form with
real processes)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from test_compose import compose_env, docker_compose_config

from queue_tinker.queue.connection import target

ROOT = Path(__file__).resolve().parent.parent
PROCESSES = ("migrate", "gateway", "worker", "housekeeper")


def _services(*files: str) -> dict[str, Any]:
    config = docker_compose_config([ROOT / name for name in files], compose_env())
    services: dict[str, Any] = config["services"]
    return services


def _sentinel_config(service: dict[str, Any]) -> list[str]:
    """The lines the Sentinel's command writes to its config file."""
    script = " ".join(service["command"])
    return shlex.split(script.split(">", 1)[0])[2:]  # after printf '%s\n'


def test_every_process_reaches_redis_through_the_sentinels_and_waits_for_a_replica() -> None:
    services = _services("docker-compose.yml", "docker-compose.ha.yml")
    sentinels = [name for name in services if name.startswith("sentinel-")]
    assert len(sentinels) == 3
    monitored = set()
    for name in sentinels:
        lines = _sentinel_config(services[name])
        (monitor,) = [line.split() for line in lines if line.startswith("sentinel monitor")]
        _, _, service_name, host, port, quorum = monitor
        assert (host, port, int(quorum)) == ("redis", "6379", 2)  # a majority of three
        assert "port 26379" in lines
        monitored.add(service_name)
    (service_name,) = monitored
    for name in PROCESSES:
        found = target(services[name]["environment"]["QT_REDIS_URL"])
        assert found.sentinels == tuple((s, 26379) for s in sentinels), name
        assert found.service == service_name
        assert found.replication.replicas == 1
        assert set(sentinels) <= set(services[name]["depends_on"]), name
    replicas = [name for name in services if name.startswith("redis-replica-")]
    assert len(replicas) == 2
    for name in replicas:
        command = services[name]["command"]
        assert command[command.index("--replicaof") + 1 :] == ["redis", "6379"]
        assert command[command.index("--appendfsync") + 1] == "always"


def test_without_the_override_redis_is_the_single_server_it_was() -> None:
    services = _services("docker-compose.yml")
    assert not any(name.startswith(("sentinel-", "redis-replica-")) for name in services)
    for name in PROCESSES:
        assert services[name]["environment"]["QT_REDIS_URL"] == "redis://redis:6379/0"
