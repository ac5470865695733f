"""The worker's scheduling rules, alone (workers/runtime/scheduling.py): strict per-model order,
turns fair between tenants, training batches, the stepped ops' quantum, empty queues.

No Redis, no torch: the Scheduler is pure bookkeeping, driven here with the LoRA engine's
real op rules (LoraOpRules)."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

from queue_tinker.queue.dispatch.dispatcher import Lease
from queue_tinker.types import OpKind, codec
from queue_tinker.types.service.ops import Op
from queue_tinker.workers.executor.rules import LoraOpRules
from queue_tinker.workers.runtime.owned import OwnedModel
from queue_tinker.workers.runtime.scheduling import (
    ENGINE_BATCH,
    IDLE_PEER_S,
    INLINE_BATCH,
    QUANTUM_S,
    Scheduler,
    TurnKind,
    quantum_after,
)

NOW = 1_000.0
FB, STEP, SAVE, SAMPLE = (
    OpKind.FORWARD_BACKWARD,
    OpKind.OPTIM_STEP,
    OpKind.SAVE_STATE,
    OpKind.SAMPLE,
)


def op(model_id: str, seq: int, kind: OpKind, payload: bytes = b"") -> Op:
    return Op(job_id=f"{model_id}-{seq}", model_id=model_id, seq=seq, kind=kind, payload=payload)


def ping(model_id: str, seq: int, delay_ms: int = 0) -> Op:
    return op(model_id, seq, OpKind.PING, codec.encode({"delay_ms": delay_ms}))


def scheduler(*, batching: bool = True) -> Scheduler:
    return Scheduler(LoraOpRules(cross_adapter_batch=batching))


def own(schedule: Scheduler, model_id: str, tenant: str, kinds: list[OpKind]) -> OwnedModel:
    owned = OwnedModel(lease=Lease(model_id, "w|1", 0, tenant), read_seq=len(kinds))
    owned.backlog.extend(op(model_id, seq, kind) for seq, kind in enumerate(kinds, start=1))
    schedule.owned[model_id] = owned
    return owned


def run_alone(schedule: Scheduler, turns: int) -> list[str]:
    """The models whose lone ops the next `turns` turns run."""
    ran = []
    for _ in range(turns):
        turn = schedule.next_turn(NOW)
        assert turn is not None and turn.kind is TurnKind.ALONE and turn.op is not None
        ran.append(turn.op.model_id)
    return ran


def test_nothing_owned_or_nothing_queued_is_no_turn() -> None:
    """No model, or models with empty backlogs: no turn; the idle wait is the longest asked."""
    schedule = scheduler()
    assert schedule.next_turn(NOW) is None
    own(schedule, "a", "t", [])
    assert schedule.next_turn(NOW) is None
    assert schedule.take_engine_batch(NOW) == [] and schedule.take_inline_batch(NOW) == []
    assert schedule.idle_wait_s(NOW, longest_s=0.5) == 0.5
    assert not schedule.stepping() and not schedule.any_stepped_head(NOW)


def test_a_models_ops_run_strictly_in_seq_order() -> None:
    """A model's ops come off its backlog head first, one per turn, in seq order."""
    schedule = scheduler(batching=False)
    own(schedule, "a", "t", [FB, STEP, SAVE, FB])
    assert [turn_op.seq for turn_op in _ops(schedule, 4)] == [1, 2, 3, 4]
    assert schedule.next_turn(NOW) is None


def _ops(schedule: Scheduler, turns: int) -> list[Op]:
    ops = []
    for _ in range(turns):
        turn = schedule.next_turn(NOW)
        assert turn is not None and turn.op is not None
        ops.append(turn.op)
    return ops


def test_nothing_of_a_model_runs_past_its_samples_in_flight() -> None:
    """A model with a sample in flight is not runnable: its next op waits for it."""
    schedule = scheduler(batching=False)
    owned = own(schedule, "a", "t", [SAVE])
    owned.inflight[0] = (op("a", 0, SAMPLE), None)
    assert schedule.stepping()
    assert schedule.next_turn(NOW) is None
    owned.inflight.clear()
    assert schedule.next_turn(NOW) is not None


