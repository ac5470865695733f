"""Sampling requests and results, shaped as in Tinker (field names and defaults match)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from queue_tinker.errors import UserInputError
from queue_tinker.types.requests.images import check_model_input_images
from queue_tinker.types.requests.loss_inputs import ModelLimits, check_token_ids
from queue_tinker.types.requests.request_limits import RequestLimits, check_tokens
from queue_tinker.types.requests.training import Seed
from queue_tinker.types.tensors import ModelInput
from queue_tinker.types.validation import validated

MAX_STOP_SEQUENCES = 32
MAX_PROMPT_TOPK = 1024  # most top-k logprobs (and target ids) per prompt position
MAX_SAMPLE_TOPK = 1024  # most top-k logprobs per generated token
MAX_PROMPT_ALT_TOKENS = 1024  # most alternative draws per prompt position
NO_TARGET = -1  # a target_prompt_logprobs cell that asks for nothing

StopReason = Literal["length", "stop"]


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())


class SamplingParams(_Wire):
    """How to generate. `stop=None` stops at the tokenizer's EOS; `stop=[]` never stops early;
    strings stop once the generated text contains one (EOS still stops too); ints stop on
    those token ids instead of EOS."""

    max_tokens: int | None = Field(None, gt=0)  # None: up to the model's context length
    seed: Seed | None = None  # same seed, same prompt, same weights: the same samples
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(1.0, ge=0)  # 0: greedy (argmax)
    top_k: int = Field(-1, ge=-1)  # -1: off
    top_p: float = Field(1.0, gt=0, le=1)

    @field_validator("temperature", "top_p")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k_not_zero(cls, value: int) -> int:
        if value == 0:
            raise ValueError("must be -1 (off) or a positive number of tokens, not 0")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_sequences(cls, value: str | list[str] | list[int] | None) -> object:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stops)}")
        for stop in stops:
            if isinstance(stop, str) and not stop:
                raise ValueError("stop strings must not be empty")
            if isinstance(stop, int) and stop < 0:
                raise ValueError(f"stop token ids must be >= 0, got {stop}")
        return value

    @property
    def stop_strings(self) -> list[str]:
        if isinstance(self.stop, str):
            return [self.stop]
        return [s for s in self.stop or [] if isinstance(s, str)]

    @property
    def stop_token_ids(self) -> list[int]:
        if isinstance(self.stop, str):
            return []
        return [s for s in self.stop or [] if isinstance(s, int)]

    def ending_token_ids(self, eos_token_ids: Sequence[int]) -> list[int]:
        """The token ids that end a sequence, given the tokenizer's EOS ids."""
        if self.stop is None or (self.stop_strings and not self.stop_token_ids):
            return list(eos_token_ids)
        return self.stop_token_ids


class SampleInput(_Wire):
    """The body of one sample op."""

    prompt: ModelInput
    num_samples: int = Field(1, ge=1)  # at most QT_MAX_SAMPLES_PER_REQUEST (request_limits)
    sampling_params: SamplingParams
    prompt_logprobs: bool = False
    # The k most likely tokens and their logprobs at each prompt position after the first.
    topk_prompt_logprobs: int = Field(0, ge=0, le=MAX_PROMPT_TOPK)
    # Token ids to score at each prompt position after the first: [len(prompt) - 1][K],
    # NO_TARGET for a cell that asks for nothing.
    target_prompt_logprobs: list[list[int]] | None = None
    # The k most likely tokens and their logprobs at each generated position.
    topk_sample_logprobs: int = Field(0, ge=0, le=MAX_SAMPLE_TOPK)
    # k independent draws at the request's temperature from the model's distribution at each
    # prompt position after the first (alternatives to the prompt's own tokens).
    prompt_alt_tokens_k: int = Field(0, ge=0, le=MAX_PROMPT_ALT_TOKENS)
    # The weights to sample from: a tinker:// checkpoint path, or None for the base model.
    # Every op carries it, so any worker can run it without the session's history.
    model_path: str | None = None
    # The training run whose inflight weights the session follows (queue/ops/inflight.py):
    # model_path is their newest save when the op was sent, and the worker moves the op to
    # any newer one while it runs. None: model_path is fixed.
    inflight_of: str | None = None
    # The :peft:<tokens> cap of the session's base model name (None: the model's context):
    # set by the door that read the session, so any worker holds the op to it.
    context_cap: int | None = Field(None, ge=1)

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value: ModelInput) -> ModelInput:
        if value.length == 0:
            raise ValueError("must hold at least one token")
        return value


class CreateSamplingSessionInput(_Wire):
    """The body of a create_sampling_session op: the worker checks the weights exist, belong to
    the tenant and fit its base model before the client is handed back."""

    tenant_id: str
    base_model: str
    model_path: str | None = None


class SampledSequence(_Wire):
    stop_reason: StopReason
    tokens: list[int]
    logprobs: list[float]  # of each generated token under the model (no temperature)
    # When asked for: at each generated position, the k most likely (token id, logprob)
    # pairs under the model, most likely first.
    topk_logprobs: list[list[tuple[int, float]]] | None = None


class PromptAltTokens(_Wire):
    """prompt_alt_tokens_k draws at each prompt position after the first: row i holds k token
    ids drawn (with replacement, at the request's temperature) from the model's distribution
    over prompt token i + 1, and their logprobs under the model."""

    tokens: list[list[int]]
    logprobs: list[list[float]]


