"""The Tinker protocol's training calls (docs/tinker-http-protocol.md, section 5). Every call
that does model work enqueues an op and answers at once with its request id; the result comes
from retrieve_future. Ops of a model run in the order of the client's seq_id."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request

from queue_tinker.age import check_recipients
from queue_tinker.builtin_models import ensure_tokenizer, is_builtin
from queue_tinker.errors import UserInputError
from queue_tinker.gateway.auth import TenantDep
from queue_tinker.gateway.envelope.compressed import request_body
from queue_tinker.gateway.off_loop import OffLoopRoute, off_loop
from queue_tinker.gateway.proto.convert import parse_forward_backward
from queue_tinker.gateway.queue_access import GatewayQueue, QueueDep
from queue_tinker.gateway.tinker.bodies import (
    CreateModelRequest,
    JsonForwardBackwardRequest,
    LoadWeightsRequest,
    ModelRequest,
    OptimStepRequest,
    SaveWeightsExternalRequest,
    SaveWeightsRequest,
)
from queue_tinker.gateway.tinker.custom_loss import custom_loss_for
from queue_tinker.queue.ops import runs
from queue_tinker.store import queries
from queue_tinker.types import OpKind, codec
from queue_tinker.types.enums import Optimizer
from queue_tinker.types.model_names import served_base
from queue_tinker.types.requests.loss_inputs import check_batch, check_batch_size
from queue_tinker.types.requests.request_limits import RequestLimits, encode_request
from queue_tinker.types.requests.training import (
    AdamParams,
    DimuonParams,
    ForwardBackwardInput,
    LoadInput,
    SaveInput,
    check_base_model,
)
from queue_tinker.types.service.checkpoints import CheckpointPath, check_name, loadable
from queue_tinker.types.validation import validated

router = APIRouter(prefix="/api/v1", route_class=OffLoopRoute)
# The protobuf carries seq_id as an int32, so no SDK sends more. A JSON one past ~1e17 would
# come back from Redis's Lua as "1e+17", which no longer reads as an integer.
MAX_SEQ_ID = 2**31 - 1
# get_info's optimizer_config, as the SDK's AdamOptimizerConfig / DimuonOptimizerConfig.
OPTIMIZER_CONFIGS = {
    Optimizer.ADAMW: {"type": "adamw"},
    Optimizer.DIMUON: {"type": "dimuon", "version": 1},
}


def model_id_of(session_id: str, model_seq_id: int) -> str:
    """The SDK builds this id itself for create-from-state, so every run is named this way."""
    return f"{session_id}:train:{model_seq_id}"


async def ordered(
    gq: GatewayQueue,
    tenant: str,
    model_id: str,
    seq_id: int,
    kind: OpKind,
    payload: Callable[[], bytes],
    check: Callable[[], Awaitable[object]] | None = None,
) -> dict[str, Any]:
    """Enqueue a training call in seq_id order, after `check` (what the body needs looked up).
    A body refused here (400) still uses its seq_id, or every later call of the model would
    wait for it."""
    if seq_id > MAX_SEQ_ID:
        raise UserInputError(f"seq_id: must be at most {MAX_SEQ_ID}, got {seq_id}")
    await gq.model_of(model_id, tenant)
    try:
        if check is not None:
            await check()
        body = await asyncio.to_thread(payload)  # converting a big batch takes a while
    except Exception:
        # Any refusal, a bug's included: the model's later calls must not wait for this one.
        await gq.refuse_in_order(model_id, seq_id)
        raise
    job_id = await gq.submit_in_order(model_id, seq_id, kind, body)
    return {"request_id": job_id, "model_id": model_id}


@router.post("/create_model")
async def create_model(body: CreateModelRequest, gq: QueueDep, tenant: TenantDep) -> dict[str, Any]:
    session_id = await gq.session_of(body.session_id, tenant)
    optimizer = (body.optimizer_config or {}).get("type", Optimizer.ADAMW.value)
    if optimizer not in set(Optimizer):
        raise UserInputError(
            f"optimizer_config.type: {optimizer!r} is not supported; "
            f"choose one of {[o.value for o in Optimizer]}"
        )
    check_base_model(body.base_model)  # before it reaches Redis, the registry or a record
    await gq.registry.check_served(
        body.base_model, allow_unserved=gq.settings.queue_unserved_base_models
    )
    model_id = model_id_of(session_id, body.model_seq_id)
    job_id = await runs.open_training_run(
        gq.jobs,
        gq.submit,
        model_id,
        base_model=body.base_model,
        tenant_id=tenant,
        session_id=session_id,
        user_metadata=body.user_metadata,
        config=body.lora_config.model_copy(update={"optimizer": Optimizer(optimizer)}),
    )
    return {"request_id": job_id, "model_id": model_id}


@router.post("/get_info")
async def get_info(body: ModelRequest, gq: QueueDep, tenant: TenantDep) -> dict[str, Any]:
    info = await gq.model_of(body.model_id, tenant)
    base = info["base_model"]
    tokenizer = served_base(base)  # a :peft:<tokens> name's tokenizer is its base model's
    if is_builtin(tokenizer):
        # Built-in models exist only where the service runs: point the SDK's
        # AutoTokenizer at the local files (works where client and service share a disk).
        tokenizer = str(
            await asyncio.to_thread(ensure_tokenizer, tokenizer, gq.settings.models_dir)
        )
    return {
        "model_id": body.model_id,
        "is_lora": True,
        "model_name": base,
        "lora_rank": info["lora_config"].get("rank"),
        "type": "get_info",
        "user_metadata": info["user_metadata"],
        "optimizer_config": OPTIMIZER_CONFIGS[
            Optimizer(info["lora_config"].get("optimizer", Optimizer.ADAMW))
        ],
        "model_data": {"arch": "causal_lm", "model_name": base, "tokenizer_id": tokenizer},
    }


@router.post("/forward_backward")
async def forward_backward(request: Request, gq: QueueDep, tenant: TenantDep) -> dict[str, Any]:
    """Protobuf (SDK 0.38; forward_only for forward; zstd-compressed with
    proto_compress_fwdbwd) or the older JSON form."""
    if "json" in request.headers.get("content-type", ""):
        return await json_forward_backward(await json_body(request), gq, tenant)
    raw = await request_body(request, gq.limits)
    parsed = await off_loop(lambda: parse_forward_backward(raw, gq.limits), len(raw))
    if parsed.seq_id < 1:
        raise UserInputError(f"seq_id: must be >= 1, got {parsed.seq_id}")
    kind = OpKind.FORWARD if parsed.forward_only else OpKind.FORWARD_BACKWARD
    limits = gq.limits
    try:  # a custom loss named by loss_id (a bad one is refused in the model's order)
        custom = await custom_loss_for(request, tenant, parsed.model_id, parsed.loss_id)
    except UserInputError as exc:
        refused: UserInputError | None = exc
    else:
        refused = None

    def batch() -> ForwardBackwardInput:
        if refused is not None:
            raise refused
        return parsed.batch(limits, custom)

    return await ordered(
        gq, tenant, parsed.model_id, parsed.seq_id, kind, lambda: batch_payload(batch, limits)
    )


@router.post("/forward")
async def forward(request: Request, gq: QueueDep, tenant: TenantDep) -> dict[str, Any]:
    """The older JSON form of forward."""
    return await json_forward_backward(await json_body(request), gq, tenant)


async def json_body(request: Request) -> Any:
    """The request's JSON; a body that is not JSON is the caller's error (400), not ours."""
    raw = await request.body()
    try:
        return await off_loop(lambda: json.loads(raw), len(raw))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, deep nesting
        raise UserInputError(f"body: not valid JSON ({type(exc).__name__}: {exc})") from None


async def json_forward_backward(raw: Any, gq: GatewayQueue, tenant: str) -> dict[str, Any]:
    body = validated(JsonForwardBackwardRequest, "", raw)
    field = "forward_input" if body.forward_input is not None else "forward_backward_input"
    kind = OpKind.FORWARD if body.forward_input is not None else OpKind.FORWARD_BACKWARD
    limits = gq.limits
    return await ordered(
        gq,
        tenant,
        body.model_id,
        body.seq_id,
        kind,
        lambda: batch_payload(
            lambda: validated(ForwardBackwardInput, field, getattr(body, field)), limits
        ),
    )


def batch_payload(batch: Callable[[], ForwardBackwardInput], limits: RequestLimits) -> bytes:
    checked = batch()
    check_batch_size(checked, limits)
    check_batch(checked)
    return encode_request(checked.model_dump(), limits)


@router.post("/optim_step")
async def optim_step(body: OptimStepRequest, gq: QueueDep, tenant: TenantDep) -> dict[str, Any]:
    def payload() -> bytes:
        """AdamParams (adam_params) or DimuonParams (optimizer_params of type dimuon); the
        worker checks it is the run's optimizer's."""
        params: AdamParams | DimuonParams
        if body.adam_params is not None:
            params = validated(AdamParams, "adam_params", body.adam_params)
        elif (body.optimizer_params or {}).get("type") == Optimizer.DIMUON:
            params = validated(DimuonParams, "optimizer_params", body.optimizer_params)
        else:
            kind = (body.optimizer_params or {}).get("type")
            raise UserInputError(
                f"optimizer_params: {kind!r} is not supported; send "
                "adam_params, or optimizer_params of type 'dimuon'"
            )
        return encode_request(params.model_dump(mode="json"), gq.limits)

    return await ordered(gq, tenant, body.model_id, body.seq_id, OpKind.OPTIM_STEP, payload)


def save_payload(
    body: SaveWeightsRequest, name: str, ttl: int | None, *, ephemeral: bool = False
) -> Callable[[], bytes]:
    def payload() -> bytes:
        if body.overwrite:
            raise UserInputError(
                "overwrite: not supported; checkpoints are never overwritten, save under a new name"
            )
        fields = {"name": check_name(name, "path"), "ttl_seconds": ttl, "ephemeral": ephemeral}
        return codec.encode(validated(SaveInput, "", fields).model_dump())

    return payload


@router.post("/save_weights")
async def save_weights(body: SaveWeightsRequest, gq: QueueDep, tenant: TenantDep) -> dict[str, Any]:
    """save_state: weights and optimizer state at tinker://<model>/weights/<path>."""
    return await ordered(
        gq,
        tenant,
        body.model_id,
        body.seq_id,
        OpKind.SAVE_STATE,
        save_payload(body, body.path or "", body.ttl_seconds),
    )


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(
    body: SaveWeightsRequest, gq: QueueDep, tenant: TenantDep
) -> dict[str, Any]:
    """Named: weights at tinker://<model>/sampler_weights/<path>. Without a path: an
    ephemeral checkpoint that becomes a sampling session when it is done; with
    kind="inflight", one that follows the run's inflight weights (queue/ops/inflight.py)."""
    if body.path is not None:
        return await ordered(
            gq,
            tenant,
            body.model_id,
            body.seq_id,
            OpKind.SAVE_WEIGHTS_FOR_SAMPLER,
            save_payload(body, body.path, body.ttl_seconds),
        )
    inflight = body.kind == "inflight"
    name = f"{'inflight' if inflight else 'ephemeral'}-s{body.seq_id}"
    submitted = await ordered(
        gq,
        tenant,
        body.model_id,
        body.seq_id,
        OpKind.SAVE_WEIGHTS_FOR_SAMPLER,
        save_payload(body, name, gq.settings.ephemeral_sampler_ttl_s, ephemeral=True),
    )
    sampler_id = f"{body.model_id}:sample:s{body.seq_id}"
    reply = {"sampling_session_id": sampler_id}
    if inflight:
        reply["inflight_of"] = body.model_id
    await gq.set_reply(submitted["request_id"], reply)
    return submitted


