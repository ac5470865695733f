"""The LoRA training engine: one base model, many adapters, every TrainingClient op.

Runs on the worker's compute thread, one op or one batch of ops at a time; knows no Redis and
no SQL. State that must outlive this process (checkpoints, snapshots) goes to `storage`, a
directory every worker of the deployment shares.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from transformers.utils import logging as transformers_logging

from queue_tinker.age import check_recipients, encrypt_in_place
from queue_tinker.builtin_models import load_tokenizer
from queue_tinker.errors import (
    DeviceMemoryError,
    ErrorCategory,
    QueueTinkerError,
    UserInputError,
)
from queue_tinker.settings import load_settings
from queue_tinker.types import CheckpointKind, CheckpointRecord, LossFn, OpKind, codec
from queue_tinker.types.checkpoints import PEFT_FILES, CheckpointPath, check_name, loadable
from queue_tinker.types.loss_inputs import ModelLimits, check_batch, resolve_loss_config
from queue_tinker.types.ops import Op
from queue_tinker.types.request_limits import (
    RequestLimits,
    check_batch_size,
    check_request_bytes,
)
from queue_tinker.types.tensors import Datum
from queue_tinker.types.training import (
    CreateModelInput,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    LoadInput,
    LoadWeightsResponse,
    LoraConfig,
    OptimParams,
    OptimStepResponse,
    SaveInput,
    SaveWeightsExternalResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    UnloadModelResponse,
)
from queue_tinker.workers import base_model as base_models
from queue_tinker.workers.adapters import Adapter, AdapterPool
from queue_tinker.workers.checkpoints import (
    CheckpointMeta,
    checkpoint_dir,
    read_meta,
    read_state,
    snapshot_dir,
    write_state,
)
from queue_tinker.workers.custom_loss_graph import GraphLoss
from queue_tinker.workers.dimuon import parse_optim_params
from queue_tinker.workers.engine import BatchShare, OpResult, is_inline_ping, parse_body, run_ping
from queue_tinker.workers.forward import forward_backward, grads_kept_on_error, optim_steps
from queue_tinker.workers.memory import device_budgets, is_out_of_memory, release_cached_memory
from queue_tinker.workers.model_pass import PassPlan
from queue_tinker.workers.sampling import SamplingOps
from queue_tinker.workers.train_batch import PassOp, padded_tokens, shared_pass

log = logging.getLogger(__name__)

UNLOADED = "_unloaded"  # marker file: the model was unloaded; its ops fail from then on
# Adapter.extra key: seq -> kept outcome (JSON) of the ops the snapshot the adapter came from
# holds but whose results may never have been published (see _already_applied).
SNAPSHOT_RESULTS = "snapshot_results"
# Ops whose data one shared model pass runs, many adapters' at once (cross-adapter batching):
# they only add to .grad, so a model's consecutive ones are independent of each other.
PASS_KINDS = frozenset({OpKind.FORWARD, OpKind.FORWARD_BACKWARD})
# What cross-adapter batching takes from a model's queue: its passes, and the step after them.
TRAIN_BATCH_KINDS = PASS_KINDS | {OpKind.OPTIM_STEP}
Outcome = OpResult | Exception
T = TypeVar("T")
DEFAULT_TRAIN_BATCH_TOKENS = 32_768  # QT_TRAIN_BATCH_TOKENS unset, off CUDA
DEFAULT_SAMPLE_BATCH_SEQUENCES = 64  # QT_SAMPLE_BATCH_SEQUENCES unset, off CUDA


def default_seed(model_id: str) -> int:
    """A model created without a seed still initialises the same way every time (replay)."""
    return int.from_bytes(hashlib.sha256(model_id.encode()).digest()[:4], "big")


class LoraEngine:
    def __init__(
        self,
        base_model: str,
        device: str,
        storage: Path,
        models_dir: Path,
        *,
        max_resident: int = 32,
        snapshot_every: int = 20,
        max_batch_sequences: int | None = None,
        request_limits: RequestLimits | None = None,
        cross_adapter_batch: bool = True,
        train_batch_tokens: int | None = None,
        dtype: str = "auto",
        plan: PassPlan | None = None,
    ) -> None:
        self.base_model = base_model
        self.cross_adapter_batch = cross_adapter_batch
        self.plan = plan or PassPlan()
        # The same QT_MAX_* limits the client and gateway enforce, again here: an op may come
        # from a client configured otherwise, or straight from Redis. None: this process's
        # settings (a worker is started with the deployment's QT_* environment).
        self.request_limits = request_limits or RequestLimits.of(load_settings())
        self.device = torch.device(device)
        self.storage = storage
        self.snapshot_every = snapshot_every
        transformers_logging.disable_progress_bar()  # per-shard bars are noise in worker logs
        base = base_models.load_base_model(base_model, device, models_dir, dtype)
        base.eval()  # no dropout anywhere: a step is a pure function of its inputs
        # What adapter_config.json names as the base: the name users know, not a local path.
        base.name_or_path = base_model
        self.limits = ModelLimits(
            vocab_size=base_models.vocab_size(base), context_length=base_models.context_length(base)
        )
        self.pool = AdapterPool(base, base_model, max_resident)
        # Unset budgets: the CPU defaults, or what the device's free memory holds now.
        budgets = device_budgets(
            base.config,
            self.device,
            base.dtype,
            checkpointing=self.plan.activation_checkpointing != "off",
        )
        if budgets is not None:
            log.info("device budgets from free memory: %s", budgets)
        self.train_batch_tokens = train_batch_tokens or (
            budgets.train_batch_tokens if budgets else DEFAULT_TRAIN_BATCH_TOKENS
        )
        max_batch_sequences = max_batch_sequences or (
            budgets.sample_batch_sequences if budgets else DEFAULT_SAMPLE_BATCH_SEQUENCES
        )
        self.largest_pass = 0  # padded tokens of the biggest pass that ran: what fits
        self.sampling = SamplingOps(
            self.pool,
            storage,
            base_model,
            self.limits,
            self.device,
            tokenizer=lambda: load_tokenizer(base_model, models_dir),
            max_batch_sequences=max_batch_sequences,
            request_limits=self.request_limits,
        )
        self._handlers: dict[OpKind, Callable[[Adapter, Op], OpResult]] = {
            OpKind.FORWARD: self._forward,
            OpKind.FORWARD_BACKWARD: self._forward_backward,
            OpKind.OPTIM_STEP: self._optim_step,
            OpKind.SAVE_STATE: self._save_state,
            OpKind.SAVE_WEIGHTS_FOR_SAMPLER: self._save_for_sampler,
            OpKind.SAVE_WEIGHTS_EXTERNAL: self._save_external,
            OpKind.LOAD_STATE: self._load_state,
            OpKind.UNLOAD_MODEL: self._unload,
        }
        # Outcomes of the ops run so far in the current execute_batch, per model: the worker
        # publishes them only when the whole batch is done, so a snapshot written meanwhile
        # keeps them (_snapshot, _already_applied).
        self._unpublished: dict[str, dict[int, Outcome]] = {}

    # --- the Engine interface --------------------------------------------------------------
    def execute(self, op: Op) -> OpResult:
        check_request_bytes(len(op.payload), self.request_limits)  # before decoding it
        if op.kind is OpKind.PING:
            return run_ping(op)
        if op.kind is OpKind.CREATE_MODEL:
            return self._create(op)
        if op.kind is OpKind.CREATE_SAMPLING_SESSION:
            return self.sampling.create_session(op)
        if op.kind is OpKind.SAMPLE:
            result = self.sampling.run([op])[0]
            if isinstance(result, Exception):
                raise result
            return result
        handler = self._handlers.get(op.kind)
        if handler is None:
            raise UserInputError(f"kind: {op.kind.value!r} is not supported by this worker")
        adapter = self._admit(op)
        if isinstance(adapter, OpResult):
            return adapter
        if op.kind in PASS_KINDS:
            # Only a model pass reads PEFT's active adapter; the other ops touch this adapter's
            # own tensors, and set_adapter walks every module (0.7 ms a call on the tiny model).
            self.pool.activate(adapter)
        result = handler(adapter, op)
        adapter.last_seq = op.seq
        return result

    def batchable(self, op: Op) -> bool:
        return self.cross_adapter_batch and op.kind in TRAIN_BATCH_KINDS

    def stepped(self, op: Op) -> bool:
        return op.kind is OpKind.SAMPLE

    def join(self, ops: Sequence[Op]) -> None:
        self.sampling.join(ops)

    def step(self, budget_s: float) -> list[tuple[Op, OpResult | Exception]]:
        return self.sampling.step(budget_s)

    def stepping(self) -> bool:
        return self.sampling.stepping()

    def stop(self, reasons: Mapping[str, str]) -> None:
        self.sampling.stop(reasons)

    def batch_share(self, backlog: Iterable[Op]) -> BatchShare:
        """One training step: the leading forward / forward_backward ops and the optim_step
        after them (complete once that is there); a client that pipelines many steps then hears
        of each as it finishes, not of all of them once the last is done."""
        taken = 0
        for op in backlog:
            if not self.batchable(op):
                return BatchShare(taken, complete=True)
            taken += 1
            if op.kind is OpKind.OPTIM_STEP:
                return BatchShare(taken, complete=True)
        return BatchShare(taken, complete=False)

    def execute_batch(self, ops: Sequence[Op]) -> list[OpResult | Exception]:
        """Training ops in rounds (_run_training); sample ops, if any, through the decode loop
        to their end (the worker joins them instead). An op with bad input fails alone, as in
        execute."""
        outcomes: list[Outcome | None] = [None] * len(ops)
        samples = [i for i, op in enumerate(ops) if op.kind is OpKind.SAMPLE]
        for i, outcome in zip(samples, self.sampling.run([ops[i] for i in samples]), strict=True):
            outcomes[i] = outcome
        training = [(i, op) for i, op in enumerate(ops) if op.kind is not OpKind.SAMPLE]
        try:
            self._run_training(training, outcomes)
        finally:
            self._unpublished.clear()
        done = [o for o in outcomes if o is not None]  # every op got a result or its error
        assert len(done) == len(ops)
        return done

    def runs_inline(self, op: Op) -> bool:
        return is_inline_ping(op)

    def durable_seq(self, model_id: str) -> int | None:
        if self.sampling.owns(model_id):
            return self.sampling.sessions[model_id]  # nothing to replay: all of it is durable
        adapter = self.pool.adapters.get(model_id)
        return adapter.snapshot_seq if adapter is not None and adapter.snapshot_seq else None

    def restore_point(self, model_id: str) -> int | None:
        adapter = self.pool.adapters.get(model_id)
        if adapter is not None:
            return adapter.last_seq
        meta = read_meta(snapshot_dir(self.storage, model_id))
        # No snapshot: a sampling session (no state), or a run that never got created.
        return meta.seq if meta is not None else None

    def persist(self, model_id: str) -> None:
        adapter = self.pool.adapters.get(model_id)
        if adapter is not None and adapter.last_seq > adapter.snapshot_seq:
            self._snapshot(adapter)

    def drop(self, model_id: str) -> None:
        self.pool.remove(model_id)
        self.sampling.cancel(model_id)
        self.sampling.sessions.pop(model_id, None)

    def resident(self) -> list[str]:
        return [*self.pool.adapters, *self.sampling.sessions]

    def device_memory_bytes(self) -> int:
        if self.device.type != "cuda":
            return 0
        return int(torch.cuda.memory_allocated(self.device))

    # --- residency ---------------------------------------------------------------------------
    def _resident(self, model_id: str) -> Adapter:
        adapter = self.pool.get(model_id)
        if adapter is not None:
            return adapter
        if (self.storage / model_id / UNLOADED).exists():
            raise UserInputError(f"model {model_id} was unloaded; create a new training client")
        directory = snapshot_dir(self.storage, model_id)
        if read_meta(directory) is None:
            # Created, but its state never reached storage: its worker died before the first
            # snapshot. Rebuilding it by replaying the op log is the recovery path.
            raise QueueTinkerError(f"model {model_id}: no saved state to restore it from")
        state = read_state(directory, optimizer=True, grads=True)
        adapter = self._add(
            model_id,
            state.meta.tenant_id,
            LoraConfig.model_validate(state.meta.lora_config),
            seed=0,
        )
        self.pool.load_weights(adapter, state.weights)
        self.pool.load_optimizer(adapter, state)
        self.pool.load_grads(adapter, state.grads)
        adapter.step = state.meta.step
        adapter.last_seq = adapter.snapshot_seq = state.meta.seq
        kept = {int(seq): outcome for seq, outcome in state.meta.batch_results.items()}
        if state.meta.op_result is not None:
            kept[state.meta.seq] = state.meta.op_result
        if kept:
            adapter.extra[SNAPSHOT_RESULTS] = kept
        return adapter

    def _admit(self, op: Op) -> Adapter | OpResult:
        """The op's adapter, made resident; or, for an op the state already holds, its kept
        result."""
        adapter = self._resident(op.model_id)
        if op.seq <= adapter.last_seq:
            return self._already_applied(adapter, op)
        adapter.extra.pop(SNAPSHOT_RESULTS, None)  # the state moves on: no op of them comes again
        return adapter

    def _already_applied(self, adapter: Adapter, op: Op) -> OpResult:
        """An op whose effect the state already holds: the op that wrote the snapshot this
        adapter was restored from, or one run before it in the same batch, by an owner that died
        (or lost its lease) before it published the result. The snapshot kept that result:
        publish it (or raise its error), do not apply the op a second time."""
        kept = adapter.extra.get(SNAPSHOT_RESULTS, {})
        # max(kept) is the snapshot's own seq: equal to last_seq while nothing ran since.
        if op.seq in kept and max(kept) == adapter.last_seq:
            log.info(
                "model %s: op %d is in the snapshot already; its kept result is published",
                op.model_id,
                op.seq,
            )
            return _outcome_from(kept[op.seq])
        raise RuntimeError(f"model {op.model_id}: op seq {op.seq} after {adapter.last_seq}")

    def _add(self, model_id: str, tenant_id: str, config: LoraConfig, seed: int) -> Adapter:
        for victim in self.pool.over_capacity():
            log.info("evicting %s (least recently used) to storage", victim.model_id)
            self.persist(victim.model_id)
            self.pool.remove(victim.model_id)
        return self.pool.add(model_id, tenant_id, config, seed)

    def _snapshot(self, adapter: Adapter, result: OpResult | None = None) -> None:
        """Write the adapter's state as the model's snapshot. `result`: the outcome of the op
        being run (adapter.last_seq), which the snapshot already contains; it is kept with it,
        because the op's publish may never happen (the worker dies first) and the next owner,
        starting from this snapshot, must publish that result instead of running the op again.
        The same holds for the model's ops run earlier in the batch being run: their outcomes
        are kept too.
        """
        directory = snapshot_dir(self.storage, adapter.model_id)
        stored = read_meta(directory)
        if stored is not None and stored.seq > adapter.last_seq:
            # Another worker owns the model now and has gone further (this one stalled past
            # its lease and has not heard yet). Going back would lose the steps in between:
            # the log is trimmed up to the newer snapshot.
            log.warning(
                "model %s: not overwriting the snapshot at seq %d with older state (seq %d)",
                adapter.model_id,
                stored.seq,
                adapter.last_seq,
            )
            return
        # Only ops the snapshot's state covers: an op after it (one that failed, leaving
        # last_seq behind it) is run again by the next owner, not taken from here.
        earlier = {
            seq: outcome
            for seq, outcome in self._unpublished.get(adapter.model_id, {}).items()
            if seq <= adapter.last_seq
        }
        meta = self._meta(
            adapter,
            kind="snapshot",
            op_result=_result_to(result) if result is not None else None,
            batch_results={str(seq): _outcome_to(outcome) for seq, outcome in earlier.items()},
        )
        write_state(
            directory,
            self.pool.export(adapter, meta),
            self.pool.peft_adapter_config(adapter),
            optimizer=True,
            grads=True,
        )
        adapter.snapshot_seq = adapter.last_seq

    def _meta(self, adapter: Adapter, kind: str, **extra: Any) -> CheckpointMeta:
        return CheckpointMeta(
            model_id=adapter.model_id,
            tenant_id=adapter.tenant_id,
            base_model=self.base_model,
            lora_config=adapter.config.model_dump(),
            seq=adapter.last_seq,
            step=adapter.step,
            created_at=time.time(),
            kind=kind,
            **extra,
        )

    # --- training ops of many models, batched ------------------------------------------------
    def _run_training(self, ops: Sequence[tuple[int, Op]], outcomes: list[Outcome | None]) -> None:
        """Each model's ops in order, in rounds: every model's leading run of forward /
        forward_backward ops goes into one shared pass with all the others' (weights change
        only at optim_step, so a run's ops do not depend on each other); then every model's next
        op (its optim_step), the optim_steps together; and again, until every op has run."""
        queues: dict[str, deque[tuple[int, Op]]] = {}
        for index, op in ops:
            queues.setdefault(op.model_id, deque()).append((index, op))
        while queues:
            passes: list[tuple[int, Op]] = []
            for queue in queues.values():
                while queue and queue[0][1].kind in PASS_KINDS:
                    passes.append(queue.popleft())
            self._run_passes(passes, outcomes)
            self._run_steps([queue.popleft() for queue in queues.values() if queue], outcomes)
            queues = {model: queue for model, queue in queues.items() if queue}

    def _run_passes(self, ops: Sequence[tuple[int, Op]], outcomes: list[Outcome | None]) -> None:
        """The ops in as few shared passes as fit: each pass under train_batch_tokens padded
        tokens (one op always fits) and max_resident models, so that making one model resident
        never evicts another of the same pass."""
        chunk: list[tuple[int, Op, PassOp]] = []
        for index, op in ops:
            models = {o.model_id for _, o, _ in chunk}
            if op.model_id not in models and len(models) >= self.pool.max_resident:
                self._run_pass(chunk, outcomes)
                chunk = []
            try:
                prepared = self._pass_op(op)
            except Exception as exc:  # this op's failure, as execute would raise it
                self._record(outcomes, index, op, exc)
                continue
            if isinstance(prepared, OpResult):  # already applied: its kept result
                self._record(outcomes, index, op, prepared)
                continue
            if (
                chunk
                and padded_tokens([*(p for _, _, p in chunk), prepared]) > self.train_batch_tokens
            ):
                self._run_pass(chunk, outcomes)
                chunk = []
            chunk.append((index, op, prepared))
        self._run_pass(chunk, outcomes)

    def _admit_batched(self, op: Op) -> Adapter | OpResult:
        """execute's checks of a training op, in its order: its size, then its model (or, for
        an op the state already holds, its kept result)."""
        check_request_bytes(len(op.payload), self.request_limits)
        return self._admit(op)

    def _pass_op(self, op: Op) -> PassOp | OpResult:
        """execute's checks, in its order, and the op ready for a shared pass."""
        adapter = self._admit_batched(op)
        if isinstance(adapter, OpResult):
            return adapter
        batch, config = self._checked_batch(op)
        return PassOp(
            adapter=adapter,
            data=batch.data,
            loss_fn=self._loss(batch),
            config=config,
            backward=op.kind is OpKind.FORWARD_BACKWARD,
        )

    def _run_pass(
        self, chunk: Sequence[tuple[int, Op, PassOp]], outcomes: list[Outcome | None]
    ) -> None:
        if not chunk:
            return
        prepared_ops = [p for _, _, p in chunk]
        outs = self._try_pass(prepared_ops)
        if outs is None:  # out of memory, with nothing of the failed pass still referenced
            if len(chunk) > 1:
                self._split_pass(chunk, outcomes)
                return
            outs = [self._memory_error([d for p in prepared_ops for d in p.data])]
        models = float(len({op.model_id for _, op, _ in chunk}))
        for (index, op, prepared), out in zip(chunk, outs, strict=True):
            if isinstance(out, Exception):
                self._record(outcomes, index, op, out)
                continue
            prepared.adapter.last_seq = op.seq
            # batch_models: how many models shared the pass (the job record's metrics only;
            # the result is what the op returns alone).
            self._record(
                outcomes, index, op, _pass_result(out, prepared.data, {"batch_models:max": models})
            )

    def _try_pass(self, ops: Sequence[PassOp]) -> list[ForwardBackwardOutput | Exception] | None:
        """The shared pass's outcomes, or every op's failure; None if it ran out of memory."""

        def run() -> list[ForwardBackwardOutput | Exception]:
            try:
                return shared_pass(self.pool, ops, self.device, self.plan)
            except Exception as exc:  # the pass itself failed: so does every op in it
                if is_out_of_memory(exc):
                    raise
                log.exception("a shared pass of %d ops failed", len(ops))
                return [exc] * len(ops)

        return self._unless_out_of_memory(
            f"a shared pass of {len(ops)} ops", run, padded_tokens(ops)
        )

    def _unless_out_of_memory(self, what: str, run: Callable[[], T], tokens: int) -> T | None:
        """run(), or None if it ran out of memory (logged, the device's cache released); a
        run that fits raises largest_pass to its `tokens`. None is answered outside: an
        exception being handled keeps the failed pass's tensors alive through its traceback,
        and a retry inside the handler would need room for both."""
        try:
            result = run()
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            log.warning("%s ran out of memory: %s", what, exc)
            result = None
        if result is None:
            release_cached_memory(self.device)
            return None
        self.largest_pass = max(self.largest_pass, tokens)
        return result

    def _split_pass(
        self, chunk: Sequence[tuple[int, Op, PassOp]], outcomes: list[Outcome | None]
    ) -> None:
        """A pass ran out of device memory (its gradients are back as they were): run its
        halves, and keep later passes under what failed."""
        tokens = padded_tokens([p for _, _, p in chunk])
        self.train_batch_tokens = max(1, min(self.train_batch_tokens, tokens // 2))
        log.warning(
            "a shared pass of %d ops (%d padded tokens) ran out of memory: splitting "
            "it; passes now hold at most %d tokens",
            len(chunk),
            tokens,
            self.train_batch_tokens,
        )
        half = len(chunk) // 2
        self._run_pass(chunk[:half], outcomes)
        self._run_pass(chunk[half:], outcomes)

    def _memory_error(self, data: Sequence[Datum]) -> DeviceMemoryError:
        """An op that does not fit even alone: say what it tried and what fits."""
        rows = len(data)
        width = max(d.model_input.length for d in data)
        fits = (
            f"the largest pass this worker has run held {self.largest_pass} padded tokens"
            if self.largest_pass
            else "no pass has run on this worker yet"
        )
        return DeviceMemoryError(
            f"data: {rows} rows x {width} tokens ({rows * width} padded tokens) do not fit in "
            f"{self.device.type} memory; {fits}: split the batch "
            "into smaller forward_backward calls"
        )

    def _run_steps(self, ops: Sequence[tuple[int, Op]], outcomes: list[Outcome | None]) -> None:
        """Optim_steps of different models (what follows a round's passes: batch_share takes
        nothing else), in one optimizer call (_step)."""
        steps: list[tuple[int, Op, Adapter, OptimParams]] = []
        for index, op in ops:
            assert op.kind is OpKind.OPTIM_STEP, op.kind
            if len(steps) >= self.pool.max_resident:
                # Making one more model resident could evict one of these: step them first.
                self._run_step_call(steps, outcomes)
                steps = []
            try:
                adapter = self._admit_batched(op)
                if isinstance(adapter, OpResult):  # already applied: its kept result
                    self._record(outcomes, index, op, adapter)
                    continue
                steps.append(
                    (index, op, adapter, parse_optim_params(adapter.config.optimizer, op.payload))
                )
            except Exception as exc:
                self._record(outcomes, index, op, exc)
        self._run_step_call(steps, outcomes)

    def _run_step_call(
        self, steps: Sequence[tuple[int, Op, Adapter, OptimParams]], outcomes: list[Outcome | None]
    ) -> None:
        if not steps:
            return
        try:
            results: list[Outcome] = list(self._step([(a, op, p) for _, op, a, p in steps]))
        except Exception as exc:  # the engine's own failure: every step in it fails
            log.exception("an optimizer step of %d models failed", len(steps))
            results = [exc] * len(steps)
        for (index, op, _, _), result in zip(steps, results, strict=True):
            self._record(outcomes, index, op, result)

    def _record(self, outcomes: list[Outcome | None], index: int, op: Op, outcome: Outcome) -> None:
        outcomes[index] = outcome
        self._unpublished.setdefault(op.model_id, {})[op.seq] = outcome

    # --- ops -----------------------------------------------------------------------------------
    def _create(self, op: Op) -> OpResult:
        body = parse_body(CreateModelInput, op.payload)
        if body.base_model != self.base_model:
            raise UserInputError(
                f"base_model: {body.base_model!r} is not served by this worker ({self.base_model})"
            )
        if self.pool.get(op.model_id) is None:
            if read_meta(snapshot_dir(self.storage, op.model_id)) is not None:
                self._resident(op.model_id)  # created before, by an earlier owner
            else:
                config = body.lora_config
                seed = config.seed if config.seed is not None else default_seed(op.model_id)
                adapter = self._add(op.model_id, body.tenant_id, config, seed)
                adapter.last_seq = op.seq
                self._snapshot(adapter)  # from here on the model survives its worker
        return OpResult(result=codec.encode({"model_id": op.model_id}))

    def _forward(self, adapter: Adapter, op: Op) -> OpResult:
        return self._run_batch(op, backward=False)

    def _forward_backward(self, adapter: Adapter, op: Op) -> OpResult:
        with grads_kept_on_error([adapter]):
            return self._run_batch(op, backward=True)

    def _run_batch(self, op: Op, *, backward: bool) -> OpResult:
        batch, config = self._checked_batch(op)
        out = self._unless_out_of_memory(
            f"model {op.model_id}: op {op.seq}",
            lambda: forward_backward(
                self.pool.model,
                batch.data,
                self._loss(batch),
                config,
                self.device,
                backward=backward,
                plan=self.plan,
            ),
            len(batch.data) * max(d.model_input.length for d in batch.data),
        )
        if out is None:
            raise self._memory_error(batch.data)
        return _pass_result(out, batch.data)

    def _loss(self, batch: ForwardBackwardInput) -> LossFn | GraphLoss:
        """The batch's loss: built in, or the uploaded loss it carries (rebuilt from the
        allow-list, workers/custom_loss_graph.py)."""
        if batch.custom_loss is not None:
            return GraphLoss(batch.custom_loss, self.device)
        return batch.loss_fn

    def _checked_batch(self, op: Op) -> tuple[ForwardBackwardInput, dict[str, float]]:
        """A forward / forward_backward op's body, checked, and its loss config resolved."""
        batch = parse_body(ForwardBackwardInput, op.payload)
        check_batch_size(batch, self.request_limits)
        check_batch(batch, self.limits)
        return batch, resolve_loss_config(batch.loss_fn, batch.loss_fn_config)

    def _optim_step(self, adapter: Adapter, op: Op) -> OpResult:
        params = parse_optim_params(adapter.config.optimizer, op.payload)
        return self._step([(adapter, op, params)])[0]

    def _step(self, steps: Sequence[tuple[Adapter, Op, OptimParams]]) -> list[OpResult]:
        """optim_step ops of different models, in one optimizer call (alone or batched: the
        same code, so the same numbers); each model snapshots every snapshot_every steps."""
        all_metrics = optim_steps([(adapter, params) for adapter, _, params in steps])
        results = []
        for (adapter, op, _), metrics in zip(steps, all_metrics, strict=True):
            adapter.last_seq = op.seq
            result = OpResult(
                result=codec.encode(OptimStepResponse(metrics=metrics).model_dump()),
                metrics=metrics,
            )
            if adapter.step % self.snapshot_every == 0:
                self._snapshot(adapter, result)
            results.append(result)
        return results

    def _save_state(self, adapter: Adapter, op: Op) -> OpResult:
        path, record = self._save(adapter, op, CheckpointKind.STATE)
        response = SaveWeightsResponse(path=str(path))
        return OpResult(result=codec.encode(response.model_dump()), records=[record])

    def _save_for_sampler(self, adapter: Adapter, op: Op) -> OpResult:
        path, record = self._save(adapter, op, CheckpointKind.SAMPLER)
        response = SaveWeightsForSamplerResponse(path=str(path))
        return OpResult(result=codec.encode(response.model_dump()), records=[record])

    def _save_external(self, adapter: Adapter, op: Op) -> OpResult:
        """The PEFT files (adapter_config.json, adapter_model.safetensors) for download,
        each encrypted to the age recipients when there are any."""
        path, record = self._save(adapter, op, CheckpointKind.EXTERNAL)
        response = SaveWeightsExternalResponse(path=str(path), size_bytes=record.size_bytes)
        return OpResult(result=codec.encode(response.model_dump()), records=[record])

    def _save(
        self, adapter: Adapter, op: Op, kind: CheckpointKind
    ) -> tuple[CheckpointPath, CheckpointRecord]:
        body = parse_body(SaveInput, op.payload)
        if body.age_encryption_recipients and kind is not CheckpointKind.EXTERNAL:
            raise UserInputError(
                "age_encryption_recipients: only external weights are "
                "encrypted (save_weights_external)"
            )
        recipients = check_recipients(body.age_encryption_recipients)
        path = CheckpointPath(adapter.model_id, kind, check_name(body.name))
        directory = checkpoint_dir(self.storage, path)
        existing = read_meta(directory)
        now = time.time()
        expires_at = now + body.ttl_seconds if body.ttl_seconds else None
        if existing is not None and existing.seq != op.seq:
            raise UserInputError(
                f"name: {body.name!r} is already a {kind.value} checkpoint of this model "
                f"({path}); checkpoints are never overwritten, pick a new name"
            )
        adapter.last_seq = op.seq
        meta = self._meta(adapter, kind=kind.value, id=str(path), expires_at=expires_at)
        if existing is None:
            write_state(
                directory,
                self.pool.export(adapter, meta),
                self.pool.peft_adapter_config(adapter),
                optimizer=kind is CheckpointKind.STATE,
            )
        if recipients:  # also on a replay: a crash may have come before the encryption
            encrypt_in_place(directory, PEFT_FILES, recipients)
        size = sum(f.stat().st_size for f in directory.iterdir())
        record = CheckpointRecord(
            id=str(path),
            model_id=adapter.model_id,
            tenant_id=adapter.tenant_id,
            name=body.name,
            kind=kind,
            path=str(directory),
            size_bytes=size,
            created_at=now,
            expires_at=expires_at,
        )
        return path, record

    def _load_state(self, adapter: Adapter, op: Op) -> OpResult:
        body = parse_body(LoadInput, op.payload)
        path = loadable(CheckpointPath.parse(body.path))
        if body.optimizer and path.kind is not CheckpointKind.STATE:
            raise UserInputError(
                f"path: {body.path} holds weights only (sampler weights); optimizer state "
                "comes from a tinker://<run>/weights/<name> checkpoint"
            )
        directory = checkpoint_dir(self.storage, path)
        meta = read_meta(directory)
        # Another tenant's checkpoint is reported exactly like a missing one, unless published.
        if meta is None or (meta.tenant_id != adapter.tenant_id and not meta.public):
            raise UserInputError(f"path: no checkpoint at {body.path}")
        self._check_compatible(adapter, meta, body.path)
        state = read_state(directory, optimizer=body.optimizer)
        self.pool.load_weights(adapter, state.weights)
        # load_state resets the optimizer (moments and step count); with_optimizer restores them.
        self.pool.load_optimizer(adapter, state)
        self.pool.load_grads(adapter, {})
        adapter.step = state.meta.step if body.optimizer else 0
        adapter.last_seq = op.seq
        result = OpResult(result=codec.encode(LoadWeightsResponse(path=body.path).model_dump()))
        self._snapshot(adapter, result)
        return result

    def _check_compatible(self, adapter: Adapter, meta: CheckpointMeta, path: str) -> None:
        if meta.base_model != self.base_model:
            raise UserInputError(
                f"path: {path} was trained on {meta.base_model}, this model is on {self.base_model}"
            )
        theirs = LoraConfig.model_validate(meta.lora_config).model_dump(exclude={"seed"})
        ours = adapter.config.model_dump(exclude={"seed"})
        if theirs != ours:
            raise UserInputError(
                f"path: {path} has LoRA config {theirs}, this model has {ours}; they must match"
            )

    def _unload(self, adapter: Adapter, op: Op) -> OpResult:
        self.pool.remove(adapter.model_id)
        model_dir = self.storage / adapter.model_id
        shutil.rmtree(snapshot_dir(self.storage, adapter.model_id), ignore_errors=True)
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / UNLOADED).touch()
        return OpResult(
            result=codec.encode(UnloadModelResponse(model_id=adapter.model_id).model_dump())
        )


def _pass_result(
    out: ForwardBackwardOutput, data: Sequence[Datum], extra_metrics: dict[str, float] | None = None
) -> OpResult:
    return OpResult(
        result=codec.encode(out.model_dump()),
        metrics={**out.metrics, **(extra_metrics or {})},
        tokens=sum(datum.model_input.length for datum in data),
    )


def _outcome_to(outcome: Outcome) -> dict[str, Any]:
    """An op's result, or its error as the worker would publish it, as JSON for a snapshot."""
    if isinstance(outcome, OpResult):
        return _result_to(outcome)
    if isinstance(outcome, QueueTinkerError):
        return {"error": outcome.message, "category": outcome.category.value}
    return {"error": f"{type(outcome).__name__}: {outcome}", "category": ErrorCategory.SERVER.value}


def _outcome_from(kept: dict[str, Any]) -> OpResult:
    """A kept outcome: the result, or its error raised again."""
    if "error" in kept:
        category = ErrorCategory(kept["category"])
        if category is ErrorCategory.USER:
            raise UserInputError(kept["error"])
        raise QueueTinkerError(kept["error"], category=category)
    return _result_from(kept)


def _result_to(result: OpResult) -> dict[str, Any]:
    """An op's outcome as JSON for a snapshot's meta (its records are not kept: the ops that
    snapshot write none)."""
    return {
        "result": base64.b64encode(result.result).decode(),
        "metrics": result.metrics,
        "tokens": result.tokens,
    }


def _result_from(kept: dict[str, Any]) -> OpResult:
    return OpResult(
        result=base64.b64decode(kept["result"]),
        metrics=kept.get("metrics"),
        tokens=int(kept.get("tokens", 0)),
    )