class SampleResponse(_Wire):
    sequences: list[SampledSequence]
    # One per prompt token when asked for; None at position 0 (nothing precedes it).
    prompt_logprobs: list[float | None] | None = None
    # Per prompt token, the top-k (token id, logprob) pairs, most likely first; None at 0.
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    # The logprob of each requested target id (same layout as the request; 0.0 at NO_TARGET).
    target_prompt_logprobs: list[list[float]] | None = None
    prompt_alt_tokens: PromptAltTokens | None = None
    # Prompt tokens this request did not run through the model: their key / value states came
    # from the worker's prefix cache (or an identical prompt prefilled with it).
    prompt_cache_hit_tokens: int = 0
    type: Literal["sample"] = "sample"


def max_new_tokens(body: SampleInput, context_length: int) -> int:
    """How many tokens a request may generate: its max_tokens, or what the context leaves."""
    room = context_length - body.prompt.length
    return body.sampling_params.max_tokens or room


def raw_token_count(prompt: object) -> int:
    """The tokens a prompt's JSON form lists (0 where it has another shape, which validation
    then refuses), counted without converting any of them."""
    chunks = prompt.get("chunks") if isinstance(prompt, dict) else None
    if not isinstance(chunks, list):
        return 0
    return sum(
        len(c["tokens"])
        for c in chunks
        if isinstance(c, dict) and isinstance(c.get("tokens"), list | tuple)
    )


def check_sample_size(body: SampleInput, limits: RequestLimits) -> None:
    """A sample request: samples per request, tokens in its prompt and in max_tokens."""
    num_samples, max_tokens = body.num_samples, body.sampling_params.max_tokens
    if num_samples > limits.samples_per_request:
        raise UserInputError(
            f"num_samples: {num_samples} is more than QT_MAX_SAMPLES_PER_REQUEST="
            f"{limits.samples_per_request} allows in one request; send several requests"
        )
    check_model_input_images("prompt", body.prompt, limits)
    check_tokens("prompt", body.prompt.length, limits)
    if max_tokens is not None and max_tokens > limits.tokens_per_datum:
        raise UserInputError(
            f"sampling_params.max_tokens: {max_tokens} is more than QT_MAX_TOKENS_PER_DATUM="
            f"{limits.tokens_per_datum} allows in one sequence"
        )


def sample_input(
    prompt: object,
    num_samples: object,
    sampling_params: object,
    prompt_logprobs: bool,
    model_path: str | None,
    *,
    limits: RequestLimits,
    topk_prompt_logprobs: object = 0,
    target_prompt_logprobs: object = None,
    topk_sample_logprobs: object = 0,
    prompt_alt_tokens_k: object = 0,
    inflight_of: str | None = None,
    context_cap: int | None = None,
) -> SampleInput:
    """A sample op's body from what a caller sent, checked as far as the caller's side can
    (the Python client and the gateway both build it here); errors name the field."""
    check_tokens("prompt", raw_token_count(prompt), limits)  # before millions become ints
    body = validated(
        SampleInput,
        "",
        {
            "prompt": validated(ModelInput, "prompt", prompt),
            "num_samples": num_samples,
            "sampling_params": validated(SamplingParams, "sampling_params", sampling_params),
            "prompt_logprobs": prompt_logprobs,
            "topk_prompt_logprobs": topk_prompt_logprobs,
            "target_prompt_logprobs": target_prompt_logprobs,
            "topk_sample_logprobs": topk_sample_logprobs,
            "prompt_alt_tokens_k": prompt_alt_tokens_k,
            "model_path": model_path,
            "inflight_of": inflight_of,
            "context_cap": context_cap,
        },
    )
    check_sample_size(body, limits)
    check_sample(body, ModelLimits().with_cap(context_cap))
    return body


def _check_targets(targets: list[list[int]], prompt_length: int, vocab: int | None) -> None:
    """target_prompt_logprobs: [len(prompt) - 1][K] token ids, or NO_TARGET."""
    field = "target_prompt_logprobs"
    if len(targets) != prompt_length - 1:
        raise UserInputError(
            f"{field}: has {len(targets)} rows for a prompt of "
            f"{prompt_length} tokens; it needs len(prompt) - 1 rows "
            "(row i is scored at prompt position i + 1)"
        )
    widths = {len(row) for row in targets}
    if len(widths) > 1 or widths - set(range(1, MAX_PROMPT_TOPK + 1)):
        raise UserInputError(
            f"{field}: rows must all have the same number of ids, from 1 to "
            f"{MAX_PROMPT_TOPK}; got {sorted(widths)}"
        )
    ids = np.asarray(targets, dtype=np.int64).ravel()
    asked = ids[ids != NO_TARGET]
    if vocab is not None:
        check_token_ids(field, asked, vocab)
    elif asked.size and asked.min() < 0:
        raise UserInputError(f"{field}: token ids must be >= 0 ({NO_TARGET}: none)")


def check_sample(body: SampleInput, limits: ModelLimits | None = None) -> None:
    """Raise UserInputError naming the first problem in a sample request (what the model
    knows is checked only where `limits` has it: on the worker)."""
    limits = limits or ModelLimits()
    n = body.prompt.length
    if limits.vocab_size is not None:
        check_token_ids("prompt", np.asarray(body.prompt.text_ints()), limits.vocab_size)
        check_token_ids(
            "sampling_params.stop",
            np.asarray(body.sampling_params.stop_token_ids, dtype=np.int64),
            limits.vocab_size,
        )
    if body.target_prompt_logprobs is not None and body.prompt.counted:
        _check_targets(body.target_prompt_logprobs, n, limits.vocab_size)
    if limits.context_length is None:
        return
    if n >= limits.context_length:
        raise UserInputError(
            f"prompt: {n} tokens leaves no room to generate in {limits.context_text}"
        )
    max_tokens = body.sampling_params.max_tokens
    if max_tokens is not None and n + max_tokens > limits.context_length:
        raise UserInputError(
            f"sampling_params.max_tokens: prompt ({n} tokens) + max_tokens ({max_tokens}) is "
            f"more than {limits.context_text}"
        )
