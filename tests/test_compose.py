"""docker-compose.yml parses and describes the whole service (`docker compose config`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
INSTALL_HINT = (
    "`docker compose` (Compose v2) is not installed. On Debian/Ubuntu as root: "
    "`apt-get install docker-compose-plugin` (Docker's apt repo) or `apt-get install "
    "docker-compose` where that package is v2 (Debian trixie+); `.ci/run` installs it for you."
)


def _compose_command() -> list[str]:
    """`docker compose`, or the standalone v2 binary when the docker CLI itself is missing."""
    candidates = [["docker", "compose"], ["docker-compose"]]
    for cmd in candidates:
        if shutil.which(cmd[0]) is None:
            continue
        version = subprocess.run([*cmd, "version", "--short"], capture_output=True, text=True)
        if version.returncode == 0 and not version.stdout.strip().startswith("1."):
            return cmd
    pytest.fail(INSTALL_HINT)


def _config(**env: str) -> dict[str, Any]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("QT_")}
    result = subprocess.run(
        [*_compose_command(), "-f", str(ROOT / "docker-compose.yml"), "config", "--format", "json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**clean, **env},
        timeout=60,
    )
    assert result.returncode == 0, f"docker compose config failed:\n{result.stderr}"
    config: dict[str, Any] = json.loads(result.stdout)
    return config


def test_compose_lists_the_whole_service() -> None:
    """redis, postgres, migrate, gateway and worker all exist and share one Redis/Postgres."""
    services = _config()["services"]
    assert {"redis", "postgres", "migrate", "gateway", "worker"} <= set(services)
    for name in ("migrate", "gateway", "worker"):
        env = services[name]["environment"]
        assert env["QT_REDIS_URL"] == "redis://redis:6379/0"
        assert "@postgres:5432/" in env["QT_DATABASE_URL"]
    assert services["gateway"]["command"][:3] == ["serve", "--host", "0.0.0.0"]


def test_compose_worker_knobs_come_from_the_environment() -> None:
    """QT_WORKERS, QT_BASE_MODEL and QT_DEVICE set replicas and the worker's command line."""
    default = _config()["services"]["worker"]
    assert default["deploy"]["replicas"] == 1
    assert default["command"] == [
        "worker", "--base-model", "queue-tinker/tiny-llama", "--device", "auto"
    ]

    scaled = _config(QT_WORKERS="3", QT_BASE_MODEL="/models/m", QT_DEVICE="cuda")["services"]
    assert scaled["worker"]["deploy"]["replicas"] == 3
    assert scaled["worker"]["command"] == [
        "worker", "--base-model", "/models/m", "--device", "cuda"
    ]
