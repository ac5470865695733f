"""Tinker's OpenAI-compatible inference: `POST /oai/api/v1/completions` and
`/oai/api/v1/chat/completions`, so evaluation tools and the `openai` client can sample from a
base model or a trained checkpoint (docs/tinker-http-protocol.md, section 13).

`model` is a base model name or a `tinker://<run>/sampler_weights/<name>` (or `/weights/`)
path of the caller's; the API key comes as `Authorization: Bearer tml-...` or `X-API-Key`. A
request becomes one sample op on a sampling session of the caller's for that model (opened on
first use), so it runs through the same queue and sampler as the SDK's samples. Chat messages go
through the tokenizer's chat template. No streaming: each answer is one JSON object.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from queue_tinker.builtin_models import load_tokenizer
from queue_tinker.errors import UserInputError
from queue_tinker.gateway.auth import caller_of_key
from queue_tinker.gateway.queue_access import GatewayQueue, QueueDep
from queue_tinker.queue.ops import runs
from queue_tinker.types import JobStatus, OpKind, codec
from queue_tinker.types.model_names import parse_model_name, served_base
from queue_tinker.types.requests.request_limits import encode_request
from queue_tinker.types.requests.sampling import SampleResponse, sample_input
from queue_tinker.types.service.checkpoints import SCHEME

RESULT_WAIT_S = 600.0  # the openai client's own default timeout
DEFAULT_MAX_TOKENS = 16  # OpenAI's completions default

router = APIRouter(prefix="/oai/api/v1")


async def key_tenant(request: Request) -> str:
    """The tenant of the API key, sent as a bearer token (what the openai client sends) or as
    `X-API-Key` (what every other route of the gateway takes)."""
    scheme, _, bearer = request.headers.get("Authorization", "").partition(" ")
    key = bearer.strip() if scheme.lower() == "bearer" else ""
    key = key or request.headers.get("X-API-Key", "").strip()
    if not key:
        raise HTTPException(
            401,
            "missing API key: send it as Authorization: Bearer tml-... (the openai client does) "
            "or as X-API-Key: tml-...",
        )
    return (await caller_of_key(request, key)).tenant_id


KeyTenant = Annotated[str, Depends(key_tenant)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, gt=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False


class CompletionRequest(_Body):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str


class ChatRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)


def openai_error(exc: UserInputError) -> JSONResponse:
    """Bad input in OpenAI's error shape, so the openai client shows the message."""
    return JSONResponse(
        {
            "error": {
                "message": exc.message,
                "type": "invalid_request_error",
                "param": exc.message.split(":", 1)[0],
                "code": None,
            }
        },
        status_code=400,
    )


@router.post("/completions")
async def completions(body: CompletionRequest, gq: QueueDep, tenant: KeyTenant) -> Any:
    try:
        return await _completions(body, gq, tenant)
    except UserInputError as exc:
        return openai_error(exc)


@router.post("/chat/completions")
async def chat_completions(body: ChatRequest, gq: QueueDep, tenant: KeyTenant) -> Any:
    try:
        return await _chat_completions(body, gq, tenant)
    except UserInputError as exc:
        return openai_error(exc)


async def _completions(body: CompletionRequest, gq: GatewayQueue, tenant: str) -> dict[str, Any]:
    base, path = await _target(gq, tenant, body.model)
    tokenizer = await _tokenizer(gq, base)
    prompt = (
        body.prompt
        if isinstance(body.prompt, list)
        else tokenizer.encode(body.prompt, add_special_tokens=False)
    )
    response = await _sample(gq, tenant, body, base, path, prompt)
    choices = [
        {
            "index": i,
            "text": tokenizer.decode(s.tokens, skip_special_tokens=True),
            "finish_reason": s.stop_reason,
            "logprobs": None,
        }
        for i, s in enumerate(response.sequences)
    ]
    return _answer("text_completion", body.model, choices, len(prompt), response)


