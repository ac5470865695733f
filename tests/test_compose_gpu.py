"""docker-compose.gpu.yml: layered on docker-compose.yml, workers reserve one NVIDIA GPU each and
run on CUDA; the rest of the service is unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from test_compose import compose_env, docker_compose_config

ROOT = Path(__file__).resolve().parent.parent


def _config(*files: str, **env: str) -> dict[str, Any]:
    return docker_compose_config([ROOT / name for name in files], compose_env(**env))


def test_gpu_override_reserves_a_gpu_per_worker_and_runs_on_cuda() -> None:
    """With the override, each worker replica reserves one NVIDIA GPU and starts with
    --device cuda; QT_WORKERS and QT_BASE_MODEL still apply, other services are as without."""
    plain = _config("docker-compose.yml")["services"]
    gpu = _config(
        "docker-compose.yml",
        "docker-compose.gpu.yml",
        QT_WORKERS="8",
        QT_BASE_MODEL="meta-llama/Llama-3.1-8B",
    )["services"]
    worker = gpu["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert worker["deploy"]["replicas"] == 8
    assert worker["command"] == [
        "worker",
        "--base-model",
        "meta-llama/Llama-3.1-8B",
        "--device",
        "cuda",
    ]
    assert worker["environment"]["QT_REDIS_URL"] == "redis://redis:6379/0"  # still the anchor's
    assert worker["environment"]["QT_DTYPE"] == "auto"
    assert not plain["worker"]["deploy"].get("resources")  # compose prints {} for none
    for name in ("redis", "postgres", "gateway", "migrate", "housekeeper"):
        assert (
            gpu[name]
            == _config(
                "docker-compose.yml", QT_WORKERS="8", QT_BASE_MODEL="meta-llama/Llama-3.1-8B"
            )["services"][name]
        )
