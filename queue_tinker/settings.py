"""The one settings model: every knob, its env var (QT_*) and what it does."""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from queue_tinker.types.requests.request_limits import DEFAULT_LIMITS

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


class Settings(BaseSettings):
    """Effective configuration, read from QT_* environment variables."""

    model_config = SettingsConfigDict(env_prefix="QT_", extra="forbid", frozen=True)

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
    data_dir: Path = Field(
        default=Path(".qt-data"),
        description="Where the embedded Redis and Postgres keep their files.",
    )
    storage: str | None = Field(
        default=None,
        description="Where checkpoints, snapshots and markers are kept: a directory (default: "
        "data_dir/checkpoints), which every worker, gateway and housekeeper must see, or an "
        "S3 bucket, s3://bucket/prefix (AWS, MinIO, R2, ...), so hosts share no disk. S3 "
        "credentials come from the standard AWS variables (AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ...).",
    )
    storage_cache: Path | None = Field(
        default=None,
        description="With s3:// storage: where a worker keeps its local copies of checkpoints "
        "(written there, then uploaded; downloaded there, then reused while current). "
        "Default: data_dir/storage-cache.",
    )
    storage_cache_bytes: int = Field(
        default=20 * 2**30,
        gt=0,
        description="With s3:// storage: the most bytes the storage cache holds; past it the "
        "least recently used copies are evicted (read again from the store when next needed), "
        "sparing copies used in the last 10 minutes.",
    )
    s3_endpoint_url: str | None = Field(
        default=None,
        description="With s3:// storage: the S3 API's URL for a store other than AWS "
        "(http://minio:9000, an R2 account's endpoint); unset: AWS's own.",
    )
    s3_public_endpoint_url: str | None = Field(
        default=None,
        description="With s3:// storage: the address clients reach the store at, which the "
        "gateway's download URLs (presigned GETs) name, where it differs from "
        "QT_S3_ENDPOINT_URL (compose: http://minio:9000 inside, http://localhost:9000 "
        "outside); unset: QT_S3_ENDPOINT_URL.",
    )
    s3_region: str | None = Field(
        default=None,
        description="With s3:// storage: the bucket's region; unset: AWS_REGION / "
        "AWS_DEFAULT_REGION or the AWS config file.",
    )
    s3_multipart_threshold_bytes: int = Field(
        default=64 * 2**20,
        ge=5 * 2**20,
        description="With s3:// storage: files from this size up are uploaded in parts of this "
        "size, in parallel (S3's smallest part is 5 MiB); 64 MiB keeps a LoRA adapter of a "
        "small model in one request.",
    )
    s3_max_attempts: int = Field(
        default=4,
        ge=1,
        description="With s3:// storage: tries of each request before the op that needed it "
        "fails with a retryable error (backing off between them, up to a few seconds).",
    )
    key_prefix: str = Field(
        default="qt",
        description="Prefix of every Redis key, so several deployments or test "
        "runs can share one Redis.",
    )
    lease_ttl_ms: int = Field(
        default=10_000,
        gt=0,
        description="How long a worker's claim on a model lives without a heartbeat; after it "
        "lapses another worker may take the model over.",
    )
    heartbeat_ms: int = Field(
        default=2_000, gt=0, description="How often a worker renews its leases and registry entry."
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
    max_resident_adapters: int | None = Field(
        default=None,
        ge=1,
        description="LoRA adapters a worker keeps in memory; beyond this the least recently "
        "used one is written to checkpoint storage and restored on its next op. Unset: as many "
        "as the GPU holds beside the model and its budgets (the fit planner), at most "
        "32; 32 on the CPU. Set, a worker whose GPU cannot hold them refuses to start.",
    )
    snapshot_every_steps: int = Field(
        default=20,
        ge=1,
        description="A worker writes a model's state to storage every this many optimizer "
        "steps (and on eviction or hand-over); the model's op log is trimmed up to it.",
    )
    sample_batch_sequences: int | None = Field(
        default=None,
        ge=1,
        description="Most sequences a worker generates in one batch; concurrent sample "
        "requests beyond it run in the next batch. Bounds KV-cache memory. Unset: 64 on the "
        "CPU; on CUDA, what the device's free memory holds at start-up (4K-token sequences).",
    )
    sample_cache_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Most KV-cache tokens (sequences x positions) a worker's sampling batch may "
        "come to hold: a sample joins the batch only if, with every sequence in it running to "
        "its max_tokens, the cache stays within this; the rest wait for sequences to finish "
        "(one sample that alone needs more runs alone). Unset: no cap on the CPU; on CUDA, "
        "what the device's free memory holds at start-up.",
    )
    cross_adapter_batch: bool = Field(
        default=True,
        description="Whether a worker runs the forward / forward_backward ops of different "
        "models (LoRA adapters on its base model) together, in one model pass with each row "
        "on its own adapter, and their optim_steps in the same batch; results equal running "
        "them one at a time. Off (0): training ops run one at a time.",
    )
    train_batch_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Most padded tokens (rows x longest row) in one shared training pass of a "
        "cross-adapter batch; ops beyond it go in the next pass (one op always runs, however "
        "big). Bounds activation memory. Unset: 32768 on the CPU; on CUDA, what the device's "
        "free memory holds at start-up. A pass that runs out of memory anyway is split in "
        "halves and retried.",
    )
    max_tokens_per_datum: int = Field(
        default=DEFAULT_LIMITS.tokens_per_datum,
        ge=1,
        description="Most tokens in one sequence of a request: a training datum's model_input "
        "(and each of its loss_fn_inputs), a sample's prompt, a sample's max_tokens. 32K is the "
        "longest context most served models train at; the model's own context length still "
        "applies on the worker.",
    )
    max_datums_per_request: int = Field(
        default=DEFAULT_LIMITS.datums_per_request,
        ge=1,
        description="Most datums in one forward / forward_backward request. The tinker SDK "
        "splits a bigger call into chunks of 1,024, so its calls of any size pass; the Python "
        "client refuses a bigger batch (split it into several calls).",
    )
    max_samples_per_request: int = Field(
        default=DEFAULT_LIMITS.samples_per_request,
        ge=1,
        description="Most samples (num_samples) one sample request may ask for; a worker "
        "generates them sample_batch_sequences at a time.",
    )
    max_request_bytes: int = Field(
        default=DEFAULT_LIMITS.request_bytes,
        ge=1024,
        description="Most bytes of one request: the gateway refuses a bigger HTTP body (413, "
        "counted as it streams in, before it is parsed), and client, gateway and worker refuse "
        "an op body that encodes bigger. 64 MiB is ~4M tokens of training data, far over the "
        "SDK's own 5 MB chunks, and bounds what one op holds in Redis.",
    )
    max_image_bytes: int = Field(
        default=DEFAULT_LIMITS.image_bytes,
        ge=1,
        description="Most bytes of one image chunk (its encoded PNG or JPEG) in a model "
        "input; client, gateway and worker refuse a bigger one, naming the chunk.",
    )
    max_image_pixels: int = Field(
        default=DEFAULT_LIMITS.image_pixels,
        ge=1,
        description="Most pixels (width x height, read off the image's header) of one image "
        "chunk: a worker never decodes more (a small file can describe a huge image). The "
        "model's processor then resizes it to what the model reads.",
    )
    ephemeral_sampler_ttl_s: int = Field(
        default=86_400,
        gt=0,
        description="How long the sampler weights that save_weights_and_get_sampling_client "
        "writes without a name are kept.",
    )
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
    gateway_host: str = Field(default="127.0.0.1", description="Gateway bind address.")
    gateway_port: int = Field(default=8000, description="Gateway port.")
    metrics_token: str | None = Field(
        default=None,
        min_length=1,
        description="Bearer token the gateway's GET /metrics requires (Authorization: Bearer "
        "<token>); unset, /metrics is open to anyone who reaches the gateway. An empty value is "
        "refused (it would let a bare `Authorization: Bearer` in).",
    )
    api_key: str | None = Field(
        default=None,
        description="API key the client sends (tml-...); unset uses the default tenant.",
    )
    tenant: str = Field(
        default="default",
        pattern=r"^[A-Za-z0-9._-]{1,64}$",
        description="Tenant the Python client acts for. It talks to Redis directly, so it is "
        "trusted to say who it is; the gateway instead learns the tenant from the API key.",
    )
    dtype: Literal["auto", "bf16", "fp32"] = Field(
        default="auto",
        description="The base model's compute dtype on workers: auto is bf16 on CUDA and fp32 "
        "on the CPU. LoRA weights, their gradients, AdamW moments and checkpoints stay fp32 "
        "either way.",
    )
    liger_kernels: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Put liger-kernel's Triton RMSNorm, RoPE and SwiGLU in the base model "
        "(the gpu extra; CUDA only; not in worker groups). auto: on CUDA where liger is "
        "installed, a worker alone; on: a worker that cannot refuses to start; off: never. "
        "bench.mfu measured 1.19x the training pass at the Llama-3.1-8B shape on an H100 and "
        "1.17x on an H200, where the GPU suite holds them to the eager model.",
    )
    decode_step: Literal["auto", "padded", "slots", "graphs"] = Field(
        default="padded",
        description="How the sampler runs a decode step. padded: the rows' KV cache "
        "left-padded to the longest row, an eager step. slots: every row in a fixed KV slot "
        "and the rows' adapters in fixed LoRA slots, one fixed sequence of kernels whatever "
        "the mix of adapters (eager). graphs: slots, each batch bucket's step captured as a "
        "CUDA graph and replayed (CUDA only; elsewhere as slots). auto: graphs on CUDA, padded "
        "on the CPU. Worker groups and models the slots do not fit (sliding-window attention, "
        "vision, mixtures of experts' LoRA) run padded. padded by default until the GPU test "
        "suite has run a worker with graphs.",
    )
    lora_matmul_dtype: Literal["auto", "fp32"] = Field(
        default="auto",
        description="The dtype of LoRA's matmuls in training and sampling passes. auto: the "
        "base model's (bf16 on CUDA; fp32 on the CPU), the adapters' fp32 weights cast per "
        "call: LoRA at the base's speed, and no fp32 copy of each LoRA input kept for "
        "backward. fp32: in the adapters' fp32, the input cast up. Weights, gradients, AdamW "
        "moments and checkpoints are fp32 either way.",
    )
    activation_checkpointing: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Whether a training pass keeps only each decoder layer's input and "
        "recomputes the layer in backward (less memory, one more forward of time; equal "
        "results). auto: on CUDA, the fewest layers that keep each pass's activations within "
        "the training budget from free memory (none when the pass fits); on the CPU, every "
        "layer for passes of at least activation_checkpointing_tokens padded tokens.",
    )
    activation_checkpointing_tokens: int = Field(
        default=4_096,
        ge=1,
        description="The padded tokens of a training pass from which auto activation "
        "checkpointing turns on where no memory budget is known (the CPU).",
    )
    queue_unserved_base_models: bool = Field(
        default=False,
        description="Queue a new training run on a base model no worker has served yet (for "
        "deployments that start workers on demand); false refuses it at once, naming the "
        "served base models.",
    )
    api_key_outage_s: float = Field(
        default=900.0,
        ge=0,
        description="While Postgres is unreachable, how long after Postgres last vouched for "
        "an API key the gateway still accepts it (training goes on through Redis); a key "
        "Postgres refused at its last check (revoked) stays refused. 0: no key works while "
        "Postgres is away.",
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

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_variables(cls, data: Any) -> Any:
        """A misspelt QT_* variable (QT_REDIS_ULR) would leave its setting at the default
        without a word: refuse it, naming the variable and the nearest setting."""
        unknown_variables(os.environ, set(cls.model_fields))
        return data

    @model_validator(mode="after")
    def _storage_names_a_place(self) -> Settings:
        if self.storage is not None and self.storage.startswith("s3:"):
            bucket = self.storage.removeprefix("s3://").partition("/")[0]
            if not self.storage.startswith("s3://") or not bucket:
                raise ValueError(
                    f"QT_STORAGE: {self.storage!r} is no S3 location; expected "
                    "s3://bucket/prefix (or a directory)"
                )
        return self

    @property
    def storage_location(self) -> str:
        """QT_STORAGE as given (a directory or s3://bucket/prefix), or the default directory."""
        return self.storage if self.storage is not None else str(self.data_dir / "checkpoints")

    @property
    def storage_is_local(self) -> bool:
        return not self.storage_location.startswith("s3://")

    @property
    def storage_dir(self) -> Path:
        """The checkpoint directory, for local storage (open_store gives either kind)."""
        if not self.storage_is_local:
            raise ValueError(f"QT_STORAGE={self.storage}: object storage has no local directory")
        return Path(self.storage_location)

    @property
    def storage_cache_dir(self) -> Path:
        return self.storage_cache or self.data_dir / "storage-cache"

    @property
    def models_dir(self) -> Path:
        """Where built-in models (queue-tinker/...) are made on first use."""
        return self.data_dir / "models"


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


def settings_env(settings: Settings, base: Mapping[str, str]) -> dict[str, str]:
    """`base` with every effective setting as its QT_* variable (unset ones removed), so a
    child process sees exactly these settings."""
    env = {k: v for k, v in base.items() if not k.startswith("QT_")}
    for name in type(settings).model_fields:
        value = getattr(settings, name)
        if value is not None:
            env[f"QT_{name.upper()}"] = str(value)
    return env
