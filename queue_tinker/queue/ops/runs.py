"""Opening a model's queue: a training run (new, or from a checkpoint) or a sampling session.

The Python client and the HTTP gateway both open queues through here, so a run or a session
is the same thing whichever door it came in by. Each function registers the queue and submits
its first ops through `submit`, the caller's own way of enqueueing (the client keeps a future
per op; the gateway only needs the request id). A repeated call with the same id opens
nothing new: the create ops carry fixed idempotency keys.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from queue_tinker.errors import UserInputError
from queue_tinker.queue.ops.inflight import InflightWeights
from queue_tinker.queue.ops.jobs import JobQueue
from queue_tinker.types import OpKind, codec
from queue_tinker.types.enums import CheckpointKind
from queue_tinker.types.model_names import served_base
from queue_tinker.types.requests.sampling import CreateSamplingSessionInput
from queue_tinker.types.requests.training import (
    CreateModelInput,
    LoadInput,
    LoraConfig,
    check_base_model,
    check_user_metadata,
)
from queue_tinker.types.service.checkpoints import CheckpointPath, loadable

T = TypeVar("T")
# (model id, kind, payload, idempotency key) -> whatever the caller keeps of the submit
Submit = Callable[[str, OpKind, bytes, str | None], Awaitable[T]]

CREATE_KEY = "create"
LOAD_STATE_KEY = "create-load-state"


async def open_training_run(
    jobs: JobQueue,
    submit: Submit[T],
    model_id: str,
    *,
    base_model: str,
    tenant_id: str,
    session_id: str | None,
    config: LoraConfig,
    user_metadata: object = None,
) -> T:
    """A new LoRA run: its queue, then its create op (the worker builds the adapter).
    user_metadata (string to string) is kept with the run for the REST answers."""
    check_base_model(base_model)
    metadata = check_user_metadata(user_metadata)
    await jobs.register_model(
        model_id,
        base_model=base_model,
        tenant_id=tenant_id,
        session_id=session_id,
        lora_config=config.model_dump(),
        user_metadata=metadata,
    )
    body = CreateModelInput(lora_config=config, tenant_id=tenant_id, base_model=base_model)
    return await submit(model_id, OpKind.CREATE_MODEL, codec.encode(body.model_dump()), CREATE_KEY)


async def checkpoint_run(
    jobs: JobQueue, path: CheckpointPath, tenant_id: str, field: str
) -> dict[str, Any]:
    """The meta of the training run that saved a checkpoint. Another tenant's run reads exactly
    like a missing one, unless the checkpoint is published (readable by every tenant)."""
    info = await jobs.tenant_model(path.run_id, tenant_id)
    if info is None and await jobs.redis.get(jobs.keys.published_checkpoint(str(path))):
        info = await jobs.model_info(path.run_id)
    if info is None:
        raise UserInputError(f"{field}: no checkpoint {path} (unknown run {path.run_id!r})")
    return info


async def checked_load(
    jobs: JobQueue, path: str, optimizer: bool, *, into: str, tenant_id: str
) -> LoadInput:
    """A load_state op's body into the run `into`, checked at the door as a new run from the
    checkpoint is: a loadable path of a run the tenant may read (its own, or a published
    checkpoint's), and a state checkpoint when the optimizer comes with it. A path of `into`
    itself is left to the worker: a save queued before this load may not have run yet."""
    parsed = loadable(CheckpointPath.parse(path))
    if optimizer and parsed.kind is not CheckpointKind.STATE:
        raise UserInputError(
            f"path: {path} holds weights only (sampler weights); optimizer state comes from a "
            "tinker://<run>/weights/<name> checkpoint"
        )
    if parsed.run_id != into:
        await checkpoint_run(jobs, parsed, tenant_id, "path")
    return LoadInput(path=path, optimizer=optimizer)


async def open_training_run_from_state(
    jobs: JobQueue,
    submit: Submit[T],
    model_id: str,
    path: str,
    *,
    tenant_id: str,
    session_id: str | None,
    optimizer: bool,
    base_model: str | None = None,
    user_metadata: object = None,
) -> T:
    """A new run that starts from a checkpoint: the checkpoint's base model and LoRA config,
    its weights, and with `optimizer` its optimizer state. Returns the load op's submit."""
    parsed = loadable(CheckpointPath.parse(path))
    source = await checkpoint_run(jobs, parsed, tenant_id, "path")
    if base_model is not None and served_base(base_model) != served_base(source["base_model"]):
        raise UserInputError(
            f"base_model: {base_model!r} does not match path, which was "
            f"trained on {source['base_model']!r}"
        )
    config = LoraConfig.model_validate(source["lora_config"])
    await open_training_run(
        jobs,
        submit,
        model_id,
        base_model=base_model or source["base_model"],  # a cap of its own, or the run's
        tenant_id=tenant_id,
        session_id=session_id,
        config=config,
        user_metadata=user_metadata,
    )
    body = LoadInput(path=path, optimizer=optimizer)
    return await submit(
        model_id, OpKind.LOAD_STATE, codec.encode(body.model_dump()), LOAD_STATE_KEY
    )


async def sampling_base_model(
    jobs: JobQueue, tenant_id: str, model_path: str | None, base_model: str | None
) -> str:
    """The base model a sampling session runs on: the checkpoint's run's, or the one asked."""
    if model_path is None and base_model is None:
        raise UserInputError(
            "model_path, base_model: pass one (a tinker:// checkpoint path, or "
            "a base model to sample from without an adapter)"
        )
    if model_path is not None:
        path = loadable(CheckpointPath.parse(model_path, "model_path"), "model_path")
        trained_on = str((await checkpoint_run(jobs, path, tenant_id, "model_path"))["base_model"])
        if base_model is not None and served_base(base_model) != served_base(trained_on):
            raise UserInputError(
                f"base_model: {base_model!r} does not match model_path, which "
                f"was trained on {trained_on!r}"
            )
        return check_base_model(base_model) if base_model is not None else trained_on
    return check_base_model(base_model)


async def open_sampling_session(
    jobs: JobQueue,
    submit: Submit[T],
    sampler_id: str,
    *,
    base_model: str,
    tenant_id: str,
    session_id: str | None,
    model_path: str | None,
    inflight_of: str | None = None,
) -> T:
    """A sampling session's queue, then its create op (a worker checks the weights).
    inflight_of: the training run whose inflight weights it follows (model_path is the save
    that opened it)."""
    await jobs.register_sampling_session(
        sampler_id,
        base_model=base_model,
        tenant_id=tenant_id,
        session_id=session_id,
        model_path=model_path,
        inflight_of=inflight_of,
    )
    body = CreateSamplingSessionInput(
        tenant_id=tenant_id, base_model=base_model, model_path=model_path
    )
    return await submit(
        sampler_id, OpKind.CREATE_SAMPLING_SESSION, codec.encode(body.model_dump()), CREATE_KEY
    )


async def sample_weights(inflight: InflightWeights, info: dict[str, Any]) -> str | None:
    """The weights a session's next sample runs on (its model_info): the newest inflight
    weights of the run it follows, else (or once they expired) the session's own."""
    if info.get("inflight_of"):
        newest = await inflight.path(info["inflight_of"])
        if newest is not None:
            return newest
    model_path: str | None = info["model_path"]
    return model_path
