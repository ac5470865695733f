"""The Tinker protocol's sampling calls (docs/tinker-http-protocol.md, section 6): sampling
sessions and asample. Samples need no mutual order; each (session, seq_id) runs once."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends

from queue_tinker.errors import UserInputError
from queue_tinker.gateway.auth import TenantDep
from queue_tinker.gateway.off_loop import OffLoopRoute
from queue_tinker.gateway.queue_access import QueueDep
from queue_tinker.gateway.tinker.bodies import CreateSamplingSessionRequest, SampleRequest
from queue_tinker.gateway.tinker.sample_futures import Wakeups, note_sample, sample_wakeups
from queue_tinker.queue.control import silent_sessions
from queue_tinker.queue.ops import runs
from queue_tinker.queue.ops.sessions import SESSION_TTL_S
from queue_tinker.types import JobStatus, OpKind
from queue_tinker.types.model_names import parse_model_name
from queue_tinker.types.requests.request_limits import RequestLimits, check_tokens, encode_request
from queue_tinker.types.requests.sampling import MAX_PROMPT_TOPK, NO_TARGET, sample_input

# create_sampling_session answers synchronously; it waits this long for a worker to check the
# weights, so a bad path fails here. With no worker up it answers anyway, and the samples wait.
CREATE_CHECK_S = 20.0


router = APIRouter(prefix="/api/v1", route_class=OffLoopRoute)


@router.post("/create_sampling_session")
async def create_sampling_session(
    body: CreateSamplingSessionRequest, gq: QueueDep, tenant: TenantDep
) -> dict[str, Any]:
    session_id = await gq.session_of(body.session_id, tenant)
    sampler_id = f"{session_id}:sample:{body.sampling_session_seq_id}"
    base = await runs.sampling_base_model(gq.jobs, tenant, body.model_path, body.base_model)
    job_id = await runs.open_sampling_session(
        gq.jobs,
        gq.submit,
        sampler_id,
        base_model=base,
        tenant_id=tenant,
        session_id=session_id,
        model_path=body.model_path,
    )
    await silent_sessions.note_sampler(gq.redis, gq.keys, session_id, sampler_id, SESSION_TTL_S)
    with contextlib.suppress(TimeoutError):
        outcome = await asyncio.wait_for(gq.results.wait(job_id, sampler_id), CREATE_CHECK_S)
        if outcome.status is JobStatus.FAILED:
            raise UserInputError(outcome.error)
    return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}


def target_ids(raw: dict[str, Any], limits: RequestLimits) -> list[list[int]]:
    """target_prompt_logprobs as the SDK sends it (TensorData JSON: int64, shape [rows, K],
    dense or sparse CSR whose unlisted cells ask for nothing) as dense rows of ids."""
    field = "target_prompt_logprobs"
    shape, data = raw.get("shape"), raw.get("data")
    if raw.get("dtype") != "int64" or not isinstance(data, list):
        raise UserInputError(f"{field}: must be an int64 tensor of token ids")
    if (
        not isinstance(shape, list)
        or len(shape) != 2
        or not all(isinstance(d, int) and d >= 0 for d in shape)
    ):
        raise UserInputError(f"{field}: shape must be [len(prompt) - 1, K], got {shape!r}")
    rows, cols = shape
    check_tokens(f"{field}: shape {shape} has too many rows", rows, limits, what="positions")
    if cols > MAX_PROMPT_TOPK:
        raise UserInputError(f"{field}: at most {MAX_PROMPT_TOPK} ids per position, got {cols}")
    crow, col = raw.get("sparse_crow_indices"), raw.get("sparse_col_indices")
    try:
        if crow is None:
            return np.asarray(data, dtype=np.int64).reshape(rows, cols).tolist()
        dense = np.full((rows, cols), NO_TARGET, dtype=np.int64)
        # The offsets apart: given asarray() inline, numpy's stubs pick diff's timedelta64
        # overload, which repeat() refuses.
        offsets = np.asarray(crow, dtype=np.int64)
        row_of = np.repeat(np.arange(rows), np.diff(offsets))
        dense[row_of, np.asarray(col, dtype=np.int64)] = np.asarray(data, dtype=np.int64)
        return dense.tolist()
    except (ValueError, IndexError, TypeError) as err:
        raise UserInputError(f"{field}: data does not fit shape {shape}: {err}") from None


@router.post("/asample")
async def asample(
    body: SampleRequest,
    gq: QueueDep,
    tenant: TenantDep,
    wakeups: Annotated[Wakeups, Depends(sample_wakeups)],
) -> dict[str, Any]:
    info = await gq.model_of(body.sampling_session_id, tenant, kind="sampling")
    limits = gq.limits
    weights = await runs.sample_weights(gq.inflight, info)

    def payload() -> bytes:
        targets = (
            target_ids(body.target_prompt_logprobs, limits)
            if body.target_prompt_logprobs is not None
            else None
        )
        sample = sample_input(
            body.prompt,
            body.num_samples,
            body.sampling_params,
            body.prompt_logprobs or body.prompt_logprobs_last_n is not None,
            weights,
            limits=limits,
            topk_prompt_logprobs=body.topk_prompt_logprobs,
            target_prompt_logprobs=targets,
            topk_sample_logprobs=body.topk_sample_logprobs,
            prompt_alt_tokens_k=body.prompt_alt_tokens_k,
            inflight_of=info["inflight_of"],
            context_cap=parse_model_name(info["base_model"]).context_cap,
        )
        return encode_request(sample.model_dump(), limits)

    # A prompt of millions of tokens takes seconds to check and encode: not on the loop.
    job_id = await gq.submit(
        body.sampling_session_id,
        OpKind.SAMPLE,
        await asyncio.to_thread(payload),
        f"seq:{body.seq_id}",
    )
    if body.prompt_logprobs_last_n is not None:
        await gq.set_reply(job_id, {"prompt_logprobs_last_n": body.prompt_logprobs_last_n})
    await note_sample(gq, wakeups, body.sampling_session_id, body.seq_id, job_id)
    return {
        "request_id": job_id,
        "sample_sequence_ids": [f"{job_id}:{i}" for i in range(body.num_samples)],
    }
