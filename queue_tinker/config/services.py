"""The stores' settings: QT_REDIS_URL, QT_DATABASE_URL, QT_KEY_PREFIX."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ServicesConfig(BaseModel):
    """Where the service's stores are: Redis, Postgres, and the prefix of every Redis key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    redis_url: str | None = Field(
        default=None,
        description="Redis URL (redis://host:port/db). Unset: `queue-tinker up` starts an "
        "embedded Redis under data_dir.",
    )
    database_url: str | None = Field(
        default=None,
        description="Postgres URL (postgresql://user@host/db). Unset: `queue-tinker up` starts "
        "an embedded Postgres under data_dir.",
    )
    key_prefix: str = Field(
        default="qt",
        description="Prefix of every Redis key, so several deployments or test "
        "runs can share one Redis.",
    )
