"""The producer side of the queue: models, enqueue, and reading a job's outcome."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from queue_tinker.errors import (
    HeldOpsFullError,
    ResultExpiredError,
    SeqIdUsedError,
    UnknownModelError,
    UserInputError,
)
from queue_tinker.queue import redis_bytes
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.replication import run_replicated
from queue_tinker.queue.scripts import Scripts
from queue_tinker.settings import Settings
from queue_tinker.types import JobStatus, OpKind
from queue_tinker.types.model_names import served_base

MAX_IDEMPOTENCY_KEY = 128


@dataclass(frozen=True)
class Enqueued:
    job_id: str
    created: bool  # False: the idempotency key matched an earlier submit; nothing was queued


@dataclass(frozen=True)
class Ordered:
    """What became of an op the client numbered itself (enqueue_in_order)."""

    job_id: str
    created: bool  # False: this seq_id was sent before; job_id is the first submit's
    waiting_for: int  # the lowest seq_id the model still waits for (0: not known, a retry)


@dataclass(frozen=True)
class HeldLimits:
    """What a model may hold of ops that arrived before a lower seq_id (QT_HELD_OPS_*)."""

    window: int  # how far past the seq_id the model waits for
    count: int
    bytes: int

    @classmethod
    def of(cls, settings: Settings) -> HeldLimits:
        return cls(
            window=settings.held_ops_window,
            count=settings.held_ops_max,
            bytes=settings.held_ops_max_bytes,
        )


@dataclass(frozen=True)
class JobOutcome:
    """A finished job as the worker published it."""

    job_id: str
    status: JobStatus
    result: bytes
    error: str = ""
    error_category: str = ""
    error_detail: str = ""


def _text(value: bytes | None) -> str:
    return value.decode() if value is not None else ""


def outcome_from_fields(job_id: str, fields: dict[bytes, bytes]) -> JobOutcome | None:
    """The outcome in a job hash, or None while the job is still queued or running."""
    status = JobStatus(_text(fields.get(b"status")))
    if not status.terminal:
        return None
    return JobOutcome(
        job_id=job_id,
        status=status,
        result=fields.get(b"result", b""),
        error=_text(fields.get(b"error")),
        error_category=_text(fields.get(b"error_category")),
        error_detail=_text(fields.get(b"error_detail")),
    )


def check_idempotency_key(key: str | None) -> str:
    if key is None:
        return ""
    if not isinstance(key, str) or not key or len(key) > MAX_IDEMPOTENCY_KEY:
        raise UserInputError(
            f"idempotency_key: must be a non-empty string of at most {MAX_IDEMPOTENCY_KEY} "
            f"characters, got {key!r}"
        )
    return key


class JobQueue:
    """Submit ops to per-model queues and read their outcomes. No worker logic here."""

    def __init__(
        self, redis: Redis, keys: Keys, *, result_ttl_s: int, held: HeldLimits | None = None
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.result_ttl_s = result_ttl_s
        self.held = held or HeldLimits.of(Settings.model_construct())  # the defaults
        self.scripts = Scripts.load(redis)
        self._base_models: dict[str, str] = {}

    async def register_model(
        self,
        model_id: str,
        *,
        base_model: str,
        tenant_id: str,
        session_id: str | None,
        lora_config: dict[str, Any],
        user_metadata: dict[str, str] | None = None,
    ) -> bool:
        """Create a training run's queue; False if it already existed (a retried create)."""
        return await self._register(
            model_id,
            base_model,
            tenant_id,
            session_id,
            kind="training",
            lora_config=lora_config,
            user_metadata=user_metadata,
        )

    async def register_sampling_session(
        self,
        sampler_id: str,
        *,
        base_model: str,
        tenant_id: str,
        session_id: str | None,
        model_path: str | None,
        inflight_of: str | None = None,
    ) -> bool:
        """Create a sampling session's queue (its samples run in the order they were sent).
        inflight_of: the training run whose newest inflight weights it samples from."""
        return await self._register(
            sampler_id,
            base_model,
            tenant_id,
            session_id,
            kind="sampling",
            model_path=model_path,
            inflight_of=inflight_of,
        )

    async def _register(
        self,
        model_id: str,
        base_model: str,
        tenant_id: str,
        session_id: str | None,
        *,
        kind: str,
        lora_config: dict[str, Any] | None = None,
        model_path: str | None = None,
        user_metadata: dict[str, str] | None = None,
        inflight_of: str | None = None,
    ) -> bool:
        created = await run_replicated(
            self.redis,
            self.keys,
            self.scripts.register_model,
            [self.keys.model_meta(model_id), self.keys.records(), self.keys.base_models()],
            [
                model_id,
                served_base(base_model),
                tenant_id,
                session_id or "",
                json.dumps(lora_config or {}),
                kind,
                model_path or "",
                json.dumps(user_metadata) if user_metadata else "",
                inflight_of or "",
                base_model,
            ],
        )
        return bool(created)

    async def enqueue(
        self,
        model_id: str,
        kind: OpKind,
        payload: bytes,
        *,
        job_id: str,
        idempotency_key: str | None = None,
    ) -> Enqueued:
        """Append an op to the model's log (one round trip). Same idempotency key, same job."""
        idem = check_idempotency_key(idempotency_key)
        base_model = await self.base_model(model_id)
        keys = self.keys
        try:
            reply = await run_replicated(
                self.redis,
                self.keys,
                self.scripts.enqueue,
                [
                    keys.model_meta(model_id),
                    keys.model_ops(model_id),
                    keys.idempotency(model_id, idem),
                    keys.job(job_id),
                    keys.model_lease(model_id),
                    keys.offers(base_model),
                    keys.pending(base_model),
                    keys.records(),
                ],
                [job_id, kind.value, payload, self.result_ttl_s, idem, model_id],
            )
        except ResponseError as exc:
            if "UNKNOWN_MODEL" in str(exc):
                raise UnknownModelError(f"model_id: no model {model_id!r}") from exc
            raise
        return Enqueued(job_id=reply[0].decode(), created=bool(reply[1]))

    async def enqueue_in_order(
        self, model_id: str, seq_id: int, kind: OpKind | None, payload: bytes, *, job_id: str
    ) -> Ordered:
        """Append an op in the order of the client's own `seq_id` (1, 2, ... per model), however
        the requests arrive: an early one is held until the ones before it are in. A seq_id is
        used once (a retry gets the first job). `kind=None` consumes the seq_id without an op:
        for a request refused at the door, so the ops after it are not held behind it."""
        base_model = await self.base_model(model_id)
        keys = self.keys
        idem = f"seq:{seq_id}"
        try:
            reply = await run_replicated(
                self.redis,
                self.keys,
                self.scripts.enqueue_in_order,
                [
                    keys.model_meta(model_id),
                    keys.model_ops(model_id),
                    keys.idempotency(model_id, idem),
                    keys.job(job_id),
                    keys.model_lease(model_id),
                    keys.offers(base_model),
                    keys.pending(base_model),
                    keys.records(),
                    keys.model_held(model_id),
                ],
                [
                    "" if kind is None else job_id,
                    kind.value if kind else "",
                    payload,
                    self.result_ttl_s,
                    idem,
                    model_id,
                    seq_id,
                    keys.prefix,
                    self.held.window,
                    self.held.count,
                    self.held.bytes,
                ],
            )
        except ResponseError as exc:
            raise self._order_error(str(exc), model_id, seq_id) from None
        return Ordered(job_id=reply[0].decode(), created=bool(reply[1]), waiting_for=int(reply[2]))

    def _order_error(self, error: str, model_id: str, seq_id: int) -> Exception:
        """enqueue_in_order.lua's refusal as the error the caller sees."""
        if "UNKNOWN_MODEL" in error:
            return UnknownModelError(f"model_id: no model {model_id!r}")
        if "SEQ_USED" in error:
            return SeqIdUsedError(f"seq_id: {seq_id} of model {model_id} was used before")
        if "SEQ_TOO_FAR" in error:
            waiting = error.rsplit(" ", 1)[-1]
            return UserInputError(
                f"seq_id: {seq_id} is more than {self.held.window} past {waiting}, the seq_id "
                f"model {model_id} waits for (QT_HELD_OPS_WINDOW); send the calls before it"
            )
        if "HELD_FULL" in error:
            what = "ops" if error.endswith("count") else "bytes"
            limit = self.held.count if what == "ops" else self.held.bytes
            return HeldOpsFullError(
                f"seq_id: model {model_id} already holds {limit} {what} sent ahead of the "
                "seq_id it waits for (QT_HELD_OPS_MAX"
                + ("" if what == "ops" else "_BYTES")
                + "); retry once the earlier calls are in"
            )
        return ResponseError(error)

    async def skip_seq_gap(self, model_id: str) -> tuple[int, int] | None:
        """Resume the model's order at its lowest held op, giving up on the seq_ids missing
        before it; (first skipped, resumed at), or None when nothing is held."""
        base_model = await self.base_model(model_id)
        keys = self.keys
        reply = await self.scripts.skip_seq_gap(
            keys=[
                keys.model_meta(model_id),
                keys.model_ops(model_id),
                keys.model_lease(model_id),
                keys.offers(base_model),
                keys.pending(base_model),
                keys.records(),
                keys.model_held(model_id),
            ],
            args=[self.result_ttl_s, model_id, keys.prefix],
        )
        return (int(reply[0]), int(reply[1])) if reply else None

    async def base_model(self, model_id: str) -> str:
        """The base model whose queue a model's ops join (cached: it never changes); without
        the :peft:<tokens> cap its name may carry (model_info has the name as written)."""
        cached = self._base_models.get(model_id)
        if cached is not None:
            return cached
        raw = await redis_bytes.hget(self.redis, self.keys.model_meta(model_id), "base_model")
        if raw is None:
            raise UnknownModelError(f"model_id: no model {model_id!r}")
        self._base_models[model_id] = raw.decode()
        return raw.decode()

    async def model_info(self, model_id: str) -> dict[str, Any]:
        """base_model (as the user named it, any :peft:<tokens> cap included), tenant_id, kind
        ('training' / 'sampling'), lora_config, model_path,
        user_metadata (None when the run has none) and inflight_of (a sampling session that
        follows a training run's inflight weights; else None)."""
        (
            base,
            tenant,
            kind,
            lora_config,
            model_path,
            user_metadata,
            inflight_of,
            model_name,
        ) = await redis_bytes.hmget(
            self.redis,
            self.keys.model_meta(model_id),
            "base_model",
            "tenant_id",
            "kind",
            "lora_config",
            "model_path",
            "user_metadata",
            "inflight_of",
            "model_name",
        )
        # register_model.lua sets base_model and tenant_id in one HSET: both or neither.
        if base is None or tenant is None:
            raise UnknownModelError(f"model_id: no model {model_id!r}")
        return {
            "base_model": (model_name or base).decode(),  # a model made before names had caps
            "tenant_id": tenant.decode(),
            "kind": (kind or b"training").decode(),
            "lora_config": json.loads(lora_config or b"{}"),
            "model_path": (model_path or b"").decode() or None,
            "user_metadata": json.loads(user_metadata) if user_metadata else None,
            "inflight_of": (inflight_of or b"").decode() or None,
        }

    async def tenant_model(
        self, model_id: str, tenant_id: str, kind: str = "training"
    ) -> dict[str, Any] | None:
        """model_info, if the model is the tenant's and of this kind ('training' / 'sampling');
        None otherwise, so another tenant's model reads exactly like a missing one."""
        try:
            info = await self.model_info(model_id)
        except UnknownModelError:
            return None
        return info if info["tenant_id"] == tenant_id and info["kind"] == kind else None

    async def outcome(self, job_id: str) -> JobOutcome | None:
        """The job's outcome if finished, None if still pending; raises if Redis forgot it."""
        fields = await redis_bytes.hgetall(self.redis, self.keys.job(job_id))
        if not fields:
            raise ResultExpiredError(
                f"request {job_id}: no such job in Redis (unknown, or its result outlived "
                f"QT_RESULT_TTL_S={self.result_ttl_s})"
            )
        return outcome_from_fields(job_id, fields)

    async def job(self, job_id: str) -> tuple[dict[str, str], JobOutcome | None]:
        """In one read: the job hash as text (status, timings, worker...) without the result
        and payload bytes, and the outcome if the job has finished; ({}, None) for an unknown
        job."""
        fields = await redis_bytes.hgetall(self.redis, self.keys.job(job_id))
        text = {
            k.decode(): v.decode() for k, v in fields.items() if k not in (b"result", b"payload")
        }
        return text, outcome_from_fields(job_id, fields) if fields else None

    async def job_fields(self, job_id: str) -> dict[str, str]:
        """The job hash as text (status, timings, worker...), without the result bytes."""
        return (await self.job(job_id))[0]