@router.post("/save_weights_external")
async def save_weights_external(
    body: SaveWeightsExternalRequest, gq: QueueDep, tenant: TenantDep
) -> dict[str, Any]:
    """The PEFT files at tinker://<model>/external_weights/<path>, age-encrypted to the
    recipients when given; downloaded through get_external_weights_urls (downloads.py)."""

    def payload() -> bytes:
        save = validated(
            SaveInput,
            "",
            {
                "name": check_name(body.path, "path"),
                "ttl_seconds": body.ttl_seconds,
                "age_encryption_recipients": check_recipients(body.age_encryption_recipients),
            },
        )
        return codec.encode(save.model_dump())

    return await ordered(
        gq, tenant, body.model_id, body.seq_id, OpKind.SAVE_WEIGHTS_EXTERNAL, payload
    )


async def check_checkpoint(request: Request, gq: GatewayQueue, tenant: str, path: str) -> None:
    """A checkpoint to load must exist (and be the tenant's, or published): refused now (400),
    not in the op's future. Its record may still be on its way to Postgres: caught up first."""
    sessions = request.app.state.sessions
    await gq.recorded()
    parsed = loadable(CheckpointPath.parse(path))
    if await queries.get_readable_checkpoint(sessions, tenant, str(parsed)) is None:
        raise UserInputError(f"path: no checkpoint {path} (unknown, expired or deleted)")