def test_tenants_take_turns_whatever_their_number_of_models() -> None:
    """Tenant `flood` with four busy models, tenant `quiet` with one: turns alternate between
    the tenants, and within `flood` go round its models."""
    schedule = scheduler(batching=False)
    for i in range(4):
        own(schedule, f"flood-{i}", "flood", [SAVE] * 10)
    own(schedule, "quiet-0", "quiet", [SAVE] * 10)
    ran = run_alone(schedule, 8)
    tenants = [m.split("-")[0] for m in ran]
    assert Counter(tenants) == {"flood": 4, "quiet": 4}
    assert all(a != b for a, b in pairwise(tenants))
    assert sorted(m for m in ran if m.startswith("flood")) == [f"flood-{i}" for i in range(4)]


def test_a_tenant_that_comes_back_goes_first() -> None:
    """A tenant whose models were all dropped starts afresh: its next op comes before those of
    a tenant that has been running all along."""
    schedule = scheduler(batching=False)
    own(schedule, "busy", "busy", [SAVE] * 10)
    gone = own(schedule, "gone", "gone", [SAVE])
    run_alone(schedule, 3)
    del schedule.owned["gone"]
    schedule.forget(gone)
    run_alone(schedule, 2)
    own(schedule, "back", "gone", [SAVE])
    assert run_alone(schedule, 1) == ["back"]


def test_a_batch_goes_first_after_a_lone_op() -> None:
    """After an op that ran alone, a model whose head is a training step goes next, whoever's
    turn it is; the batch takes one step (passes + optim_step) of every such model."""
    schedule = scheduler()
    own(schedule, "lone", "a", [SAVE, SAVE])
    own(schedule, "train-1", "b", [FB, FB, STEP, FB, STEP])
    own(schedule, "train-2", "c", [FB, STEP])
    assert schedule.batch_due
    turn = schedule.next_turn(NOW)
    assert turn is not None and turn.kind is TurnKind.BATCH and not schedule.batch_due
    batch = schedule.take_engine_batch(NOW)
    assert [(o.model_id, o.seq) for _, o in batch] == [
        ("train-1", 1),
        ("train-1", 2),
        ("train-1", 3),
        ("train-2", 1),
        ("train-2", 2),
    ]
    turn = schedule.next_turn(NOW)  # batch not due: the fair turn, here the lone model's
    assert turn is not None and turn.kind is TurnKind.ALONE and turn.owned.lease.model_id == "lone"
    assert schedule.batch_due
    turn = schedule.next_turn(NOW)
    assert (
        turn is not None and turn.kind is TurnKind.BATCH and turn.owned.lease.model_id == "train-1"
    )


def test_an_engine_batch_holds_at_most_engine_batch_ops() -> None:
    """Many models each with a long pass run: one batch stops at ENGINE_BATCH ops."""
    schedule = scheduler()
    for i in range(3):
        own(schedule, f"m{i}", f"t{i}", [FB] * 200 + [STEP])
    assert len(schedule.take_engine_batch(NOW)) == ENGINE_BATCH


def test_share_is_complete_once_the_optim_step_is_in() -> None:
    """Gathering waits for a model whose step has not fully arrived, not for one whose has."""
    schedule = scheduler()
    owned = own(schedule, "a", "t", [FB, FB])
    assert not schedule.batch_complete(NOW)
    owned.backlog.append(op("a", 3, STEP))
    assert schedule.batch_complete(NOW)


def test_a_share_of_forwards_alone_is_complete() -> None:
    """Forwards alone wait for nothing (no optim_step belongs with them), so gathering does not
    hold a lone forward for the quiet gap; once a forward_backward is among them its
    optim_step is awaited again, and an idle model beside them keeps the gather open for its
    next step."""
    schedule = scheduler()
    owned = own(schedule, "a", "t", [OpKind.FORWARD, OpKind.FORWARD])
    assert schedule.batch_complete(NOW)
    owned.backlog.append(op("a", 3, FB))
    owned.backlog.append(op("a", 4, OpKind.FORWARD))
    assert not schedule.batch_complete(NOW)
    owned.backlog.append(op("a", 5, STEP))
    assert schedule.batch_complete(NOW)
    owned.backlog.clear()
    owned.backlog.append(op("a", 6, OpKind.FORWARD))
    idle = own(schedule, "b", "u", [])
    idle.idle_since = NOW - 0.01
    assert not schedule.batch_complete(NOW)


