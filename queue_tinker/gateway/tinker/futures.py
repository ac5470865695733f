"""retrieve_future (docs/tinker-http-protocol.md, section 4): a long-poll for a request's
result. The SDK polls again at once after `try_again`, so the gateway holds each call open
until the result is published or about QT_LONG_POLL_S has passed, and says why the request
still waits (queue_state)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import APIRouter, Request, Response

from queue_tinker.errors import ErrorCategory
from queue_tinker.gateway.auth import TenantDep
from queue_tinker.gateway.off_loop import OffLoopRoute
from queue_tinker.gateway.proto.convert import (
    PROTOBUF_MEDIA_TYPE,
    encode_forward_backward_output,
    encode_sample_response,
)
from queue_tinker.gateway.queue_access import GatewayQueue, QueueDep, not_found
from queue_tinker.gateway.responses import GatewayJSONResponse as JSONResponse
from queue_tinker.gateway.tinker.bodies import RetrieveFutureRequest
from queue_tinker.gateway.tinker.custom_loss import GATEWAY_ANSWERED
from queue_tinker.queue.ops import runs
from queue_tinker.queue.ops.jobs import JobOutcome
from queue_tinker.queue.results.state import queue_state
from queue_tinker.settings import Settings
from queue_tinker.types import JobStatus, OpKind, QueueState, codec
from queue_tinker.types.requests.sampling import SampleResponse
from queue_tinker.types.requests.training import ForwardBackwardOutput

log = logging.getLogger(__name__)

READ_TIMEOUT_MARGIN_S = 5.0  # answer this long before the client's own read timeout
RESULT_TYPES = {
    OpKind.CREATE_MODEL: "create_model",
    OpKind.SAVE_STATE: "save_weights",
    OpKind.SAVE_WEIGHTS_FOR_SAMPLER: "save_weights_for_sampler",
    OpKind.SAVE_WEIGHTS_EXTERNAL: "save_weights_external",
    OpKind.LOAD_STATE: "load_weights",
}


router = APIRouter(prefix="/api/v1", route_class=OffLoopRoute)


def poll_budget(request: Request, settings: Settings) -> float:
    try:
        client_timeout = float(request.headers.get("X-Stainless-Read-Timeout", "inf"))
    except ValueError:
        client_timeout = float("inf")
    return max(0.5, min(settings.long_poll_s, client_timeout - READ_TIMEOUT_MARGIN_S))


@router.post("/retrieve_future")
async def retrieve_future(
    body: RetrieveFutureRequest, request: Request, gq: QueueDep, tenant: TenantDep
) -> Response:
    job, outcome = await gq.jobs.job(body.request_id)
    if not job or job.get("tenant_id") != tenant:
        raise not_found(f"request_id {body.request_id!r}")
    if outcome is None:  # not finished yet: wait for its publish
        model_id = job["model_id"]
        settings = gq.settings
        budget = poll_budget(request, settings)
        held_since = None if "seq" in job else float(job["queued_at"])
        if held_since is not None:
            budget = min(budget, max(0.1, held_since + settings.seq_gap_timeout_s - time.time()))
        try:
            outcome = await asyncio.wait_for(gq.results.wait(body.request_id, model_id), budget)
        except TimeoutError:
            return await still_waiting(gq, body.request_id, model_id, held_since)
    protobuf = PROTOBUF_MEDIA_TYPE in request.headers.get("accept", "")
    return await answer(gq, job, outcome, protobuf=protobuf)


async def still_waiting(
    gq: GatewayQueue, request_id: str, model_id: str, held_since: float | None
) -> JSONResponse:
    settings = gq.settings
    state, reason = await queue_state(
        gq.redis, gq.keys, gq.registry, model_id, settings.lease_ttl_ms * 3
    )
    if held_since is not None and state is QueueState.ACTIVE:
        waiting_for = int(await gq.redis.hget(gq.keys.model_meta(model_id), "next_seq_id") or 1)
        reason = f"waiting for seq_id {waiting_for} of model {model_id}, sent after it"
        if time.time() - held_since >= settings.seq_gap_timeout_s:
            skipped = await gq.jobs.skip_seq_gap(model_id)
            log.warning(
                "model %s: seq_ids from %s never arrived in %.0fs; resumed at %s",
                model_id,
                *(skipped or ("?", "?")),
                settings.seq_gap_timeout_s,
            )
    return JSONResponse(
        {
            "type": "try_again",
            "request_id": request_id,
            "queue_state": state.value,
            "queue_state_reason": reason,
        }
    )


async def answer(
    gq: GatewayQueue, job: dict[str, str], outcome: JobOutcome, *, protobuf: bool
) -> Response:
    """The result as the protocol has it: forward/backward and sample results in protobuf
    when the client accepts it (SDK 0.38 does), JSON otherwise (older clients)."""
    if outcome.status is JobStatus.FAILED:
        category = outcome.error_category or ErrorCategory.SERVER.value
        return JSONResponse({"error": outcome.error, "category": category})
    if job["kind"] == GATEWAY_ANSWERED:  # create_custom_loss: answered as it was stored
        return JSONResponse(codec.decode(outcome.result))
    kind = OpKind(job["kind"])
    if kind in (OpKind.FORWARD, OpKind.FORWARD_BACKWARD):
        return _forward_backward_answer(outcome, protobuf=protobuf)
    # Only these kinds are answered beyond what their kind says (gq.set_reply).
    replied = kind in (OpKind.SAMPLE, OpKind.SAVE_WEIGHTS_FOR_SAMPLER)
    reply = await gq.reply(outcome.job_id) if replied else {}
    if kind is OpKind.SAMPLE:
        last_n = reply.get("prompt_logprobs_last_n")
        return _sample_answer(outcome, last_n, protobuf=protobuf)
    return await _result_answer(gq, job, kind, outcome, reply)


def _forward_backward_answer(outcome: JobOutcome, *, protobuf: bool) -> Response:
    output = ForwardBackwardOutput.model_validate(codec.decode(outcome.result))
    if not protobuf:
        return JSONResponse(output.model_dump(mode="json"))
    return Response(encode_forward_backward_output(output), media_type=PROTOBUF_MEDIA_TYPE)


def _sample_answer(outcome: JobOutcome, last_n: int | None, *, protobuf: bool) -> Response:
    response = SampleResponse.model_validate(codec.decode(outcome.result))
    if not protobuf:
        return JSONResponse(json_sample_response(response, last_n))
    return Response(
        encode_sample_response(response, prompt_logprobs_last_n=last_n),
        media_type=PROTOBUF_MEDIA_TYPE,
    )


async def _result_answer(
    gq: GatewayQueue, job: dict[str, str], kind: OpKind, outcome: JobOutcome, reply: dict[str, Any]
) -> Response:
    """Any other kind's result, as JSON with its type and model; an ephemeral save opens the
    sampler it was saved for."""
    result: dict[str, Any] = codec.decode(outcome.result) or {}
    if "sampling_session_id" in reply:  # an ephemeral save: sample from it next
        return JSONResponse(
            await open_ephemeral_sampler(
                gq, job, result["path"], reply["sampling_session_id"], reply.get("inflight_of")
            )
        )
    if kind in RESULT_TYPES:
        result = {**result, "type": RESULT_TYPES[kind], "model_id": job["model_id"]}
    return JSONResponse(result)


def json_sample_response(response: SampleResponse, last_n: int | None) -> dict[str, Any]:
    """The JSON form; prompt logprobs not computed (before the last N) are null."""
    body = response.model_dump(mode="json")
    logprobs = body.get("prompt_logprobs")
    if logprobs is not None and last_n is not None:
        body["prompt_logprobs"] = [None] * max(0, len(logprobs) - last_n) + logprobs[-last_n:]
    return body


async def open_ephemeral_sampler(
    gq: GatewayQueue, job: dict[str, str], path: str, sampler_id: str, inflight_of: str | None
) -> dict[str, Any]:
    """The sampling session a save without a name opens. An inflight save first moves its
    run's inflight weights to it, so the save is answered once every inflight session of
    the run samples from it (or from a newer one)."""
    info = await gq.jobs.model_info(job["model_id"])
    if inflight_of is not None:
        await gq.inflight.publish(inflight_of, int(job["seq"]), path)
    await runs.open_sampling_session(
        gq.jobs,
        gq.submit,
        sampler_id,
        base_model=info["base_model"],
        tenant_id=job["tenant_id"],
        session_id=None,
        model_path=path,
        inflight_of=inflight_of,
    )
    return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}
