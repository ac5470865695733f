"""A training run's inflight sampler weights (queue/ops/inflight.py) on real Redis and the real
script: they only move forward, expire with the checkpoints they point at, and a session
that follows them samples from the newest (runs.sample_weights)."""

from __future__ import annotations

from redis.asyncio import Redis

from queue_tinker.queue.keys import Keys
from queue_tinker.queue.ops import runs
from queue_tinker.queue.ops.inflight import InflightWeights
from queue_tinker.queue.ops.jobs import JobQueue
from queue_tinker.queue.scripts import Scripts

BASE = "queue-tinker/tiny-llama"


def path(run: str, seq: int) -> str:
    return f"tinker://{run}/sampler_weights/inflight-s{seq}"


async def test_inflight_weights_only_move_forward(aredis: Redis, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    inflight = InflightWeights(aredis, keys, Scripts.load(aredis), ttl_s=60)
    assert await inflight.path("r1") is None and await inflight.paths(["r1"]) == {}
    assert await inflight.publish("r1", 5, path("r1", 5)) == 5
    # A save sent earlier whose answer comes later leaves the newer weights in place.
    assert await inflight.publish("r1", 3, path("r1", 3)) == 5
    assert await inflight.path("r1") == path("r1", 5)
    assert await inflight.publish("r1", 9, path("r1", 9)) == 9
    await inflight.publish("r2", 1, path("r2", 1))
    assert await inflight.paths(["r1", "r2", "r3"]) == {"r1": path("r1", 9), "r2": path("r2", 1)}
    assert 0 < await aredis.ttl(keys.inflight_weights("r1")) <= 60


async def test_a_following_session_samples_from_the_newest_weights(
    aredis: Redis, key_prefix: str
) -> None:
    """Its own save until a newer one; its own again once the target expired; a session
    that follows nothing always its own."""
    keys = Keys(key_prefix)
    jobs = JobQueue(aredis, keys, result_ttl_s=60)
    inflight = InflightWeights(aredis, keys, jobs.scripts, ttl_s=60)
    await jobs.register_sampling_session(
        "s-follow",
        base_model=BASE,
        tenant_id="t",
        session_id=None,
        model_path=path("run", 2),
        inflight_of="run",
    )
    await jobs.register_sampling_session(
        "s-fixed", base_model=BASE, tenant_id="t", session_id=None, model_path=path("run", 2)
    )
    follow, fixed = await jobs.model_info("s-follow"), await jobs.model_info("s-fixed")
    assert (follow["inflight_of"], fixed["inflight_of"]) == ("run", None)
    assert await runs.sample_weights(inflight, follow) == path("run", 2)
    await inflight.publish("run", 7, path("run", 7))
    assert await runs.sample_weights(inflight, follow) == path("run", 7)
    assert await runs.sample_weights(inflight, fixed) == path("run", 2)
    await aredis.delete(keys.inflight_weights("run"))  # as when its TTL ran out
    assert await runs.sample_weights(inflight, follow) == path("run", 2)
