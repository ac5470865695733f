"""The Redis key layout is an interface (workers of several versions share a Redis): pin it."""

from queue_tinker.queue.keys import Keys


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
    assert k.job_reply("j1") == "qt:job:j1:reply"
    assert k.session("s1") == "qt:session:s1"
    assert k.offers("tiny") == "qt:base:tiny:offers"
    assert k.pending("tiny") == "qt:base:tiny:pending"
    assert k.workers() == "qt:workers"
    assert k.worker("w1") == "qt:worker:w1"
    assert k.worker_control("w1") == "qt:worker:w1:control"
    assert k.records() == "qt:records"
    assert k.dead_records() == "qt:records:dead"
    assert k.housekeeping_queue() == "qt-housekeeping"
