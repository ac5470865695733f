"""SamplingClient: generate from a checkpoint or a base model. Every call is a sample op in the
client's own queue (its sampling session); workers batch the samples of many sessions into one
generation loop.

Made by ServiceClient.create_sampling_client(model_path=... or base_model=...),
TrainingClient.create_sampling_client(path) or
TrainingClient.save_weights_and_get_sampling_client(), never directly.
"""

from __future__ import annotations

from typing import Any

from queue_tinker.builtin_models import load_tokenizer, text_only
from queue_tinker.client.future import APIFuture
from queue_tinker.client.holder import ClientHolder, decode_outcome, new_id
from queue_tinker.client.loop import BackgroundLoop
from queue_tinker.client.wire import decoder
from queue_tinker.queue.ops import runs
from queue_tinker.settings import Settings
from queue_tinker.types import OpKind, codec
from queue_tinker.types.model_names import parse_model_name, served_base
from queue_tinker.types.requests.images import refuse_images
from queue_tinker.types.requests.request_limits import RequestLimits, encode_request
from queue_tinker.types.requests.sampling import (
    SampleInput,
    SampleResponse,
    SamplingParams,
    sample_input,
)
from queue_tinker.types.tensors import ModelInput


def last_n_only(response: SampleResponse, last_n: int) -> SampleResponse:
    """The prompt logprobs (plain and top-k) of the last `last_n` positions only, as the SDK
    returns them with prompt_logprobs_last_n: None before."""

    def keep(values: list[Any] | None) -> list[Any] | None:
        if values is None:
            return None
        return [None] * max(0, len(values) - last_n) + values[-last_n:]

    return response.model_copy(
        update={
            "prompt_logprobs": keep(response.prompt_logprobs),
            "topk_prompt_logprobs": keep(response.topk_prompt_logprobs),
        }
    )


