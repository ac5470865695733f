"""The one settings model: every part's config (queue_tinker/config/) read from QT_* variables,
unknown ones refused."""

from __future__ import annotations

import difflib
import json
import logging
import os
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from queue_tinker.config.client import ClientConfig
from queue_tinker.config.engine import EngineConfig
from queue_tinker.config.gateway import GatewayConfig
from queue_tinker.config.queue import QueueConfig
from queue_tinker.config.services import ServicesConfig
from queue_tinker.config.storage import StorageConfig

# QT_* variables that are not settings, so the settings model leaves them alone: the test
# suite's (QT_TEST_REDIS_URL, ...) and the benchmarks' (QT_BENCH_...) own variables, which they
# pass to child processes too; docker-compose.yml's and scripts/setup's knobs, read by those
# files, not by the service; and the Qt GUI toolkit's (QT_QPA_PLATFORM, QT_SCALE_FACTOR, ...),
# which a desktop session exports.
NOT_SETTINGS_PREFIXES = (
    "QT_TEST_",
    "QT_BENCH_",
    "QT_QPA_",
    "QT_SCALE_",
    "QT_SCREEN_",
    "QT_AUTO_SCREEN_",
    "QT_ENABLE_",
    "QT_FONT_",
    "QT_X11_",
    "QT_XCB_",
    "QT_WAYLAND_",
    "QT_QUICK_",
    "QT_LOGGING_",
    "QT_PLUGIN_",
    "QT_IM_",
    "QT_DEBUG_",
    "QT_ACCESSIBILITY",
    "QT_STYLE_OVERRIDE",
)
NOT_SETTINGS = frozenset(
    {
        "QT_WORKERS",
        "QT_BASE_MODEL",
        "QT_DEVICE",
        "QT_IMAGE_TAG",
        "QT_POSTGRES_PASSWORD",
        "QT_TORCH_VERSION",
        "QT_SETUP_SYSTEM_TOOLS",
        "QT_COOKBOOK_VERSION",
        "QT_MINIO_USER",
        "QT_MINIO_PASSWORD",
        "QT_MINIO_PORT",
    }
)


class Settings(
    BaseSettings,
    ServicesConfig,
    StorageConfig,
    QueueConfig,
    EngineConfig,
    GatewayConfig,
    ClientConfig,
):
    """Effective configuration, read from QT_* environment variables: every part's config
    (queue_tinker/config/) at once, each field its QT_<NAME> variable. A part is handed the
    settings whole, typed as its own config, and reads the fields it needs."""

    model_config = SettingsConfigDict(env_prefix="QT_", extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_variables(cls, data: Any) -> Any:
        """A misspelt QT_* variable (QT_REDIS_ULR) would leave its setting at the default
        without a word: refuse it, naming the variable and the nearest setting."""
        unknown_variables(os.environ, set(cls.model_fields))
        return data


def unknown_variables(environ: Mapping[str, str], fields: set[str]) -> None:
    """ValueError naming the first QT_* variable of `environ` that is no setting (and not one
    of NOT_SETTINGS); pydantic-settings itself ignores them."""
    known = {f"QT_{name.upper()}" for name in fields}
    for variable in sorted(environ):
        upper = variable.upper()
        if (
            not upper.startswith("QT_")
            or upper in known
            or upper in NOT_SETTINGS
            or upper.startswith(NOT_SETTINGS_PREFIXES)
        ):
            continue
        nearest = difflib.get_close_matches(upper, sorted(known), n=1)
        hint = f"; did you mean {nearest[0]}?" if nearest else ""
        raise ValueError(
            f"{variable}: not a queue-tinker setting{hint} (`queue-tinker config` lists them all)"
        )


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment, with explicit overrides winning."""
    return Settings(**overrides)  # type: ignore[arg-type]


# --- the deployment `queue-tinker up` runs --------------------------------------------------
UP_FILE = "up.json"  # under the data directory, while `up` runs
# The settings a running `up` hands to a process that names no Redis of its own.
UP_SETTINGS = ("redis_url", "database_url", "storage", "key_prefix")
log = logging.getLogger("queue_tinker")


def up_file(data_dir: Path) -> Path:
    return data_dir / UP_FILE


def write_up_file(settings: Settings) -> Path:
    """What a client in another shell needs to reach this `up`: its pid, the stores' URLs,
    storage and prefix (readable by this user alone: the database URL may hold a password)."""
    path = up_file(settings.data_dir)
    found = {name: getattr(settings, name) for name in UP_SETTINGS}
    found["storage"] = settings.storage_location
    body = {"pid": os.getpid(), **found}
    body["gateway"] = f"http://{settings.gateway_host}:{settings.gateway_port}"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(body, out, indent=2)
    return path


def running_up(data_dir: Path) -> dict[str, str] | None:
    """The deployment a live `queue-tinker up` recorded under `data_dir`, or None (no file, or
    its process is gone)."""
    try:
        found = json.loads(up_file(data_dir).read_text())
    except (OSError, ValueError):
        return None
    try:
        os.kill(int(found["pid"]), 0)
    except ProcessLookupError:
        return None  # a stale file of an `up` that was killed
    except (PermissionError, KeyError, ValueError, TypeError):
        pass  # alive under another user; or an unreadable pid: let the URLs decide
    return {k: str(v) for k, v in found.items()}


def with_running_up(settings: Settings) -> Settings:
    """`settings`, or, where they name no Redis and a `queue-tinker up` runs on this data
    directory, the settings of that deployment (saying so): a client or CLI in another shell
    with nothing set reaches it."""
    if settings.redis_url is not None:
        return settings
    found = running_up(settings.data_dir)
    if found is None:
        return settings
    log.warning(
        "queue-tinker: QT_REDIS_URL is not set; using the deployment `queue-tinker up` runs "
        "(pid %s, %s): Redis %s, Postgres %s",
        found.get("pid"),
        up_file(settings.data_dir),
        found.get("redis_url"),
        found.get("database_url"),
    )
    update = {k: found[k] for k in UP_SETTINGS if k in found}
    if settings.database_url is not None:
        update.pop("database_url", None)
    return settings.model_copy(update=update)


def up_env(data_dir: Path) -> str | None:
    """The running `up`'s settings as `export QT_...=...` lines (`eval "$(queue-tinker up
    --env)"`), or None when none runs on `data_dir`."""
    found = running_up(data_dir)
    if found is None:
        return None
    names = [k for k in UP_SETTINGS if found.get(k)]
    return "\n".join(f"export QT_{k.upper()}={shlex.quote(found[k])}" for k in names)


def settings_env(settings: Settings, base: Mapping[str, str]) -> dict[str, str]:
    """`base` with every effective setting as its QT_* variable (unset ones removed), so a
    child process sees exactly these settings."""
    env = {k: v for k, v in base.items() if not k.startswith("QT_")}
    for name in type(settings).model_fields:
        value = getattr(settings, name)
        if value is not None:
            env[f"QT_{name.upper()}"] = str(value)
    return env
