"""The Redis key layout is an interface (workers of several versions share a Redis): pin it."""

import redis

from queue_tinker.queue.keys import Keys
from queue_tinker.queue.scripts import prelude


def test_key_names_are_stable() -> None:
    """Every key name, exactly."""
    k = Keys("qt")
    assert k.model_meta("m1") == "qt:model:m1:meta"
    assert k.model_ops("m1") == "qt:model:m1:ops"
    assert k.model_lease("m1") == "qt:model:m1:lease"
    assert k.model_epoch("m1") == "qt:model:m1:epoch"
    assert k.model_events("m1") == "qt:model:m1:events"
    assert k.idempotency("m1", "abc") == "qt:model:m1:idem:abc"
    assert k.model_held("m1") == "qt:model:m1:held"
    assert k.job("j1") == "qt:job:j1"
    assert k.job_reply("j1") == "qt:reply:j1"
    assert k.session("s1") == "qt:session:s1"
    assert k.offers("tiny") == "qt:base:tiny:offers"
    assert k.pending("tiny") == "qt:base:tiny:pending"
    assert k.workers() == "qt:workers"
    assert k.worker("w1") == "qt:worker:w1"
    assert k.workers_loading() == "qt:workers:loading"
    assert k.worker_control("w1") == "qt:worker:w1:control"
    assert k.records() == "qt:records"
    assert k.dead_records() == "qt:records:dead"
    assert k.records_flush() == "qt:records:flush"
    assert k.records_written() == "qt:records:written"
    assert k.replication_probe() == "qt:replication:probe"
    assert k.housekeeping_queue() == "qt-housekeeping"


def test_new_key_names_are_stable() -> None:
    k = Keys("qt")
    assert k.offer_bell("tiny") == "qt:base:tiny:offers:bell"
    assert k.limits("acme") == "qt:limits:acme"
    assert k.limits("*") == "qt:limits:*"
    assert k.tenant_leased("acme") == "qt:tenant:acme:leased"
    assert k.tenant_parked("acme") == "qt:tenant:acme:parked"
    assert k.tenant_running("acme") == "qt:tenant:acme:running"
    assert k.tenant_bucket("acme") == "qt:tenant:acme:bucket"
    assert k.metrics_ops() == "qt:metrics:ops"
    assert k.metrics_latency("ping") == "qt:metrics:latency:ping"
    assert k.metrics_tokens() == "qt:metrics:tokens"
    assert k.metrics_tenant_tokens() == "qt:metrics:tenant-tokens"
    assert k.history_slot(115_200) == "qt:history:slot:115200"
    assert k.history_fleet() == "qt:history:fleet"
    assert k.history_base("tiny") == "qt:history:base:tiny"


def test_sampling_client_key_names_are_stable() -> None:
    """join_sampling_session's counter and retrieve_futures' per-client keys."""
    k = Keys("qt")
    assert k.sampler_clients("s:sample:0") == "qt:model:s:sample:0:clients"
    assert k.sample_pending("s:sample:0", 2) == "qt:model:s:sample:0:futures:2:pending"
    assert k.sample_completions("s:sample:0", 2) == "qt:model:s:sample:0:futures:2:done"
    assert k.sample_cursor("s:sample:0", 2) == "qt:model:s:sample:0:futures:2:cursor"
    assert k.inflight_weights("r:train:0") == "qt:model:r:train:0:inflight"
    assert (
        k.published_checkpoint("tinker://r:train:0/weights/a")
        == "qt:published:tinker://r:train:0/weights/a"
    )


def test_the_scripts_build_the_same_key_names(redis_url: str) -> None:
    """Scripts that learn a tenant or job only inside build its keys themselves: they must
    match queue/keys.py, or a limit would be kept in one key and read from another."""
    k = Keys("qt")
    built = redis.Redis.from_url(redis_url).eval(
        prelude()
        + """
        return {meta_key('qt', 'm1'), lease_key('qt', 'm1'), job_key('qt', 'j1'),
                events_key('qt', 'm1'), offers_key('qt', 'tiny'), limits_key('qt', 'acme'),
                tenant_key('qt', 'acme', 'leased'), tenant_key('qt', 'acme', 'parked'),
                tenant_key('qt', 'acme', 'running'), tenant_key('qt', 'acme', 'bucket')}""",
        0,
    )
    assert [b.decode() for b in built] == [
        k.model_meta("m1"),
        k.model_lease("m1"),
        k.job("j1"),
        k.model_events("m1"),
        k.offers("tiny"),
        k.limits("acme"),
        k.tenant_leased("acme"),
        k.tenant_parked("acme"),
        k.tenant_running("acme"),
        k.tenant_bucket("acme"),
    ]


def test_index_key_names_are_stable() -> None:
    k = Keys("qt")
    assert k.base_models() == "qt:bases"
    assert k.served_base_models() == "qt:bases:served"
    assert k.download_signing_secret() == "qt:downloads:secret"
    assert k.limited_tenants() == "qt:limits"
