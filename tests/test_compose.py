"""docker-compose.yml parses and describes the whole service.

Two readers check it: `docker compose config` (Compose v2, where it is installed) and the
compose specification's own bindings (the `compose-spec` package: the file, its variables
interpolated as compose does, validated against the specification's types), so a machine
with only Python still checks the file. Where docker compose is missing, its half of each
test is skipped with a message saying so and how to install it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from compose_spec import PyCompose

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
INSTALL_HINT = (
    "`docker compose` (Compose v2) is not installed, so `docker compose config` was not run "
    "(the compose specification check ran instead). On Debian/Ubuntu as root, `scripts/setup` "
    "installs it (`apt-get install docker-compose-plugin`, or Debian trixie's v2 "
    "`docker-compose`)."
)
READERS = ["docker compose", "compose-spec"]
# Compose's interpolation: $$, ${VAR}, ${VAR:-default} (unset or empty), ${VAR-default}, $VAR.
VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?:(:?-)([^}]*))?\}|\$(\w+)")


def _compose_command() -> list[str] | None:
    """`docker compose`, or the standalone v2 binary when the docker CLI itself is missing."""
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) is None:
            continue
        version = subprocess.run([*cmd, "version", "--short"], capture_output=True, text=True)
        if version.returncode == 0 and not version.stdout.strip().startswith("1."):
            return cmd
    return None


def _interpolate(value: Any, env: dict[str, str]) -> Any:
    if isinstance(value, str):

        def substitute(match: re.Match[str]) -> str:
            if match.group(0) == "$$":
                return "$"
            name, operator, default = match.group(1) or match.group(4), *match.group(2, 3)
            given = env.get(name)
            if (operator == ":-" and not given) or (operator == "-" and given is None):
                return str(default)
            return given or ""

        return VARIABLE.sub(substitute, value)
    if isinstance(value, dict):
        return {key: _interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [_interpolate(item, env) for item in value]
    return value


def _spec_config(env: dict[str, str]) -> dict[str, Any]:
    """The file as the compose specification reads it: YAML (merge keys resolved), variables
    interpolated, replicas cast to the integer the specification wants (compose casts
    interpolated values by the schema's type), then validated and normalised by compose-spec
    (ValueError naming the offending key on a file that breaks the specification)."""
    raw = _interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), env)
    for service in raw.get("services", {}).values():
        deploy = service.get("deploy") or {}
        if isinstance(deploy.get("replicas"), str):
            deploy["replicas"] = int(deploy["replicas"])
    config: dict[str, Any] = PyCompose.from_json(json.dumps(raw)).to_dict()
    return config


def compose_env(**env: str) -> dict[str, str]:
    """This process's environment without its QT_* variables, plus `env`: what the compose
    file is read under."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("QT_")}
    return {**clean, **env}


def docker_compose_config(files: Sequence[Path], env: dict[str, str]) -> dict[str, Any]:
    """`docker compose config` of `files` layered in order, as JSON; skipped, saying how to
    install it, where docker compose is missing."""
    command = _compose_command()
    if command is None:
        pytest.skip(INSTALL_HINT)
    layers = [arg for path in files for arg in ("-f", str(path))]
    result = subprocess.run(
        [*command, *layers, "config", "--format", "json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, f"docker compose config failed:\n{result.stderr}"
    config: dict[str, Any] = json.loads(result.stdout)
    return config


def _config(reader: str = "docker compose", **env: str) -> dict[str, Any]:
    if reader == "compose-spec":
        return _spec_config(compose_env(**env))
    return docker_compose_config([COMPOSE_FILE], compose_env(**env))


@pytest.mark.parametrize("reader", READERS)
def test_compose_lists_the_whole_service(reader: str) -> None:
    """redis, postgres, migrate, gateway and worker all exist and share one Redis/Postgres."""
    services = _config(reader)["services"]
    assert {"redis", "postgres", "migrate", "gateway", "worker"} <= set(services)
    for name in ("migrate", "gateway", "worker"):
        env = services[name]["environment"]
        assert env["QT_REDIS_URL"] == "redis://redis:6379/0"
        assert "@postgres:5432/" in env["QT_DATABASE_URL"]
    assert services["gateway"]["command"][:3] == ["serve", "--host", "0.0.0.0"]


@pytest.mark.parametrize("reader", READERS)
def test_compose_worker_knobs_come_from_the_environment(reader: str) -> None:
    """QT_WORKERS, QT_BASE_MODEL and QT_DEVICE set replicas and the worker's command line."""
    default = _config(reader)["services"]["worker"]
    assert default["deploy"]["replicas"] == 1
    assert default["command"] == [
        "worker",
        "--base-model",
        "queue-tinker/tiny-llama",
        "--device",
        "auto",
    ]

    scaled = _config(reader, QT_WORKERS="3", QT_BASE_MODEL="/models/m", QT_DEVICE="cuda")[
        "services"
    ]
    assert scaled["worker"]["deploy"]["replicas"] == 3
    assert scaled["worker"]["command"] == [
        "worker",
        "--base-model",
        "/models/m",
        "--device",
        "cuda",
    ]


def test_the_specification_check_refuses_a_broken_file() -> None:
    """The compose-spec reader is a real check: an unknown key, a wrong type and a missing
    `services` are each refused, naming what is wrong."""
    for broken, says in (
        ({"services": {"a": {"image": "x", "bogus": 1}}}, "bogus"),
        ({"services": {"a": {"image": "x", "deploy": {"replicas": "n"}}}}, "u64"),
        ({"servics": {}}, "services"),
    ):
        with pytest.raises(ValueError, match=says):
            PyCompose.from_json(json.dumps(broken))


@pytest.mark.parametrize("reader", READERS)
def test_compose_keeps_checkpoints_in_its_minio_bucket(reader: str) -> None:
    """Checkpoints live in MinIO's bucket, made by a one-shot before any worker, gateway or
    housekeeper starts; they all name it (QT_STORAGE=s3://...) and MinIO's endpoint, and no
    container shares a checkpoint volume."""
    services = _config(reader)["services"]
    assert {"minio", "minio-bucket"} <= set(services)
    assert "mc mb --ignore-existing qt/queue-tinker" in " ".join(
        services["minio-bucket"]["command"]
    )
    for name in ("gateway", "worker", "housekeeper"):
        env = services[name]["environment"]
        assert env["QT_STORAGE"] == "s3://queue-tinker/checkpoints"
        assert env["QT_S3_ENDPOINT_URL"] == "http://minio:9000"
        assert env["AWS_ACCESS_KEY_ID"] == services["minio"]["environment"]["MINIO_ROOT_USER"]
        assert "minio-bucket" in services[name]["depends_on"]
        assert not services[name].get("volumes")
