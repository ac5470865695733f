"""RestClient: the Tinker SDK's RestClient over the durable record (Postgres) and the queue
(Redis), for the tenant the client acts for (QT_TENANT). Every call returns an APIFuture of
the SDK-shaped answer (queue_tinker.types.service.rest), with attribute access; what the tenant does
not have raises NotFoundError. Reads first write the record events still on their way to
Postgres (recorder.catch_up), so a checkpoint just saved is found at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Literal, TypeVar

from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from queue_tinker.client.future import APIFuture
from queue_tinker.client.holder import ClientHolder
from queue_tinker.client.loop import BackgroundLoop
from queue_tinker.errors import NotFoundError, UserInputError
from queue_tinker.queue.control.expiry_jobs import DELETE_JOB, TTL_JOB, run_now
from queue_tinker.queue.observe.records import RECORD_WAIT_S, RecordLog
from queue_tinker.settings import Settings
from queue_tinker.store import queries, rest_views
from queue_tinker.store.db import make_engine, session_factory
from queue_tinker.types.requests.training import MAX_TTL_SECONDS
from queue_tinker.types.service.checkpoints import CheckpointPath
from queue_tinker.types.service.rest import (
    CheckpointsListResponse,
    GetSamplerResponse,
    GetServerCapabilitiesResponse,
    GetSessionResponse,
    ListSessionsResponse,
    SupportedModel,
    TrainingRun,
    TrainingRunsResponse,
    WeightsInfoResponse,
)

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
# How long a delete or a TTL change waits for the housekeeper to run it.
HOUSEKEEPER_WAIT_S = 30.0
AccessScope = Literal["owned", "accessible"]  # every run a tenant can see is its own


class RestClient:
    """Training runs, checkpoints, sessions and samplers of this client's tenant."""

    def __init__(self, loop: BackgroundLoop, holder: ClientHolder, settings: Settings) -> None:
        if not settings.database_url:
            raise UserInputError(
                "QT_DATABASE_URL: the RestClient reads the Postgres record; "
                "set it (queue-tinker up prints it)"
            )
        self._loop = loop
        self._holder = holder
        self._settings = settings
        self._engine: AsyncEngine | None = None
        self._sessions: async_sessionmaker[AsyncSession] | None = None

    # --- plumbing --------------------------------------------------------------------------
    async def _db(self) -> async_sessionmaker[AsyncSession]:
        """The engine is made on the background loop: asyncpg binds to the loop it runs on."""
        if self._sessions is None:
            self._engine = make_engine(self._settings.database_url or "")
            self._sessions = session_factory(self._engine)
        records = RecordLog(self._holder.redis, self._holder.keys)
        if not await records.wait_recorded(RECORD_WAIT_S):
            log.warning(
                "the record is behind: events older than this read are not yet in Postgres "
                "after %.0f s (no worker or gateway is running a recorder, or Postgres is away)",
                RECORD_WAIT_S,
            )
        return self._sessions

    def _future(self, make: Callable[[], Coroutine[Any, Any, M]]) -> APIFuture[M]:
        return APIFuture(self._loop.submit(make()), request_id="rest")

    async def _read(
        self,
        model: type[M],
        what: str,
        read: Callable[[async_sessionmaker[AsyncSession]], Awaitable[dict[str, Any] | None]],
    ) -> M:
        found = await read(await self._db())
        if found is None:
            raise NotFoundError(f"{what}: not found")
        return model.model_validate(found)

    @property
    def _tenant(self) -> str:
        return self._holder.tenant_id

    # --- training runs ---------------------------------------------------------------------
    def get_training_run(
        self, training_run_id: str, access_scope: AccessScope = "owned"
    ) -> APIFuture[TrainingRun]:
        return self._future(
            lambda: self._read(
                TrainingRun,
                f"training run {training_run_id!r}",
                lambda db: rest_views.training_run(db, self._tenant, training_run_id),
            )
        )

    def get_training_run_by_tinker_path(
        self, tinker_path: str, access_scope: AccessScope = "owned"
    ) -> APIFuture[TrainingRun]:
        return self.get_training_run(CheckpointPath.parse(tinker_path, "tinker_path").run_id)

    def list_training_runs(
        self,
        limit: int = 20,
        offset: int = 0,
        access_scope: AccessScope = "owned",
        project_id: str | None = None,
    ) -> APIFuture[TrainingRunsResponse]:
        return self._future(
            lambda: self._read(
                TrainingRunsResponse,
                "training runs",
                lambda db: rest_views.training_runs(db, self._tenant, limit, offset),
            )
        )

    # --- checkpoints -----------------------------------------------------------------------
    def list_checkpoints(self, training_run_id: str) -> APIFuture[CheckpointsListResponse]:
        return self._future(
            lambda: self._read(
                CheckpointsListResponse,
                f"training run {training_run_id!r}",
                lambda db: rest_views.run_checkpoints(db, self._tenant, training_run_id),
            )
        )

    def list_user_checkpoints(
        self, limit: int = 100, offset: int = 0
    ) -> APIFuture[CheckpointsListResponse]:
        return self._future(
            lambda: self._read(
                CheckpointsListResponse,
                "checkpoints",
                lambda db: rest_views.user_checkpoints(db, self._tenant, limit, offset),
            )
        )

    def get_weights_info_by_tinker_path(self, tinker_path: str) -> APIFuture[WeightsInfoResponse]:
        path = CheckpointPath.parse(tinker_path, "tinker_path")
        return self._future(
            lambda: self._read(
                WeightsInfoResponse,
                f"checkpoint {tinker_path!r}",
                lambda db: rest_views.weights_info(db, self._tenant, str(path), path.run_id),
            )
        )

    def delete_checkpoint(self, training_run_id: str, checkpoint_id: str) -> APIFuture[None]:
        return self.delete_checkpoint_from_tinker_path(
            f"tinker://{training_run_id}/{checkpoint_id}"
        )

    def delete_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        """Remove the files and mark the checkpoint deleted: the deployment's housekeeper does
        it at once (`queue-tinker housekeeper`, which `up` and compose run), as the gateway's
        DELETE does; the call waits for it."""
        CheckpointPath.parse(tinker_path, "tinker_path")

        async def delete() -> None:
            row = await self._checkpoint(tinker_path)
            await self._housekeeping(DELETE_JOB, checkpoint_id=row.id, directory=row.path)

        return APIFuture(self._loop.submit(delete()), request_id="rest")

    def set_checkpoint_ttl_from_tinker_path(
        self, tinker_path: str, ttl_seconds: int | None
    ) -> APIFuture[None]:
        """Expire the checkpoint `ttl_seconds` from now, or never (None): the housekeeper
        writes the checkpoint's meta and row and schedules its expiry; the call waits."""
        CheckpointPath.parse(tinker_path, "tinker_path")
        if ttl_seconds is not None and (
            isinstance(ttl_seconds, bool)
            or not isinstance(ttl_seconds, int)
            or not 0 < ttl_seconds <= MAX_TTL_SECONDS
        ):
            raise UserInputError(
                f"ttl_seconds: must be a whole number of seconds from 1 to "
                f"{MAX_TTL_SECONDS}, or None; got {ttl_seconds!r}"
            )

        async def change() -> None:
            row = await self._checkpoint(tinker_path)
            expires_at = time.time() + ttl_seconds if ttl_seconds is not None else None
            changed = await self._housekeeping(
                TTL_JOB,
                tenant_id=self._tenant,
                checkpoint_id=row.id,
                directory=row.path,
                expires_at=expires_at,
            )
            if not changed:
                raise NotFoundError(f"checkpoint {tinker_path!r}: not found")

        return APIFuture(self._loop.submit(change()), request_id="rest")

    async def _housekeeping(self, job: str, **kwargs: Any) -> Any:
        settings = self._settings
        return await run_now(
            settings.redis_url or "", settings.key_prefix, job, kwargs, HOUSEKEEPER_WAIT_S
        )

    async def _checkpoint(self, tinker_path: str) -> Any:
        row = await queries.get_live_checkpoint(await self._db(), self._tenant, tinker_path)
        if row is None:
            raise NotFoundError(f"checkpoint {tinker_path!r}: not found")
        return row

    # --- sessions, samplers, the service -----------------------------------------------------
    def get_session(
        self, session_id: str, access_scope: AccessScope = "owned"
    ) -> APIFuture[GetSessionResponse]:
        async def read(db: async_sessionmaker[AsyncSession]) -> dict[str, Any] | None:
            members = await queries.session_members(db, self._tenant, session_id)
            return (
                None
                if members is None
                else {"training_run_ids": members[0], "sampler_ids": members[1]}
            )

        return self._future(lambda: self._read(GetSessionResponse, f"session {session_id!r}", read))

    def list_sessions(
        self, limit: int = 20, offset: int = 0, access_scope: AccessScope = "owned"
    ) -> APIFuture[ListSessionsResponse]:
        async def read(db: async_sessionmaker[AsyncSession]) -> dict[str, Any]:
            ids = await queries.list_session_ids(db, self._tenant, limit=limit, offset=offset)
            return {"sessions": ids}

        return self._future(lambda: self._read(ListSessionsResponse, "sessions", read))

    def get_sampler(self, sampler_id: str) -> APIFuture[GetSamplerResponse]:
        async def read(db: async_sessionmaker[AsyncSession]) -> dict[str, Any] | None:
            info = await self._holder.jobs.tenant_model(sampler_id, self._tenant, kind="sampling")
            if info is not None:  # Redis first: the row is written behind
                return {
                    "sampler_id": sampler_id,
                    "base_model": info["base_model"],
                    "model_path": info["model_path"],
                }
            row = await queries.get_sampling_session(db, self._tenant, sampler_id)
            return (
                None
                if row is None
                else {
                    "sampler_id": row.id,
                    "base_model": row.base_model,
                    "model_path": row.model_path,
                }
            )

        return self._future(lambda: self._read(GetSamplerResponse, f"sampler {sampler_id!r}", read))

    def get_server_capabilities(self) -> APIFuture[GetServerCapabilitiesResponse]:
        return APIFuture(
            self._loop.submit(server_capabilities(self._holder, self._settings)), request_id="rest"
        )

    def close(self) -> None:
        """Close its database connections; a later call opens new ones."""
        engine, self._engine, self._sessions = self._engine, None, None
        if engine is not None:
            self._loop.run(engine.dispose())


async def server_capabilities(
    holder: ClientHolder, settings: Settings
) -> GetServerCapabilitiesResponse:
    """Base models served by live workers right now, each with its longest
    `Base:peft:<tokens>` name."""
    models = await holder.registry.model_names(settings.lease_ttl_ms * 3)
    return GetServerCapabilitiesResponse(
        supported_models=[
            SupportedModel(model_name=name, max_context_length=context)
            for name, context in models.items()
        ]
    )
