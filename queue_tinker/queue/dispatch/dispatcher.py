"""The worker side of the queue: offers, leases with fencing, reading ops, publishing results.

Every write a worker makes for a model goes through a script that first checks the lease
token, so a worker that lost its lease (stalled, partitioned) cannot change anything.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import msgpack
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from queue_tinker.errors import LeaseLostError
from queue_tinker.queue import redis_bytes
from queue_tinker.queue.keys import Keys
from queue_tinker.queue.observe.records import flatten_record
from queue_tinker.queue.replication import replicated, replication_of
from queue_tinker.queue.scripts import ScriptCall, Scripts, run_pipelined
from queue_tinker.types import JobStatus, OpKind, Record
from queue_tinker.types.service.ops import Op as Op  # re-exported: the worker takes Op from here

T = TypeVar("T")

CONTROL_STREAM_LEN = 100


@dataclass(frozen=True)
class Lease:
    model_id: str
    token: str  # "<worker id>|<epoch>": the fencing token
    done_seq: int  # ops up to here were published before the claim
    tenant_id: str = ""


@dataclass(frozen=True)
class Start:
    """What start() decided for an op."""

    run: bool  # mark it running and run it now
    retry_ms: int = 0  # > 0: its tenant is over a limit; it stays queued, try again after this
    # run False and retry_ms 0: it already finished (an earlier owner, or it was cancelled)
    # Set: a stop was asked while an earlier owner ran it, and that owner died before it could
    # stop it; the op is marked running, but fails with this reason instead of running again.
    stop_reason: str = ""
    # Set (run False): the op was started QT_MAX_OP_ATTEMPTS times and never finished; it is
    # marked running, and the worker publishes it failed with this error instead of running it.
    spent: str = ""

    @property
    def limited(self) -> bool:
        return self.retry_ms > 0


def _start(reply: object) -> Start:
    """start.lua's reply: {1} run, {0} already finished, {2, retry_ms} over a limit,
    {3, reason} stopped before this owner ran it, {4, attempts} started too often."""
    assert isinstance(reply, list), reply
    code = int(reply[0])
    if code == 2:
        return Start(run=False, retry_ms=max(1, int(reply[1])))
    if code == 4:
        return Start(run=False, spent=spent_error(int(reply[1])))
    if code == 3:
        reason = reply[1]
        return Start(
            run=True, stop_reason=reason.decode() if isinstance(reason, bytes) else str(reason)
        )
    return Start(run=code == 1)


def spent_error(attempts: int) -> str:
    """Why an op started `attempts` times without finishing fails unrun."""
    times = "once" if attempts == 1 else f"{attempts} times"
    return (
        f"this op was started {times} and never finished: each worker that ran it "
        "died (killed, out of memory, crashed) or lost its lease first; it fails unrun so it "
        "cannot end every worker in turn (the limit is QT_MAX_OP_ATTEMPTS); the model's "
        "later ops run as usual"
    )


@dataclass(frozen=True)
class Outcome:
    """What a worker publishes for one op."""

    status: JobStatus
    result: bytes = b""
    error: str = ""
    error_category: str = ""
    error_detail: str = ""
    metrics: dict[str, float] | None = None
    tokens: int = 0  # charged to the tenant's tokens-per-second limit, counted in /metrics


@dataclass
class Control:
    """What came on a worker's control stream: plain commands ("wake", "drain") and the
    running ops to stop (job id -> the error they fail with; queue/control/actions.py)."""

    commands: set[str] = field(default_factory=set)
    stops: dict[str, str] = field(default_factory=dict)

    def add(self, fields: dict[bytes, bytes]) -> None:
        command = fields.get(b"command", b"").decode()
        if command == "cancel" and b"job" in fields:
            self.stops[fields[b"job"].decode()] = fields.get(b"reason", b"cancelled").decode()
        elif command:
            self.commands.add(command)


def _op(model_id: str, entry_id: bytes, fields: dict[bytes, bytes]) -> Op:
    return Op(
        job_id=fields[b"job"].decode(),
        model_id=model_id,
        seq=int(entry_id.split(b"-")[0]),
        kind=OpKind(fields[b"kind"].decode()),
        payload=fields[b"payload"],
    )


def _is_lease_lost(reply: object) -> bool:
    return isinstance(reply, ResponseError) and "LEASE_LOST" in str(reply)


def _raise_other(reply: T) -> T:
    """A pipeline reply, raised if it is an error other than a lost lease."""
    if isinstance(reply, Exception) and not _is_lease_lost(reply):
        raise reply
    return reply


def _lease_lost(exc: ResponseError, model_id: str) -> Exception:
    if "LEASE_LOST" in str(exc):
        return LeaseLostError(f"lease on model {model_id} was taken over")
    return exc


class Dispatcher:
    """One worker's view of the queues of one base model."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        *,
        worker_id: str,
        base_model: str,
        lease_ttl_ms: int,
        result_ttl_s: int,
        max_attempts: int = 3,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.worker_id = worker_id
        self.base_model = base_model
        self.lease_ttl_ms = lease_ttl_ms
        self.result_ttl_s = result_ttl_s
        self.max_attempts = max_attempts  # QT_MAX_OP_ATTEMPTS
        self.scripts = Scripts.load(redis)

    # --- offers and leases -----------------------------------------------------------------
    async def offer_bell_cursor(self) -> bytes:
        """Where to start listening for offers (the newest bell entry now)."""
        newest = await redis_bytes.xrevrange(
            self.redis, self.keys.offer_bell(self.base_model), count=1
        )
        return newest[0][0] if newest else b"0-0"

    async def wait_for_offer(self, cursor: bytes, block_ms: int) -> bytes:
        """Block until a model of this base is offered after `cursor` (or the time passes);
        the new cursor. Every waiting worker wakes: each then asks take_offer()."""
        reply = await redis_bytes.xread(
            self.redis, {self.keys.offer_bell(self.base_model): cursor}, count=100, block=block_ms
        )
        return reply[0][1][-1][0] if reply else cursor

    async def take_offer(self, *, min_age_ms: int = 0, unserved_min_age_ms: int = 0) -> str | None:
        """Remove and return the fairest offer (lua/take_offer.lua), if one is due."""
        model = await self.scripts.take_offer(
            keys=[self.keys.offers(self.base_model)],
            args=[self.keys.prefix, min_age_ms, unserved_min_age_ms],
        )
        return model.decode() if model else None

    async def claim(self, model_id: str) -> Lease | None:
        keys = self.keys
        reply = await self.scripts.claim(
            keys=[
                keys.model_lease(model_id),
                keys.model_epoch(model_id),
                keys.model_meta(model_id),
                keys.offers(self.base_model),
            ],
            args=[self.worker_id, self.lease_ttl_ms, model_id, keys.prefix],
        )
        if reply is None or not reply[0]:  # held by another worker, or its tenant is at its limit
            return None
        return Lease(
            model_id=model_id,
            token=reply[0].decode(),
            done_seq=int(reply[1]),
            tenant_id=reply[2].decode(),
        )

    async def renew(self, leases: list[Lease]) -> list[bool]:
        """Renew all leases in one round trip; False where the lease is no longer ours."""
        if not leases:
            return []
        reply = await self.scripts.renew(
            keys=[self.keys.model_lease(lease.model_id) for lease in leases],
            args=[self.lease_ttl_ms, *[lease.token for lease in leases]],
        )
        return [bool(ok) for ok in reply]

    async def release(self, lease: Lease, *, force: bool = False) -> int:
        """1 released, 0 kept because ops are pending (unless force), -1 not ours anymore."""
        keys = self.keys
        return int(
            await self.scripts.release(
                keys=[
                    keys.model_lease(lease.model_id),
                    keys.model_meta(lease.model_id),
                    keys.offers(self.base_model),
                    keys.pending(self.base_model),
                ],
                args=[lease.token, lease.model_id, "1" if force else "0", keys.prefix],
            )
        )

    async def offer_orphans(self) -> int:
        """Offer every model that has pending ops but no owner (its worker died)."""
        members = await redis_bytes.smembers(self.redis, self.keys.pending(self.base_model))
        pending = [m.decode() for m in members]
        if not pending:
            return 0
        async with self.redis.pipeline(transaction=False) as pipe:
            for model_id in pending:
                pipe.exists(self.keys.model_lease(model_id))
            owned = await pipe.execute()
        orphans = {
            m: time.time() * 1000
            for m, has_owner in zip(pending, owned, strict=True)
            if not has_owner
        }
        # Ring the bell only for models not on offer already (as offer() in common.lua does):
        # every reaper runs this every few seconds, and each ring wakes every idle worker.
        if orphans and await self.redis.zadd(self.keys.offers(self.base_model), orphans, nx=True):
            await self.redis.xadd(
                self.keys.offer_bell(self.base_model),
                {"m": "orphans"},
                maxlen=100,
                approximate=True,
            )
        return len(orphans)

    async def parked_tenants(self, tenants: set[str]) -> set[str]:
        """Those of `tenants` with training runs waiting for a slot of their limit."""
        ordered = sorted(tenants)
        async with self.redis.pipeline(transaction=False) as pipe:
            for tenant in ordered:
                pipe.scard(self.keys.tenant_parked(tenant))
            counts = await pipe.execute()
        return {t for t, n in zip(ordered, counts, strict=True) if n}

    # --- reading ops ------------------------------------------------------------------------
    async def read(
        self, cursors: dict[str, int], control_cursor: bytes, block_ms: int
    ) -> tuple[list[Op], bytes, Control]:
        """New ops of the owned models after their cursors (seq), the control cursor, and what
        came on the control stream (commands such as "drain", ops to stop).

        Blocks on all the streams at once; a wake-up on the control stream returns early.
        """
        streams: dict[str, bytes | str] = {self.keys.worker_control(self.worker_id): control_cursor}
        model_of_stream: dict[bytes, str] = {}
        for model_id, seq in cursors.items():
            stream_key = self.keys.model_ops(model_id)
            streams[stream_key] = f"{seq}-0"
            model_of_stream[stream_key.encode()] = model_id
        reply = await redis_bytes.xread(self.redis, streams, count=512, block=block_ms)
        ops: list[Op] = []
        control_key = self.keys.worker_control(self.worker_id).encode()
        control = Control()
        for stream, entries in reply:
            if stream == control_key:
                control_cursor = entries[-1][0]
                for _, fields in entries:
                    control.add(fields)
                continue
            model_id = model_of_stream[stream]
            ops.extend(_op(model_id, entry_id, fields) for entry_id, fields in entries)
        return ops, control_cursor, control

    async def read_range(self, model_id: str, after_seq: int, upto_seq: int) -> list[Op]:
        """The logged ops with after_seq < seq <= upto_seq: what a new owner replays on top of
        the model's snapshot (the log is only trimmed up to a snapshot, so they are there)."""
        entries = await redis_bytes.xrange(
            self.redis, self.keys.model_ops(model_id), min=f"({after_seq}-0", max=f"{upto_seq}-0"
        )
        return [_op(model_id, entry_id, fields) for entry_id, fields in entries]

    async def wake(self) -> None:
        """Interrupt this worker's blocking read (its owned-model set changed)."""
        await command_worker(self.redis, self.keys, self.worker_id, "wake")

    # --- fenced job updates ----------------------------------------------------------------
    async def start(self, lease: Lease, op: Op) -> Start:
        """Mark the op running, unless it already finished or its tenant is over a limit."""
        try:
            keys, args = self._start_call(lease, op)
            reply = await self.scripts.start(keys=keys, args=args)
        except ResponseError as exc:
            raise _lease_lost(exc, lease.model_id) from exc
        return _start(reply)

    async def publish(
        self,
        lease: Lease,
        op: Op,
        outcome: Outcome,
        *,
        trim_upto: int | None,
        records: Sequence[Record] = (),
    ) -> None:
        """Publish the op's outcome and advance the model; raises LeaseLostError if fenced.
        `records` (what the op made: a checkpoint's row) go onto the records stream in the
        same script, so a worker that lost its lease cannot record them either."""
        keys, args = self._publish_call(lease, op, outcome, trim_upto, started=True)
        args.append(_packed(records))
        (reply,) = await self._publish([(keys, args)])
        if isinstance(reply, ResponseError):
            raise _lease_lost(reply, lease.model_id) if _is_lease_lost(reply) else reply
        if isinstance(reply, Exception):
            raise reply

    async def start_batch(self, batch: list[tuple[Lease, Op]]) -> list[Start | None]:
        """start() for several ops in one round trip (None where the lease on its model was
        lost). Once a tenant is refused, its later ops in the batch are refused too: the
        scripts run in order and nothing frees in between."""
        calls: list[ScriptCall] = [self._start_call(lease, op) for lease, op in batch]
        replies = await run_pipelined(self.redis, self.scripts.start, calls)
        return [None if _is_lease_lost(reply) else _start(_raise_other(reply)) for reply in replies]

    async def publish_batch(
        self, batch: list[tuple[Lease, Op, Outcome, int | None]], *, started: bool
    ) -> list[bool]:
        """Publish several ops in one round trip (a pipeline keeps their order). Ops that ran
        without start() (inline ops: started=False) are marked started and finished here.

        Returns, per op, False where the lease was lost (the caller drops that model).
        """
        calls: list[ScriptCall] = [
            self._publish_call(lease, op, outcome, trim_upto, started=started)
            for lease, op, outcome, trim_upto in batch
        ]
        replies = await self._publish(calls)
        return [not _is_lease_lost(_raise_other(reply)) for reply in replies]

    async def _publish(self, calls: list[ScriptCall]) -> list[object]:
        """The publish scripts in one round trip, each reply in its place. Where replicas must
        hold a result (queue/replication.py), the scripts keep the wake-ups back, WAIT follows
        them, and the wake-ups go out once the replicas hold the results: a future never
        resolves on a result a failover could take back."""
        policy = replication_of(self.redis)
        if not policy.replicas:
            return await run_pipelined(self.redis, self.scripts.publish, calls)
        # ARGV[15] (records, '' for none) then ARGV[16]: keep the wake-up back.
        deferred: list[ScriptCall] = [
            (keys, [*args, *([b""] if len(args) < 15 else []), "1"]) for keys, args in calls
        ]
        wait = (policy.replicas, policy.timeout_ms)
        *replies, acked = await run_pipelined(self.redis, self.scripts.publish, deferred, wait)
        await replicated(self.redis, self.keys, acked)
        wake_ups = [
            (keys[6], reply)
            for (keys, _), reply in zip(calls, replies, strict=True)
            if isinstance(reply, bytes)
        ]
        if wake_ups:
            async with self.redis.pipeline(transaction=False) as pipe:
                for channel, message in wake_ups:
                    pipe.publish(channel, message)
                await pipe.execute()
        return [1 if isinstance(reply, bytes) else reply for reply in replies]

    def _start_call(self, lease: Lease, op: Op) -> tuple[list[str], list[str | int]]:
        keys = self.keys
        return (
            [
                keys.model_lease(lease.model_id),
                keys.job(op.job_id),
                keys.records(),
                keys.model_meta(op.model_id),
                keys.pending(self.base_model),
            ],
            [lease.token, self.worker_id, keys.prefix, op.seq, op.model_id, self.max_attempts],
        )

    def _publish_call(
        self, lease: Lease, op: Op, outcome: Outcome, trim_upto: int | None, started: bool
    ) -> tuple[list[str], list[str | int | bytes]]:
        if trim_upto is not None:
            # Never past the op being published: a later op of the same batch that is not
            # published yet must stay in the log for whoever owns the model next.
            trim_upto = min(trim_upto, op.seq)
        keys = self.keys
        return (
            [
                keys.model_lease(lease.model_id),
                keys.job(op.job_id),
                keys.model_meta(op.model_id),
                keys.model_ops(op.model_id),
                keys.pending(self.base_model),
                keys.records(),
                keys.model_events(op.model_id),
            ],
            [
                lease.token,
                outcome.status.value,
                outcome.result,
                outcome.error,
                outcome.error_category,
                json.dumps(outcome.metrics) if outcome.metrics else "",
                op.seq,
                self.result_ttl_s,
                op.model_id,
                "" if trim_upto is None else trim_upto,
                outcome.error_detail,
                "" if started else self.worker_id,
                outcome.tokens,
                keys.prefix,
            ],
        )


def _packed(records: Sequence[Record]) -> bytes:
    """Records as publish.lua's last argument: a msgpack list of flat [field, value, ...]
    lists, one per stream entry; empty for none."""
    if not records:
        return b""
    entries = [[str(part) for pair in flatten_record(r).items() for part in pair] for r in records]
    return bytes(msgpack.packb(entries))


async def command_worker(redis: Redis, keys: Keys, worker_id: str, command: str) -> None:
    """Send a command to a worker's op reader ("wake": look at the owned models again;
    "drain": finish the op in progress, hand every model back and exit)."""
    await redis.xadd(
        keys.worker_control(worker_id),
        {"command": command},
        maxlen=CONTROL_STREAM_LEN,
        approximate=True,
    )
