"""The gateway's settings: its address, long polls, sessions, API keys, /metrics."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class GatewayConfig(BaseModel):
    """The HTTP gateway: where it listens, its long polls, held seq_ids, silent sessions, API
    keys, /metrics and the fleet's history."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gateway_host: str = Field(default="127.0.0.1", description="Gateway bind address.")
    gateway_port: int = Field(default=8000, description="Gateway port.")
    long_poll_s: float = Field(
        default=25.0,
        gt=0,
        le=40,
        description="How long the gateway holds a retrieve_future call open waiting for the "
        "result before it answers try_again (the tinker SDK gives up on a call after 45 s).",
    )
    seq_gap_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="How long the gateway holds a model's ops behind a seq_id that never "
        "arrived (a request the client numbered but failed to send) before it gives up on it "
        "and runs the ops after it.",
    )
    session_heartbeat_timeout_s: float = Field(
        default=300.0,
        ge=0,
        description="A gateway session that sent session_heartbeats (the tinker SDK sends one "
        "every 10 s) and then none for this long is taken for a client that went away: its "
        "queued samples are cancelled and its running ones stopped, so they do not hold the "
        "workers. Training ops are left alone. 0: never.",
    )
    api_key_cache_s: float = Field(
        default=5.0,
        ge=0,
        description="How long the gateway remembers a valid API key instead of asking Postgres "
        "again; a revoked key stops working within this time (0: ask every time).",
    )
    api_key_outage_s: float = Field(
        default=900.0,
        ge=0,
        description="While Postgres is unreachable, how long after Postgres last vouched for "
        "an API key the gateway still accepts it (training goes on through Redis); a key "
        "Postgres refused at its last check (revoked) stays refused. 0: no key works while "
        "Postgres is away.",
    )
    metrics_token: str | None = Field(
        default=None,
        min_length=1,
        description="Bearer token the gateway's GET /metrics requires (Authorization: Bearer "
        "<token>); unset, /metrics is open to anyone who reaches the gateway. An empty value is "
        "refused (it would let a bare `Authorization: Bearer` in).",
    )
    history_interval_s: float = Field(
        default=15.0,
        ge=0,
        description="How often the fleet's history (per base model: queue depth, oldest wait, "
        "live workers; the fleet's tokens per second) is sampled into Redis for the "
        "dashboard's charts; whichever gateway replica gets there first takes each sample. "
        "0: no gateway samples.",
    )
    history_retention_s: float = Field(
        default=21_600.0,
        gt=0,
        description="How long the fleet's history is kept in Redis (6 h: 1,440 samples a "
        "series at 15 s).",
    )
