"""The checkpoint store the settings name (QT_STORAGE and the QT_S3_* settings)."""

from __future__ import annotations

from pathlib import Path

from queue_tinker.settings import Settings
from queue_tinker.storage.base import CheckpointStore
from queue_tinker.storage.local import LocalStore


def open_store(settings: Settings, location: str | None = None) -> CheckpointStore:
    """The configured store (or the one at `location`, with the settings' S3 options); boto3
    is imported only for s3:// storage."""
    location = location if location is not None else settings.storage_location
    if location.startswith("s3://"):
        from queue_tinker.storage.s3 import S3Store

        return S3Store(
            location,
            settings.storage_cache_dir,
            endpoint_url=settings.s3_endpoint_url,
            public_endpoint_url=settings.s3_public_endpoint_url,
            region=settings.s3_region,
            multipart_threshold=settings.s3_multipart_threshold_bytes,
            max_attempts=settings.s3_max_attempts,
            cache_bytes=settings.storage_cache_bytes,
        )
    return LocalStore(Path(location))
