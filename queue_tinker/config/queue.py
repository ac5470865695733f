"""The queue's settings: leases and heartbeats (and the health file they touch), attempts,
lifetimes, held early calls."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


class QueueConfig(BaseModel):
    """How the queue keeps ops and owners: leases and heartbeats, attempts, how long results
    and sampler weights live, early calls held, unserved base models."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lease_ttl_ms: int = Field(
        default=10_000,
        gt=0,
        description="How long a worker's claim on a model lives without a heartbeat; after it "
        "lapses another worker may take the model over.",
    )
    heartbeat_ms: int = Field(
        default=2_000, gt=0, description="How often a worker renews its leases and registry entry."
    )
    health_file: Path | None = Field(
        default=None,
        description="A file a worker touches each time its heartbeat reaches Redis, and the "
        "housekeeper each time it reaches Redis; `queue-tinker probe` judges its age (an "
        "orchestrator's exec probe). Unset: no file.",
    )
    linger_ms: int = Field(
        default=30_000,
        ge=0,
        description="How long a worker keeps an idle model before releasing it; keeps its "
        "adapter resident for the next burst of ops.",
    )
    max_op_attempts: int = Field(
        default=3,
        ge=1,
        description="How many times an op may start. An op whose worker dies under it (killed, "
        "out of host memory, crashed) or loses its lease runs again on the model's next owner; "
        "one started this many times without finishing fails unrun, with an error naming the "
        "count, so one op cannot end every worker of its base model in turn.",
    )
    result_ttl_s: int = Field(
        default=3_600,
        gt=0,
        description="How long job records, results and idempotency keys stay in Redis after "
        "submission (memory grows with op rate times this); Postgres keeps the request row "
        "for good.",
    )
    ephemeral_sampler_ttl_s: int = Field(
        default=86_400,
        gt=0,
        description="How long the sampler weights that save_weights_and_get_sampling_client "
        "writes without a name are kept.",
    )
    queue_unserved_base_models: bool = Field(
        default=False,
        description="Queue a new training run on a base model no worker has served yet (for "
        "deployments that start workers on demand); false refuses it at once, naming the "
        "served base models.",
    )
    held_ops_window: int = Field(
        default=4_096,
        ge=1,
        description="How far past the seq_id a model waits for a Tinker call's seq_id may be: "
        "the gateway holds an early call until the ones before it arrive, and refuses (400) "
        "one further ahead, which could only pin memory.",
    )
    held_ops_max: int = Field(
        default=256,
        ge=1,
        description="Most early calls (sent ahead of a seq_id that has not arrived) one model "
        "holds; more are answered 429 with Retry-After, which the SDK retries.",
    )
    held_ops_max_bytes: int = Field(
        default=128 * 2**20,
        ge=1024,
        description="Most payload bytes of early calls one model holds in Redis (128 MiB); a "
        "call past it is answered 429 with Retry-After, which the SDK retries.",
    )
