"""The models a worker holds leases on: taking one (with the logged ops to replay on top of its
saved state), dropping one, handing idle ones back and, at the end, all of them."""

from __future__ import annotations

import asyncio
import logging
import time

from queue_tinker.queue.dispatch.dispatcher import Dispatcher, Lease
from queue_tinker.queue.outage import Reconnector, describe
from queue_tinker.workers.interface import Durability
from queue_tinker.workers.runtime.compute import ComputeThread
from queue_tinker.workers.runtime.owned import OwnedModel
from queue_tinker.workers.runtime.scheduling import Scheduler

log = logging.getLogger(__name__)

# An idle training run is handed back this soon (not after the whole linger time) when another
# run of its tenant waits for a slot of the tenant's training-runs limit.
PARKED_RELEASE_AFTER_S = 2.0
# A model whose saved state cannot be read when claimed is handed back after this long.
UNREADABLE_STATE_RETRY_S = 1.0


class Ownership:
    def __init__(
        self,
        worker_id: str,
        linger_ms: int,
        lease_ttl_ms: int,
        dispatch: Dispatcher,
        reconnect: Reconnector,
        schedule: Scheduler,
        compute: ComputeThread,
        durability: Durability,
    ) -> None:
        self.worker_id = worker_id
        self.linger_s = linger_ms / 1000
        self.lease_ttl_ms = lease_ttl_ms
        self.dispatch = dispatch
        self.reconnect = reconnect
        self.schedule = schedule
        self.owned: dict[str, OwnedModel] = schedule.owned  # one dict, shared
        self.compute = compute
        self.durability = durability

    async def adopt(self, lease: Lease) -> None:
        """A newly claimed model, with the logged ops between its saved state and the last
        published one queued for replay (an earlier owner died after its last snapshot)."""
        owned = OwnedModel(lease=lease, read_seq=lease.done_seq)
        try:
            restored = await self.compute.run(self.durability.restore_point, lease.model_id)
        except Exception as exc:
            # Its saved state cannot be read now (checkpoint storage away): running its ops on
            # a state not restored would be wrong, so the model goes back to be offered again,
            # after a pause that keeps claim and release from spinning while the store is away.
            log.warning(
                "%s: cannot read the saved state of %s (%s); handing it back",
                self.worker_id,
                lease.model_id,
                exc,
            )
            await asyncio.sleep(UNREADABLE_STATE_RETRY_S)
            await self.reconnect.call(self.dispatch.release, lease, force=True)
            return
        if restored is not None and restored < lease.done_seq:
            replay = await self.reconnect.call(
                self.dispatch.read_range, lease.model_id, restored, lease.done_seq
            )
            log.info(
                "%s: %s resumes from seq %d; replaying %d ops",
                self.worker_id,
                lease.model_id,
                restored,
                len(replay),
            )
            owned.backlog.extend(replay)
            owned.replay_upto = lease.done_seq
        self.owned[lease.model_id] = owned

    def drop(self, model_id: str) -> None:
        owned = self.owned.pop(model_id, None)
        if owned is not None:
            self.schedule.forget(owned)
        # On the compute thread, queued behind the op in progress: an engine's state is only
        # ever touched from that one thread.
        self.compute.later(self.durability.drop, model_id)

    def drop_lost(self, lost: list[OwnedModel]) -> None:
        """Drop the models whose lease a write found lost (each once; not one claimed anew)."""
        for owned in lost:
            model_id = owned.lease.model_id
            if self.owned.get(model_id) is owned:
                log.warning("%s: lost the lease on %s; dropping it", self.worker_id, model_id)
                self.drop(model_id)

    def drop_lapsed(self, owned: list[OwnedModel], renewed: list[bool]) -> None:
        """After a renewal: drop the models whose lease had lapsed (after an outage longer than
        a lease; another worker may hold them by now)."""
        for o, ok in zip(owned, renewed, strict=True):
            if not ok and self.owned.get(o.lease.model_id) is o:
                log.warning("%s: lease on %s lapsed; dropping it", self.worker_id, o.lease.model_id)
                self.drop(o.lease.model_id)

    async def persist(self, model_id: str) -> None:
        """Write the model's state to storage before letting it go: the next owner starts
        from there. A failure is logged and the lease is released all the same: nothing the
        user was told is lost, because the model's log is trimmed only up to the last
        snapshot written (Durability.durable_seq), so the next owner replays every op after
        it, published ones included (docs/operations.md). Keeping the lease instead would hold
        the model on a worker that cannot write its state."""
        try:
            await self.compute.run(self.durability.persist, model_id)
        except Exception:
            log.exception(
                "%s: persisting %s failed; releasing it anyway: its next owner replays the "
                "ops after its last snapshot",
                self.worker_id,
                model_id,
            )

    def linger_check_s(self) -> float:
        """How often an idle worker looks for models to hand back."""
        return max(0.05, min(1.0, self.linger_s))

    async def release_lingering(self) -> None:
        """Hand back the models idle for the linger time, or for PARKED_RELEASE_AFTER_S when
        another run of their tenant waits for a slot of the tenant's limit."""
        now = time.monotonic()
        idle = self._idle_models(now, min(self.linger_s, PARKED_RELEASE_AFTER_S))
        if not idle:
            return
        waiting = await self._parked_tenants(idle, now)
        for model_id, owned in idle:
            if not _should_release(now - owned.idle_since, self.linger_s, owned.tenant in waiting):
                continue
            if self.owned.get(model_id) is not owned:
                continue  # dropped while we asked
            await self.persist(model_id)
            released = await self.reconnect.call(self.dispatch.release, owned.lease)
            if released != 0:  # 0: ops arrived meanwhile, keep it
                self.drop(model_id)

    async def release_all(self) -> None:
        """Hand every model back (offering those with pending ops), persisted first."""
        for owned in list(self.owned.values()):
            await self.persist(owned.lease.model_id)
            try:
                await self.dispatch.release(owned.lease, force=True)
            except Exception as exc:  # Redis away: the lease lapses by itself within its TTL
                log.warning(
                    "%s: could not release %s (%s); its lease lapses in %d ms",
                    self.worker_id,
                    owned.lease.model_id,
                    describe(exc),
                    self.lease_ttl_ms,
                )
        self.owned.clear()

    def _idle_models(self, now: float, idle_s: float) -> list[tuple[str, OwnedModel]]:
        """The owned models with nothing queued or running for at least `idle_s`."""
        return [
            (m, o)
            for m, o in self.owned.items()
            if not o.backlog and not o.inflight and now - o.idle_since >= idle_s
        ]

    async def _parked_tenants(self, idle: list[tuple[str, OwnedModel]], now: float) -> set[str]:
        """The tenants of `idle` with runs parked for a slot; Redis is asked only while some
        of them are still within the linger time (past it they go whatever the answer)."""
        if not any(now - o.idle_since < self.linger_s for _, o in idle):
            return set()
        return await self.reconnect.call(self.dispatch.parked_tenants, {o.tenant for _, o in idle})


def _should_release(idle_for: float, linger_s: float, parked: bool) -> bool:
    """An idle model goes after the linger time, or sooner when its tenant has a run parked."""
    return idle_for >= linger_s or (parked and idle_for >= PARKED_RELEASE_AFTER_S)
