"""Storage settings: the data directory, checkpoint storage and its local cache."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StorageConfig(BaseModel):
    """Where checkpoints and local files are kept: the data directory, checkpoint storage (a
    directory or an S3 bucket) and its local cache."""

    model_config = ConfigDict(extra="forbid", frozen=True)

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

    @model_validator(mode="after")
    def _storage_names_a_place(self) -> StorageConfig:
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
