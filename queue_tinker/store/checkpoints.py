"""Checkpoints as stored: their files in checkpoint storage (queue_tinker/storage: a
directory or a bucket; the `qt_meta.json` each holds is the source of truth) and their rows.
Expiry, a user's delete and a TTL change all go through here, so the storage checks and the
meta-first rule hold for each of them; the housekeeper's jobs (services/housekeeper.py), the
gateway and the REST client call these. No Redis here: whoever sets a TTL schedules its expiry
job through queue/control/expiry_jobs.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from queue_tinker.storage.base import CheckpointStore, Removal
from queue_tinker.store.checkpoint_queries import (
    RowMark,
    mark_checkpoint_deleted,
    set_checkpoint_expiry,
)
from queue_tinker.types.service.checkpoints import META_FILE

log = logging.getLogger(__name__)


class ExpiryOutcome(StrEnum):
    """What one expiry did (the housekeeper job's return value)."""

    EXPIRED = "expired"  # the files are gone and the row says so (now or before)
    KEPT = "kept"  # not expired by the checkpoint's own meta (or not ours): nothing touched
    ROW_MISSING = "row-missing"  # files gone, row not recorded yet (a retry is scheduled)


OUTCOMES = {
    RowMark.DELETED: ExpiryOutcome.EXPIRED,
    RowMark.KEPT: ExpiryOutcome.KEPT,
    RowMark.MISSING: ExpiryOutcome.ROW_MISSING,
}


# --- the files -----------------------------------------------------------------------------


def meta_in_store(store: CheckpointStore, key: str) -> dict[str, Any] | None:
    text = store.read_meta_text(key)
    if text is None:
        return None
    try:
        meta = json.loads(text)
    except ValueError as err:  # unreadable: not something to delete on a guess
        log.warning("checkpoint %s: unreadable %s (%s); leaving it", key, META_FILE, err)
        return None
    return meta if isinstance(meta, dict) else None


def _parsed(text: str | None) -> dict[str, Any] | None:
    try:
        meta = json.loads(text) if text is not None else None
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


def is_expired(meta: dict[str, Any] | None, checkpoint_id: str, now: float) -> bool:
    if meta is None or meta.get("id") != checkpoint_id:
        return False
    expires_at = meta.get("expires_at")
    return isinstance(expires_at, int | float) and expires_at <= now


def is_due(meta: dict[str, Any] | None, checkpoint_id: str, now: float, force: bool) -> bool:
    """Whether to remove: always our checkpoint (its meta names it), and expired unless forced
    (a user's delete)."""
    if force:
        return meta is not None and meta.get("id") == checkpoint_id
    return is_expired(meta, checkpoint_id, now)


def remove_if_expired(
    checkpoint_id: str,
    location: str,
    now: float,
    store: CheckpointStore,
    *,
    force: bool = False,
) -> tuple[Removal, float | None]:
    """Remove the file set at `location` if its meta says `checkpoint_id` expired by `now`
    (with `force`: if it is that checkpoint at all); what happened and, when kept, the meta's
    expires_at. Locations come from Redis and Postgres: one outside `store` is refused."""
    key = store.key_of(location)
    meta = meta_in_store(store, key)
    if meta is None and not store.files(key):
        return Removal.ABSENT, None
    if not is_due(meta, checkpoint_id, now, force):
        expires_at = meta.get("expires_at") if meta and meta.get("id") == checkpoint_id else None
        return Removal.KEPT, expires_at if isinstance(expires_at, int | float) else None
    # Read again once it is out of sight: saved again (or its TTL moved) meanwhile, it stays.
    removal = store.remove(key, lambda text: is_due(_parsed(text), checkpoint_id, now, force))
    return removal, None


def set_meta_expiry(
    checkpoint_id: str, location: str, expires_at: float | None, store: CheckpointStore
) -> bool:
    """Write a new expires_at (unix seconds, None: never) into the checkpoint's meta, which is
    what expiry obeys; False if the location does not hold that checkpoint (any more)."""
    return update_meta(checkpoint_id, location, store, expires_at=expires_at)


def set_meta_public(
    checkpoint_id: str, location: str, public: bool, store: CheckpointStore
) -> bool:
    """Mark the checkpoint published (readable by every tenant) or not in its meta, which is
    what workers obey; False if the location does not hold that checkpoint (any more)."""
    return update_meta(checkpoint_id, location, store, public=public)


def update_meta(
    checkpoint_id: str, location: str, store: CheckpointStore, **changes: object
) -> bool:
    key = store.key_of(location)
    meta = meta_in_store(store, key)
    if meta is None or meta.get("id") != checkpoint_id:
        return False
    meta.update(changes)
    return store.write_text(key, META_FILE, json.dumps(meta, indent=2))


def copy_checkpoint_files(
    source: str, destination: str, store: CheckpointStore, **meta_changes: object
) -> int:
    """Copy a checkpoint (copy_weights) from location `source` to key `destination`, its meta
    rewritten with `meta_changes` (the new run, tenant, id). Appears whole; a repeat replaces
    it. Returns bytes."""
    key = store.key_of(source)
    meta = meta_in_store(store, key)
    if meta is None:
        raise FileNotFoundError(source)
    return store.copy(key, destination, json.dumps({**meta, **meta_changes}, indent=2))


# --- files, then the row ------------------------------------------------------------------


@dataclass(frozen=True)
class ExpiryResult:
    outcome: ExpiryOutcome
    files_removed: bool
    meta_expires_at: float | None  # when kept: what the checkpoint's meta says


async def expire(
    engine: AsyncEngine,
    checkpoint_id: str,
    location: str,
    store: CheckpointStore,
    *,
    files_removed: bool,
    force: bool = False,
) -> ExpiryResult:
    # Off the event loop: the gateway runs this too, and a removal can take a while.
    disk, meta_expires_at = await asyncio.to_thread(
        remove_if_expired, checkpoint_id, location, time.time(), store, force=force
    )
    if disk is Removal.KEPT and not force:
        return ExpiryResult(ExpiryOutcome.KEPT, files_removed, meta_expires_at)
    if disk is Removal.KEPT:  # forced, but the location is not this checkpoint's: leave it
        log.warning(
            "checkpoint %s: %s does not hold it (no matching %s); files left in place",
            checkpoint_id,
            location,
            META_FILE,
        )
    removed = files_removed or disk is Removal.REMOVED
    async with engine.begin() as conn:
        # A user's delete marks the row whatever its expires_at says.
        mark = await mark_checkpoint_deleted(
            conn, checkpoint_id, only_if_due=not (removed or force)
        )
    return ExpiryResult(OUTCOMES[mark], removed, None)


async def set_checkpoint_ttl(
    sessions: async_sessionmaker[AsyncSession],
    store: CheckpointStore,
    tenant_id: str,
    checkpoint_id: str,
    location: str,
    expires_at: float | None,
) -> bool:
    """Set (unix seconds) or remove (None) a checkpoint's expiry: the meta file first, since it
    is what expiry obeys; then the row (listings). The caller then schedules the expiry job
    (queue/control/expiry_jobs.py schedule_expiry); a removed TTL leaves any job in place: it
    finds no expiry in the meta and does nothing. False if the checkpoint is gone meanwhile."""
    written = await asyncio.to_thread(set_meta_expiry, checkpoint_id, location, expires_at, store)
    when = datetime.fromtimestamp(expires_at, tz=UTC) if expires_at is not None else None
    return written and await set_checkpoint_expiry(sessions, tenant_id, checkpoint_id, when)


async def delete_checkpoint(
    engine: AsyncEngine, checkpoint_id: str, location: str, store: CheckpointStore
) -> bool:
    """A user's delete (the REST DELETE): the same path as TTL expiry (storage checks, one
    rename aside, then deleted_at), only without waiting for the TTL. True if files were
    removed now. A scheduled expiry job for it later finds nothing to do."""
    result = await expire(engine, checkpoint_id, location, store, files_removed=False, force=True)
    return result.files_removed