def test_a_model_idle_for_a_while_holds_no_gather_open() -> None:
    """A model that ran just now may send its next step within the gather; one idle for
    IDLE_PEER_S (a lingering model, or a client busy elsewhere) will not, and no batch waits
    for it."""
    schedule = scheduler()
    own(schedule, "a", "t", [OpKind.FORWARD])
    idle = own(schedule, "b", "u", [])
    idle.idle_since = NOW - 0.01
    assert not schedule.batch_complete(NOW)
    assert schedule.batch_complete(NOW - 0.01 + IDLE_PEER_S)


def test_inline_pings_go_together_and_stop_at_a_models_first_other_op() -> None:
    """Inline pings of all models in one batch, each model's in order, none past its first op
    that is not inline; at most INLINE_BATCH."""
    schedule = scheduler()
    a = OwnedModel(lease=Lease("a", "w|1", 0, "t"), read_seq=3)
    a.backlog.extend([ping("a", 1), ping("a", 2, delay_ms=5), ping("a", 3)])
    schedule.owned["a"] = a
    b = OwnedModel(lease=Lease("b", "w|1", 0, "u"), read_seq=100)
    b.backlog.extend(ping("b", seq) for seq in range(1, 101))
    schedule.owned["b"] = b
    turn = schedule.next_turn(NOW)
    assert turn is not None and turn.kind is TurnKind.INLINE
    batch = schedule.take_inline_batch(NOW)
    assert len(batch) == INLINE_BATCH
    assert [o.seq for _, o in batch if o.model_id == "a"] == [1]
    assert [o.seq for _, o in batch if o.model_id == "b"] == list(range(1, INLINE_BATCH))


def test_ops_over_a_limit_go_back_in_order_and_sit_out() -> None:
    """Held-back ops return to the head of their backlog in order; the model is not runnable
    until the limit's retry time, and the idle wait ends then."""
    schedule = scheduler(batching=False)
    owned = own(schedule, "a", "t", [SAVE, SAVE, SAVE])
    first, second = owned.backlog.popleft(), owned.backlog.popleft()
    schedule.hold_back(owned, [first, second], retry_ms=250, now=NOW)
    assert [o.seq for o in owned.backlog] == [1, 2, 3]
    assert schedule.next_turn(NOW) is None
    assert abs(schedule.idle_wait_s(NOW, longest_s=1.0) - 0.25) < 1e-9
    turn = schedule.next_turn(NOW + 0.25)
    assert turn is not None and turn.op is not None and turn.op.seq == 1


def test_replayed_ops_run_alone_before_new_ones() -> None:
    """Ops up to replay_upto are replayed (never batched nor inline), in order."""
    schedule = scheduler()
    owned = own(schedule, "a", "t", [FB, STEP, FB])
    owned.replay_upto = 2
    kinds = [schedule.next_turn(NOW) for _ in range(2)]
    assert [(t.kind, t.op.seq) for t in kinds if t and t.op] == [
        (TurnKind.REPLAY, 1),
        (TurnKind.REPLAY, 2),
    ]
    assert not schedule.batch_complete(NOW)  # its next step is still on its way
    turn = schedule.next_turn(NOW)
    assert turn is not None and turn.kind is TurnKind.BATCH


def test_samples_join_each_model_in_order_and_the_quantum_is_bounded_below() -> None:
    """Leading samples of every model join together, none past a model's first other op; a
    quantum lasts as long as the unit before it, QUANTUM_S at least."""
    schedule = scheduler()
    own(schedule, "a", "t", [SAMPLE, SAMPLE, FB])
    own(schedule, "b", "u", [SAMPLE])
    turn = schedule.next_turn(NOW)
    assert turn is not None and turn.kind is TurnKind.JOIN and turn.op is None
    joined = schedule.take_stepped(NOW)
    # "a" had the turn, so it went to the back of the round robin.
    assert [(o.model_id, o.seq) for _, o in joined] == [("b", 1), ("a", 1), ("a", 2)]
    assert not schedule.any_stepped_head(NOW)
    assert quantum_after(0.0) == QUANTUM_S
    assert quantum_after(0.5) == 0.5
