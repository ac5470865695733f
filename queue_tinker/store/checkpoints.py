"""Checkpoints as stored: their files in checkpoint storage (the `qt_meta.json` each holds is
the source of truth) and their rows. Expiry, a user's delete and a TTL change all go through
here, so the storage checks and the meta-first rule hold for each of them; the housekeeper's
jobs (services/housekeeper.py), the gateway and the REST client call these. No Redis here:
whoever sets a TTL schedules its expiry job through queue/expiry_jobs.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from queue_tinker.errors import CheckpointPathError, StorageUnavailableError
from queue_tinker.store import queries
from queue_tinker.store.checkpoint_queries import RowMark, mark_checkpoint_deleted
from queue_tinker.store.models import Checkpoint
from queue_tinker.types.checkpoints import META_FILE

log = logging.getLogger(__name__)


class Outcome(StrEnum):
    """What one expiry did (the housekeeper job's return value)."""

    EXPIRED = "expired"  # the files are gone and the row says so (now or before)
    KEPT = "kept"  # not expired by the checkpoint's own meta (or not ours): nothing touched
    ROW_MISSING = "row-missing"  # files gone, row not recorded yet (a retry is scheduled)


OUTCOMES = {
    RowMark.DELETED: Outcome.EXPIRED,
    RowMark.KEPT: Outcome.KEPT,
    RowMark.MISSING: Outcome.ROW_MISSING,
}


class Disk(Enum):
    REMOVED = "removed"  # we removed the files just now
    ABSENT = "absent"  # nothing there (removed earlier)
    KEPT = "kept"  # there, and not expired (or not the checkpoint asked for)


# --- the files -----------------------------------------------------------------------------


def read_meta(directory: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((directory / META_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:  # unreadable: not something to delete on a guess
        log.warning("checkpoint %s: unreadable %s (%s); leaving it", directory, META_FILE, err)
        return None
    return meta if isinstance(meta, dict) else None


def is_expired(meta: dict[str, Any] | None, checkpoint_id: str, now: float) -> bool:
    if meta is None or meta.get("id") != checkpoint_id:
        return False
    expires_at = meta.get("expires_at")
    return isinstance(expires_at, int | float) and expires_at <= now


def check_inside(directory: Path, storage_dir: Path | None) -> None:
    """Refuse to touch anything outside checkpoint storage (paths come from Redis and
    Postgres), and fail loudly if storage is not there (an unmounted volume must not read as
    'every checkpoint already deleted')."""
    if storage_dir is None:
        return
    root = storage_dir.resolve()
    if not root.is_dir():
        raise StorageUnavailableError(
            f"checkpoint storage {root} does not exist here; the housekeeper needs the same "
            "storage directory as the workers"
        )
    target = directory.resolve()
    if target == root or not target.is_relative_to(root):
        raise CheckpointPathError(f"{directory} is not inside checkpoint storage {root}")


def is_due(meta: dict[str, Any] | None, checkpoint_id: str, now: float, force: bool) -> bool:
    """Whether to remove: always our checkpoint (its meta names it), and expired unless forced
    (a user's delete)."""
    if force:
        return meta is not None and meta.get("id") == checkpoint_id
    return is_expired(meta, checkpoint_id, now)


def remove_if_expired(
    checkpoint_id: str,
    directory: Path,
    now: float,
    storage_dir: Path | None,
    *,
    force: bool = False,
) -> tuple[Disk, float | None]:
    """Remove `directory` if its meta says `checkpoint_id` expired by `now` (with `force`: if
    it is that checkpoint at all); the state on disk and, when kept, the meta's expires_at."""
    check_inside(directory, storage_dir)
    if not directory.exists():
        return Disk.ABSENT, None
    meta = read_meta(directory)
    if not is_due(meta, checkpoint_id, now, force):
        expires_at = meta.get("expires_at") if meta and meta.get("id") == checkpoint_id else None
        return Disk.KEPT, expires_at if isinstance(expires_at, int | float) else None
    # Move it aside in one rename, so readers see the checkpoint or nothing, never half of it;
    # a hidden sibling name, like the workers' own temporary directories.
    trash = directory.with_name(f".{directory.name}-expired-{uuid.uuid4().hex[:8]}")
    try:
        directory.rename(trash)
    except FileNotFoundError:
        return Disk.ABSENT, None
    if not is_due(read_meta(trash), checkpoint_id, now, force):
        # Saved again (or its TTL moved) between our read and the rename: put it back.
        trash.rename(directory)
        return Disk.KEPT, None
    shutil.rmtree(trash)
    return Disk.REMOVED, None


def set_meta_expiry(
    checkpoint_id: str, directory: Path, expires_at: float | None, storage_dir: Path | None
) -> bool:
    """Write a new expires_at (unix seconds, None: never) into the checkpoint's meta, which is
    what expiry obeys; False if the directory does not hold that checkpoint (any more)."""
    return update_meta(checkpoint_id, directory, storage_dir, expires_at=expires_at)


def set_meta_public(
    checkpoint_id: str, directory: Path, public: bool, storage_dir: Path | None
) -> bool:
    """Mark the checkpoint published (readable by every tenant) or not in its meta, which is
    what workers obey; False if the directory does not hold that checkpoint (any more)."""
    return update_meta(checkpoint_id, directory, storage_dir, public=public)


def update_meta(
    checkpoint_id: str, directory: Path, storage_dir: Path | None, **changes: object
) -> bool:
    check_inside(directory, storage_dir)
    meta = read_meta(directory)
    if meta is None or meta.get("id") != checkpoint_id:
        return False
    meta.update(changes)
    # Replace the file in one rename: the housekeeper never reads half a meta. If the
    # directory is moved aside meanwhile, the write fails instead of landing in its trash.
    tmp = directory / f".{META_FILE}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.write_text(json.dumps(meta, indent=2))
        os.replace(tmp, directory / META_FILE)
    except FileNotFoundError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    return True


def copy_checkpoint_files(
    source: Path, destination: Path, storage_dir: Path | None, **meta_changes: object
) -> int:
    """Copy a checkpoint directory (copy_weights): every file hard-linked where storage allows
    (named checkpoints are never rewritten in place, so the copy shares the bytes and outlives
    the source's removal), copied where it does not; its meta rewritten with `meta_changes`
    (the new run, tenant, id). Appears in one rename; a repeat replaces it. Returns bytes."""
    check_inside(source, storage_dir)
    check_inside(destination, storage_dir)
    meta = read_meta(source)
    if meta is None:
        raise FileNotFoundError(source / META_FILE)
    destination.parent.mkdir(parents=True, exist_ok=True)
    tmp = destination.with_name(f".{destination.name}-copy-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        for item in source.iterdir():
            if item.name != META_FILE and item.is_file():
                _link_or_copy(item, tmp / item.name)
        (tmp / META_FILE).write_text(json.dumps({**meta, **meta_changes}, indent=2))
        size = sum(f.stat().st_size for f in tmp.iterdir())
        if destination.exists():  # a retried copy: the same files again
            shutil.rmtree(destination)
        tmp.rename(destination)
        return size
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another device, or a file system without hard links
        shutil.copy2(source, target)


# --- files, then the row ------------------------------------------------------------------


@dataclass(frozen=True)
class ExpiryResult:
    outcome: Outcome
    files_removed: bool
    meta_expires_at: float | None  # when kept: what the checkpoint's meta says


async def expire(
    engine: AsyncEngine,
    checkpoint_id: str,
    directory: Path,
    storage_dir: Path | None,
    *,
    files_removed: bool,
    force: bool = False,
) -> ExpiryResult:
    # Off the event loop: the gateway runs this too, and an rmtree can take a while.
    disk, meta_expires_at = await asyncio.to_thread(
        remove_if_expired, checkpoint_id, directory, time.time(), storage_dir, force=force
    )
    if disk is Disk.KEPT and not force:
        return ExpiryResult(Outcome.KEPT, files_removed, meta_expires_at)
    if disk is Disk.KEPT:  # forced, but the directory is not this checkpoint's: leave it
        log.warning(
            "checkpoint %s: %s does not hold it (no matching %s); files left in place",
            checkpoint_id,
            directory,
            META_FILE,
        )
    removed = files_removed or disk is Disk.REMOVED
    async with engine.begin() as conn:
        # A user's delete marks the row whatever its expires_at says.
        mark = await mark_checkpoint_deleted(
            conn, checkpoint_id, only_if_due=not (removed or force)
        )
    return ExpiryResult(OUTCOMES[mark], removed, None)


async def set_checkpoint_ttl(
    sessions: async_sessionmaker[AsyncSession],
    storage_dir: Path | None,
    tenant_id: str,
    row: Checkpoint,
    expires_at: float | None,
) -> bool:
    """Set (unix seconds) or remove (None) a checkpoint's expiry: the meta file first, since it
    is what expiry obeys; then the row (listings). The caller then schedules the expiry job
    (queue/expiry_jobs.py schedule_expiry); a removed TTL leaves any job in place: it finds no
    expiry in the meta and does nothing. False if the checkpoint is gone meanwhile."""
    written = await asyncio.to_thread(
        set_meta_expiry, row.id, Path(row.path), expires_at, storage_dir
    )
    when = datetime.fromtimestamp(expires_at, tz=UTC) if expires_at is not None else None
    return written and await queries.set_checkpoint_expiry(sessions, tenant_id, row.id, when)


async def delete_checkpoint(
    engine: AsyncEngine, checkpoint_id: str, directory: Path, storage_dir: Path | None
) -> bool:
    """A user's delete (the REST DELETE): the same path as TTL expiry (storage checks, one
    rename aside, then deleted_at), only without waiting for the TTL. True if files were
    removed now. A scheduled expiry job for it later finds nothing to do."""
    result = await expire(
        engine, checkpoint_id, directory, storage_dir, files_removed=False, force=True
    )
    return result.files_removed
