"""docker-compose.gpu.yml: layered on docker-compose.yml, workers reserve one NVIDIA GPU each and
run on CUDA; the rest of the service is unchanged."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from test_compose import INSTALL_HINT, _compose_command

ROOT = Path(__file__).resolve().parent.parent


def _config(*files: str, **env: str) -> dict[str, Any]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("QT_")}
    args = [arg for name in files for arg in ("-f", str(ROOT / name))]
    command = _compose_command()
    if command is None:
        pytest.skip(INSTALL_HINT)
    result = subprocess.run(
        [*command, *args, "config", "--format", "json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**clean, **env},
        timeout=60,
    )
    assert result.returncode == 0, f"docker compose config failed:\n{result.stderr}"
    config: dict[str, Any] = json.loads(result.stdout)
    return config


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
