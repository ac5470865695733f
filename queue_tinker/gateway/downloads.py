"""Downloading checkpoints from the gateway (docs/tinker-http-protocol.md, section 7.3): the
signed, expiring, tenant-scoped URLs the Tinker SDK asks for.

- `GET .../checkpoints/external_weights/<name>/external_weights_urls` (RestClient.
  get_external_weights_urls; tinker_cookbook.weights.download): one URL per file of an
  external weights checkpoint (the PEFT files, `.age` when encrypted).
- `GET .../checkpoints/<weights|sampler_weights>/<name>/archive` (get_checkpoint_archive_url):
  a 302 to a URL of a .tar.gz of the checkpoint's files, `Expires` saying until when.
- With S3 storage, external weights URLs are the store's own presigned GETs (the bytes never
  pass through the gateway); an archive is built by the gateway from its cached copy.
- `GET /api/v1/downloads?...`: what the gateway's URLs point at. They carry no API key (urllib and
  curl fetch them as they are), so each names the tenant, the checkpoint, the file and the
  expiry, HMAC-signed with a secret only Redis and the gateways know; the checkpoint must still
  be the tenant's and live when it is fetched.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import tarfile
import tempfile
import time
from datetime import UTC, datetime
from email.utils import format_datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import FileResponse, RedirectResponse, Response
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from starlette.background import BackgroundTask

from queue_tinker.gateway.auth import tenant_of
from queue_tinker.gateway.queue_access import not_found
from queue_tinker.queue.keys import Keys
from queue_tinker.storage.base import CheckpointStore
from queue_tinker.store import queries
from queue_tinker.store.models import CheckpointRow
from queue_tinker.types.enums import CheckpointKind
from queue_tinker.types.service.checkpoints import META_FILE, CheckpointPath

URL_TTL_S = 15 * 60  # as Tinker's own archive URLs
ARCHIVE = ""  # the `file` of an archive URL: the whole checkpoint as .tar.gz


def signature(secret: bytes, tenant: str, checkpoint: str, file: str, expires: int) -> str:
    message = "\n".join((tenant, checkpoint, file, str(expires))).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def checkpoint_files(store: CheckpointStore, location: str) -> list[str]:
    """The files a download serves: everything but our own metadata."""
    return sorted(n for n in store.files(store.key_of(location)) if n != META_FILE)


def _store(request: Request) -> CheckpointStore:
    store: CheckpointStore = request.app.state.gateway_queue.store
    return store


def _db(request: Request) -> async_sessionmaker[AsyncSession]:
    sessions: async_sessionmaker[AsyncSession] = request.app.state.sessions
    return sessions


async def _signed_url(
    request: Request, keys: Keys, tenant: str, checkpoint: str, file: str, expires: int
) -> str:
    secret = await request.app.state.gateway_queue.protocol.signing_secret()
    query = {
        "tenant": tenant,
        "checkpoint": checkpoint,
        "file": file,
        "expires": expires,
        "signature": signature(secret, tenant, checkpoint, file, expires),
    }
    return f"{str(request.base_url).rstrip('/')}/api/v1/downloads?{urlencode(query)}"


async def _checkpoint(
    request: Request,
    tenant: str,
    run_id: str,
    checkpoint_id: str,
    kinds: tuple[CheckpointKind, ...],
) -> CheckpointRow:
    """The tenant's live checkpoint <run>/<checkpoint_id> of one of `kinds`; 404 otherwise."""
    path = f"tinker://{run_id}/{checkpoint_id}"
    parsed = CheckpointPath.parse(path, "checkpoint_id")  # UserInputError: 400
    if parsed.kind not in kinds:
        allowed = " or ".join(f"{k.path_segment}/<name>" for k in kinds)
        raise HTTPException(
            400,
            f"checkpoint_id: {checkpoint_id!r} is not a checkpoint this "
            f"call serves; expected {allowed}",
        )
    row = await queries.get_live_checkpoint(_db(request), tenant, path)
    if row is None:
        raise not_found(f"checkpoint {checkpoint_id!r} of training run {run_id!r}")
    return row


def _archive(store: CheckpointStore, location: str) -> Path:
    """The checkpoint's files as a .tar.gz in a temporary file (removed once sent); from the
    store's local copy where storage is remote."""
    directory = store.fetch(store.key_of(location))
    if directory is None:
        raise FileNotFoundError(location)
    handle, name = tempfile.mkstemp(suffix=".tar.gz")
    os.close(handle)
    with tarfile.open(name, "w:gz") as archive:
        for file in sorted(p.name for p in directory.iterdir() if p.is_file()):
            if file != META_FILE and not file.startswith("."):
                archive.add(directory / file, arcname=file)
    return Path(name)