@router.post("/load_weights")
async def load_weights(
    body: LoadWeightsRequest, request: Request, gq: QueueDep, tenant: TenantDep
) -> dict[str, Any]:
    if body.model_id is not None:
        if body.seq_id is None:
            raise UserInputError("seq_id: required with model_id")
        model_id = body.model_id

        async def check() -> None:  # the path, as create-from-path checks it
            await runs.checked_load(
                gq.jobs, body.path, body.optimizer, into=model_id, tenant_id=tenant
            )
            if CheckpointPath.parse(body.path).run_id != model_id:  # else a save may be queued
                await check_checkpoint(request, gq, tenant, body.path)

        def payload() -> bytes:
            return codec.encode(LoadInput(path=body.path, optimizer=body.optimizer).model_dump())

        return await ordered(gq, tenant, model_id, body.seq_id, OpKind.LOAD_STATE, payload, check)
    if body.session_id is None or body.model_seq_id is None:
        raise UserInputError(
            "model_id, session_id: send model_id + seq_id to load into a "
            "model, or session_id + model_seq_id to create one from path"
        )
    session_id = await gq.session_of(body.session_id, tenant)
    model_id = model_id_of(session_id, body.model_seq_id)
    await check_checkpoint(request, gq, tenant, body.path)
    job_id = await runs.open_training_run_from_state(
        gq.jobs,
        gq.submit,
        model_id,
        body.path,
        tenant_id=tenant,
        session_id=session_id,
        optimizer=body.optimizer,
        base_model=body.base_model,
        user_metadata=body.user_metadata,
    )
    return {"request_id": job_id, "model_id": model_id}