class SamplingClient:
    def __init__(
        self,
        loop: BackgroundLoop,
        holder: ClientHolder,
        sampler_id: str,
        base_model: str,
        model_path: str | None,
        settings: Settings,
        inflight_of: str | None = None,
    ) -> None:
        self._loop = loop
        self._holder = holder
        self._settings = settings
        self.sampler_id = sampler_id
        self.base_model = base_model
        self.model_path = model_path  # None: samples come from the base model itself
        # The training run whose inflight weights this client follows (queue/ops/inflight.py):
        # model_path is then the save that made it, and samples run on the newest one.
        self.inflight_of = inflight_of
        self._limits = RequestLimits.of(settings)

    # --- sampling --------------------------------------------------------------------------
    async def sample_async(
        self,
        prompt: ModelInput,
        num_samples: int,
        sampling_params: SamplingParams,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: list[list[int]] | None = None,
        prompt_alt_tokens_k: int = 0,
        prompt_logprobs_last_n: int | None = None,
    ) -> APIFuture[SampleResponse]:
        """`num_samples` continuations of `prompt`, each with its tokens, their logprobs and
        why it stopped; with include_prompt_logprobs, the prompt's logprobs too; with
        topk_prompt_logprobs=k, the k most likely tokens at each prompt position; with
        target_prompt_logprobs ([len(prompt) - 1][K] token ids, -1 for none), their logprobs;
        prompt_logprobs_last_n keeps only the last N positions of both; with
        topk_sample_logprobs=k, the k most likely tokens at each generated position; with
        prompt_alt_tokens_k=k, k draws at each prompt position after the first."""
        body = sample_input(
            prompt,
            num_samples,
            sampling_params,
            include_prompt_logprobs or prompt_logprobs_last_n is not None,
            await self._weights(),
            limits=self._limits,
            topk_prompt_logprobs=topk_prompt_logprobs,
            target_prompt_logprobs=target_prompt_logprobs,
            topk_sample_logprobs=topk_sample_logprobs,
            prompt_alt_tokens_k=prompt_alt_tokens_k,
            inflight_of=self.inflight_of,
            context_cap=parse_model_name(self.base_model).context_cap,
        )
        if text_only(served_base(self.base_model)):  # a built-in known to take no image
            refuse_images("prompt", body.prompt, self.base_model)
        pending = await self._submit(body)
        if prompt_logprobs_last_n is None:
            return pending
        return pending.then(lambda response: last_n_only(response, prompt_logprobs_last_n))

    def sample(
        self,
        prompt: ModelInput,
        num_samples: int,
        sampling_params: SamplingParams,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: list[list[int]] | None = None,
        prompt_alt_tokens_k: int = 0,
        prompt_logprobs_last_n: int | None = None,
    ) -> APIFuture[SampleResponse]:
        return self._loop.run(
            self.sample_async(
                prompt,
                num_samples,
                sampling_params,
                include_prompt_logprobs,
                topk_prompt_logprobs,
                topk_sample_logprobs,
                target_prompt_logprobs,
                prompt_alt_tokens_k,
                prompt_logprobs_last_n,
            )
        )

    async def compute_logprobs_async(
        self, prompt: ModelInput, prompt_logprobs_last_n: int | None = None
    ) -> APIFuture[list[float | None]]:
        """The logprob of each prompt token given the ones before it (None for the first, and
        before the last N with prompt_logprobs_last_n)."""
        pending = await self.sample_async(
            prompt,
            1,
            SamplingParams(max_tokens=1),
            True,
            prompt_logprobs_last_n=prompt_logprobs_last_n,
        )
        return pending.then(lambda response: list(response.prompt_logprobs or []))

    def compute_logprobs(
        self, prompt: ModelInput, prompt_logprobs_last_n: int | None = None
    ) -> APIFuture[list[float | None]]:
        return self._loop.run(self.compute_logprobs_async(prompt, prompt_logprobs_last_n))

    async def _weights(self) -> str | None:
        """The weights the next sample runs on: the newest inflight save of the run this
        client follows, else its own."""
        if self.inflight_of is None:
            return self.model_path
        newest = await self._loop.call(self._holder.inflight.path(self.inflight_of))
        return newest or self.model_path

    async def _submit(self, body: SampleInput) -> APIFuture[SampleResponse]:
        return await self._holder.submit_future(
            self._loop,
            self.sampler_id,
            OpKind.SAMPLE,
            encode_request(body.model_dump(), self._limits),
            decoder(SampleResponse),
        )

    # --- the model -------------------------------------------------------------------------
    def get_base_model(self) -> str:
        return self.base_model

    def get_tokenizer(self) -> Any:
        """The base model's Hugging Face tokenizer (built locally for built-in models)."""
        return load_tokenizer(served_base(self.base_model), self._settings.models_dir)

    def __repr__(self) -> str:
        weights = self.model_path or f"base model {self.base_model}"
        return f"SamplingClient(sampler_id={self.sampler_id!r}, weights={weights!r})"


async def new_sampling_client(
    loop: BackgroundLoop,
    holder: ClientHolder,
    settings: Settings,
    model_path: str | None,
    base_model: str | None,
    inflight_of: str | None = None,
) -> SamplingClient:
    """Create a sampling session and wait until a worker has checked its weights (so a bad path
    fails here, not at the first sample). inflight_of: the run whose inflight weights it
    follows (model_path is then its newest save)."""
    sampler_id = f"smp-{new_id()}"

    async def create() -> str:
        base = await runs.sampling_base_model(holder.jobs, holder.tenant_id, model_path, base_model)
        _, outcome = await runs.open_sampling_session(
            holder.jobs,
            holder.submit,
            sampler_id,
            base_model=base,
            tenant_id=holder.tenant_id,
            session_id=holder.session_id,
            model_path=model_path,
            inflight_of=inflight_of,
        )
        decode_outcome(await outcome, codec.decode)
        return base

    base = await loop.call(create())
    return SamplingClient(loop, holder, sampler_id, base, model_path, settings, inflight_of)