def _store_urls(store: CheckpointStore, location: str, expires: int) -> dict[str, str] | None:
    """URLs the store itself signs for each file (S3's presigned GETs: the bytes never pass
    through the gateway), or None where it signs none (a local directory)."""
    key = store.key_of(location)
    expires_s = max(1, expires - int(time.time()))
    urls = {}
    for file in checkpoint_files(store, location):
        url = store.download_url(key, file, expires_s)
        if url is None:
            return None
        urls[file] = url
    return urls


async def _one_file(store: CheckpointStore, location: str, checkpoint: str, file: str) -> Response:
    if file not in await asyncio.to_thread(checkpoint_files, store, location):
        raise not_found(f"file {file!r} of checkpoint {checkpoint!r}")
    key = store.key_of(location)
    url = await asyncio.to_thread(store.download_url, key, file, URL_TTL_S)
    if url is not None:  # remote storage: its own signed URL serves the bytes
        return RedirectResponse(url, status_code=302)
    directory = await asyncio.to_thread(store.fetch, key)
    if directory is None:
        raise not_found(f"checkpoint {checkpoint!r}")
    return FileResponse(directory / file, media_type="application/octet-stream")


def download_router(keys: Keys, *dependencies: Any) -> APIRouter:
    """`dependencies`: what every authenticated REST call runs first (the record catch-up)."""
    router = APIRouter(prefix="/api/v1")
    authenticated = [Depends(d) for d in dependencies]

    @router.get(
        "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls",
        dependencies=authenticated,
    )
    async def external_weights_urls(
        run_id: str, checkpoint_id: str, request: Request, tenant: str = Depends(tenant_of)
    ) -> dict[str, Any]:
        row = await _checkpoint(request, tenant, run_id, checkpoint_id, (CheckpointKind.EXTERNAL,))
        expires = int(time.time()) + URL_TTL_S
        store = _store(request)
        urls = await asyncio.to_thread(_store_urls, store, row.path, expires)
        if urls is None:
            files = await asyncio.to_thread(checkpoint_files, store, row.path)
            urls = {
                file: await _signed_url(request, keys, tenant, row.id, file, expires)
                for file in files
            }
        return {"urls": urls, "expires": datetime.fromtimestamp(expires, UTC).isoformat()}

    @router.get(
        "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/archive",
        dependencies=authenticated,
    )
    async def checkpoint_archive(
        run_id: str, checkpoint_id: str, request: Request, tenant: str = Depends(tenant_of)
    ) -> RedirectResponse:
        row = await _checkpoint(
            request, tenant, run_id, checkpoint_id, (CheckpointKind.STATE, CheckpointKind.SAMPLER)
        )
        expires = int(time.time()) + URL_TTL_S
        url = await _signed_url(request, keys, tenant, row.id, ARCHIVE, expires)
        http_date = format_datetime(datetime.fromtimestamp(expires, UTC), usegmt=True)
        return RedirectResponse(url, status_code=302, headers={"Expires": http_date})

    @router.get("/downloads")
    async def download(
        request: Request,
        tenant: str = Query(),
        checkpoint: str = Query(),
        file: str = Query(""),
        expires: int = Query(),
        signature_: str = Query(alias="signature"),
    ) -> Response:
        """A signed URL's file (no API key: the signature is the permission)."""
        secret = await request.app.state.gateway_queue.protocol.signing_secret()
        if not hmac.compare_digest(
            signature(secret, tenant, checkpoint, file, expires), signature_
        ):
            raise HTTPException(403, "signature: does not match this URL")
        if expires < time.time():
            raise HTTPException(403, "expires: this download URL has expired; ask for a new one")
        row = await queries.get_live_checkpoint(_db(request), tenant, checkpoint)
        if row is None:
            raise not_found(f"checkpoint {checkpoint!r}")
        store = _store(request)
        if file == ARCHIVE:
            try:
                archive = await asyncio.to_thread(_archive, store, row.path)
            except FileNotFoundError:
                raise not_found(f"checkpoint {checkpoint!r}") from None
            name = f"{CheckpointPath.parse(checkpoint).name}.tar.gz"
            return FileResponse(
                archive,
                media_type="application/gzip",
                filename=name,
                background=BackgroundTask(archive.unlink, missing_ok=True),
            )
        return await _one_file(store, row.path, checkpoint, file)

    return router