async def _chat_completions(body: ChatRequest, gq: GatewayQueue, tenant: str) -> dict[str, Any]:
    base, path = await _target(gq, tenant, body.model)
    tokenizer = await _tokenizer(gq, base)
    if not getattr(tokenizer, "chat_template", None):
        raise UserInputError(
            f"model: {base}'s tokenizer has no chat template; use /completions with a prompt"
        )
    text = tokenizer.apply_chat_template(
        [m.model_dump() for m in body.messages], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer.encode(text, add_special_tokens=False)
    response = await _sample(gq, tenant, body, base, path, prompt)
    choices = [
        {
            "index": i,
            "finish_reason": s.stop_reason,
            "logprobs": None,
            "message": {
                "role": "assistant",
                "content": tokenizer.decode(s.tokens, skip_special_tokens=True),
            },
        }
        for i, s in enumerate(response.sequences)
    ]
    return _answer("chat.completion", body.model, choices, len(prompt), response)


def _answer(
    kind: str,
    model: str,
    choices: list[dict[str, Any]],
    prompt_tokens: int,
    response: SampleResponse,
) -> dict[str, Any]:
    completion_tokens = sum(len(s.tokens) for s in response.sequences)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


async def _target(gq: GatewayQueue, tenant: str, model: str) -> tuple[str, str | None]:
    """(base model, checkpoint path or None) of a request's `model`."""
    path = model if model.startswith(SCHEME) else None
    try:
        base = await runs.sampling_base_model(gq.jobs, tenant, path, None if path else model)
    except UserInputError as exc:
        raise UserInputError("model: " + exc.message.split(": ", 1)[-1]) from None
    return base, path


async def _tokenizer(gq: GatewayQueue, base: str) -> Any:
    return await asyncio.to_thread(load_tokenizer, served_base(base), gq.settings.models_dir)


async def _sample(
    gq: GatewayQueue, tenant: str, body: _Body, base: str, path: str | None, prompt: list[int]
) -> SampleResponse:
    """One sample op on the tenant's sampling session for this model; its result."""
    if body.stream:
        raise UserInputError("stream: not supported; send stream: false")
    sampler_id = await _sampler(gq, tenant, base, path)
    params = {
        "max_tokens": body.max_tokens or DEFAULT_MAX_TOKENS,
        "seed": body.seed,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stop": body.stop,
    }
    sample = sample_input(
        {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
        body.n,
        params,
        False,
        path,
        limits=gq.limits,
        context_cap=parse_model_name(base).context_cap,
    )
    job_id = await gq.submit(
        sampler_id, OpKind.SAMPLE, encode_request(sample.model_dump(), gq.limits), None
    )
    try:
        outcome = await asyncio.wait_for(gq.results.wait(job_id, sampler_id), RESULT_WAIT_S)
    except TimeoutError:
        raise HTTPException(
            504,
            f"request {job_id}: no result within {RESULT_WAIT_S:.0f} s "
            "(is a worker serving this base model?)",
        ) from None
    if outcome.status is JobStatus.FAILED:
        raise UserInputError(f"model: sampling failed: {outcome.error}")
    return SampleResponse.model_validate(codec.decode(outcome.result))


async def _sampler(gq: GatewayQueue, tenant: str, base: str, path: str | None) -> str:
    """The tenant's sampling session for (base, path): one per model, opened once (a repeat
    open finds it: its create op carries a fixed idempotency key)."""
    digest = hashlib.sha256(f"{tenant}\0{base}\0{path or ''}".encode()).hexdigest()[:24]
    sampler_id = f"oai-{digest}:sample:0"
    if await gq.jobs.tenant_model(sampler_id, tenant, "sampling") is None:
        await runs.open_sampling_session(
            gq.jobs,
            gq.submit,
            sampler_id,
            base_model=base,
            tenant_id=tenant,
            session_id=None,
            model_path=path,
        )
    return sampler_id
