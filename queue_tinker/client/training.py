"""TrainingClient: one model (LoRA adapter). Every method enqueues an op and returns a future.

Each method has an `_async` twin (the primary surface, as in Tinker): `await
client.forward_backward_async(...)` returns once the op holds its place in the model's order,
and gives an APIFuture to await or `.result()` later. Ops of one client run in the order they
were called.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from queue_tinker.age import check_recipients
from queue_tinker.builtin_models import load_tokenizer, text_only
from queue_tinker.client.compat import no_checkpoint_metadata, no_weights_token, unused
from queue_tinker.client.custom_loss import (
    CustomLossFn,
    custom_output,
    forward_data,
    run_custom_loss,
)
from queue_tinker.client.future import APIFuture
from queue_tinker.client.holder import ClientHolder, new_id
from queue_tinker.client.loop import BackgroundLoop
from queue_tinker.client.sampling import SamplingClient, new_sampling_client
from queue_tinker.client.wire import decoder, validated
from queue_tinker.errors import UserInputError
from queue_tinker.queue.ops import runs
from queue_tinker.settings import Settings
from queue_tinker.types import OpKind, codec
from queue_tinker.types.model_names import parse_model_name, served_base
from queue_tinker.types.requests.images import refuse_images
from queue_tinker.types.requests.loss_inputs import (
    ModelLimits,
    check_batch,
    check_batch_size,
    parse_loss_fn,
)
from queue_tinker.types.requests.request_limits import (
    RequestLimits,
    check_datum_count,
    encode_request,
)
from queue_tinker.types.requests.training import (
    AdamParams,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    GetInfoResponse,
    LoadWeightsResponse,
    ModelData,
    OptimStepResponse,
    SaveWeightsExternalResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    UnloadModelResponse,
)
from queue_tinker.types.service.checkpoints import check_name
from queue_tinker.types.tensors import Datum

T = TypeVar("T")


def datums(data: Any, limits: RequestLimits | None = None) -> list[Datum]:
    if isinstance(data, Datum | dict | str | bytes) or not isinstance(data, Sequence):
        raise UserInputError(f"data: must be a list of Datum, got {type(data).__name__}")
    check_datum_count(len(data), limits or RequestLimits.defaults())  # before the work below
    return [validated(Datum, f"data[{i}]", d) for i, d in enumerate(data)]


def forward_backward_input(
    data: Sequence[Any],
    loss_fn: Any,
    loss_fn_config: Any,
    limits: RequestLimits | None = None,
    base_model: str | None = None,
) -> ForwardBackwardInput:
    """The op body of forward / forward_backward, checked as far as the client can (images
    too, on a built-in `base_model` known to take none; its datums' lengths against the
    :peft:<tokens> cap its name may set)."""
    limits = limits or RequestLimits.defaults()
    batch = validated(
        ForwardBackwardInput,
        "",
        {
            "data": datums(data, limits),
            "loss_fn": parse_loss_fn(loss_fn),
            "loss_fn_config": loss_fn_config,
        },
    )
    check_batch_size(batch, limits)
    cap = parse_model_name(base_model).context_cap if base_model is not None else None
    check_batch(batch, ModelLimits().with_cap(cap))
    if base_model is not None and text_only(served_base(base_model)):
        for index, datum in enumerate(batch.data):
            refuse_images(f"data[{index}].model_input", datum.model_input, base_model)
    return batch


def _ttl(ttl_seconds: Any) -> int | None:
    if ttl_seconds is None:
        return None
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) or ttl_seconds <= 0:
        raise UserInputError(
            f"ttl_seconds: must be a positive integer or None, got {ttl_seconds!r}"
        )
    return ttl_seconds


class TrainingClient:
    def __init__(
        self,
        loop: BackgroundLoop,
        holder: ClientHolder,
        model_id: str,
        base_model: str,
        settings: Settings,
        lora_rank: int | None = None,
    ) -> None:
        self._loop = loop
        self._holder = holder
        self._settings = settings
        self.model_id = model_id
        self.base_model = base_model
        self.lora_rank = lora_rank
        self._limits = RequestLimits.of(settings)

    async def _submit(
        self,
        kind: OpKind,
        body: Any,
        decode: Callable[[bytes], T],
        idempotency_key: str | None = None,
    ) -> APIFuture[T]:
        """Enqueue (returns once the op holds its place in the model's order), then wait."""
        payload = encode_request(body, self._limits)
        return await self._holder.submit_future(
            self._loop, self.model_id, kind, payload, decode, idempotency_key
        )

    # --- forward / backward ----------------------------------------------------------------
    async def forward_async(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: dict[str, float] | None = None
    ) -> APIFuture[ForwardBackwardOutput]:
        """Loss and per-datum target logprobs, without gradients."""
        batch = forward_backward_input(data, loss_fn, loss_fn_config, self._limits, self.base_model)
        return await self._submit(
            OpKind.FORWARD, batch.model_dump(), decoder(ForwardBackwardOutput)
        )

    def forward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: dict[str, float] | None = None
    ) -> APIFuture[ForwardBackwardOutput]:
        return self._loop.run(self.forward_async(data, loss_fn, loss_fn_config))

    async def forward_backward_async(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: dict[str, float] | None = None
    ) -> APIFuture[ForwardBackwardOutput]:
        """Loss, logprobs, and gradients added to the adapter's (accumulating until
        optim_step)."""
        batch = forward_backward_input(data, loss_fn, loss_fn_config, self._limits, self.base_model)
        return await self._submit(
            OpKind.FORWARD_BACKWARD, batch.model_dump(), decoder(ForwardBackwardOutput)
        )

    def forward_backward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: dict[str, float] | None = None
    ) -> APIFuture[ForwardBackwardOutput]:
        return self._loop.run(self.forward_backward_async(data, loss_fn, loss_fn_config))

    async def forward_backward_custom_async(
        self,
        data: Sequence[Datum],
        loss_fn: CustomLossFn,
        *,
        loss_type_input: str | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Any differentiable loss of the logprobs: a forward pass, `loss_fn(data, logprobs)`
        here with torch autograd, then a backward pass weighted by its gradient. Returns once
        the backward pass holds its place, so later calls queue behind it."""
        unused(
            "loss_type_input",
            loss_type_input or "logprobs",
            "logprobs",
            "the loss receives logprobs, the only input there is",
        )
        given = datums(data, self._limits)
        forward = await (await self.forward_async(forward_data(given), "cross_entropy"))
        linear, loss, metrics = run_custom_loss(given, forward, loss_fn)
        pending = await self.forward_backward_async(linear, "cross_entropy")
        return pending.then(lambda _: custom_output(forward, loss, metrics))

    def forward_backward_custom(
        self,
        data: Sequence[Datum],
        loss_fn: CustomLossFn,
        *,
        loss_type_input: str | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        unused(
            "loss_type_input",
            loss_type_input or "logprobs",
            "logprobs",
            "the loss receives logprobs, the only input there is",
        )
        # The user's loss runs on this thread, not on the client's event loop.
        given = datums(data, self._limits)
        forward = self.forward(forward_data(given), "cross_entropy").result()
        linear, loss, metrics = run_custom_loss(given, forward, loss_fn)
        pending = self.forward_backward(linear, "cross_entropy")
        return pending.then(lambda _: custom_output(forward, loss, metrics))

    # --- optimizer -------------------------------------------------------------------------
    async def optim_step_async(
        self, optim_params: AdamParams | None = None, *, adam_params: AdamParams | None = None
    ) -> APIFuture[OptimStepResponse]:
        """One AdamW step on the gradients accumulated since the last step, then clear them.
        The AdamParams come positionally (the SDK's optim_params) or as adam_params=."""
        given = adam_params if adam_params is not None else optim_params
        if given is None:
            raise UserInputError("adam_params: required (types.AdamParams(learning_rate=...))")
        params = validated(AdamParams, "adam_params", given)
        return await self._submit(
            OpKind.OPTIM_STEP, params.model_dump(), decoder(OptimStepResponse)
        )

    def optim_step(
        self, optim_params: AdamParams | None = None, *, adam_params: AdamParams | None = None
    ) -> APIFuture[OptimStepResponse]:
        return self._loop.run(self.optim_step_async(optim_params, adam_params=adam_params))

    # --- checkpoints -----------------------------------------------------------------------
    async def save_state_async(
        self,
        name: str,
        ttl_seconds: int | None = None,
        overwrite: bool = False,
        user_metadata: dict[str, str] | None = None,
    ) -> APIFuture[SaveWeightsResponse]:
        """Weights + optimizer state at tinker://<model id>/weights/<name>."""
        unused("overwrite", overwrite, False, "checkpoints are never overwritten; pick a new name")
        no_checkpoint_metadata(user_metadata)
        body = {"name": check_name(name), "ttl_seconds": _ttl(ttl_seconds)}
        return await self._submit(OpKind.SAVE_STATE, body, decoder(SaveWeightsResponse))

    def save_state(
        self,
        name: str,
        ttl_seconds: int | None = None,
        overwrite: bool = False,
        user_metadata: dict[str, str] | None = None,
    ) -> APIFuture[SaveWeightsResponse]:
        return self._loop.run(self.save_state_async(name, ttl_seconds, overwrite, user_metadata))

    async def save_weights_for_sampler_async(
        self,
        name: str,
        ttl_seconds: int | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        """Weights only, at tinker://<model id>/sampler_weights/<name> (PEFT format)."""
        no_checkpoint_metadata(user_metadata)
        return await self._save_for_sampler(check_name(name), _ttl(ttl_seconds))

    async def _save_for_sampler(
        self, name: str, ttl_seconds: int | None, *, ephemeral: bool = False
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        body = {"name": name, "ttl_seconds": ttl_seconds, "ephemeral": ephemeral}
        return await self._submit(
            OpKind.SAVE_WEIGHTS_FOR_SAMPLER, body, decoder(SaveWeightsForSamplerResponse)
        )

    def save_weights_for_sampler(
        self,
        name: str,
        ttl_seconds: int | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        return self._loop.run(self.save_weights_for_sampler_async(name, ttl_seconds, user_metadata))

    async def save_weights_external_async(
        self,
        name: str,
        ttl_seconds: int | None = None,
        age_encryption_recipients: list[str] | None = None,
    ) -> APIFuture[SaveWeightsExternalResponse]:
        """The PEFT files for download at tinker://<model id>/external_weights/<name>, each
        encrypted to the age recipients (age1... or SSH public keys) when given."""
        body = {
            "name": check_name(name),
            "ttl_seconds": _ttl(ttl_seconds),
            "age_encryption_recipients": check_recipients(age_encryption_recipients),
        }
        return await self._submit(
            OpKind.SAVE_WEIGHTS_EXTERNAL, body, decoder(SaveWeightsExternalResponse)
        )

    def save_weights_external(
        self,
        name: str,
        ttl_seconds: int | None = None,
        age_encryption_recipients: list[str] | None = None,
    ) -> APIFuture[SaveWeightsExternalResponse]:
        return self._loop.run(
            self.save_weights_external_async(name, ttl_seconds, age_encryption_recipients)
        )

    async def load_state_async(
        self, path: str, weights_access_token: str | None = None
    ) -> APIFuture[LoadWeightsResponse]:
        """Weights from a checkpoint; the optimizer starts afresh (moments and step at 0)."""
        no_weights_token(weights_access_token)
        return await self._load(path, optimizer=False)

    async def _load(self, path: str, *, optimizer: bool) -> APIFuture[LoadWeightsResponse]:
        """A load_state op, its path checked before it is queued (runs.checked_load)."""
        jobs, tenant = self._holder.jobs, self._holder.tenant_id
        load = await runs.checked_load(jobs, path, optimizer, into=self.model_id, tenant_id=tenant)
        return await self._submit(
            OpKind.LOAD_STATE, load.model_dump(), decoder(LoadWeightsResponse)
        )

    def load_state(
        self, path: str, weights_access_token: str | None = None
    ) -> APIFuture[LoadWeightsResponse]:
        return self._loop.run(self.load_state_async(path, weights_access_token))

    async def load_state_with_optimizer_async(
        self, path: str, weights_access_token: str | None = None
    ) -> APIFuture[LoadWeightsResponse]:
        """Weights and optimizer state, to continue exactly where the checkpoint left off."""
        no_weights_token(weights_access_token)
        return await self._load(path, optimizer=True)

    def load_state_with_optimizer(
        self, path: str, weights_access_token: str | None = None
    ) -> APIFuture[LoadWeightsResponse]:
        return self._loop.run(self.load_state_with_optimizer_async(path, weights_access_token))

    # --- sampling --------------------------------------------------------------------------
    async def create_sampling_client_async(
        self, model_path: str, retry_config: Any = None, record_stability_info: bool = False
    ) -> SamplingClient:
        """A sampling client on a checkpoint (this run's or another of the tenant's);
        retry_config and record_stability_info are accepted and not needed (as on
        ServiceClient.create_sampling_client)."""
        return await new_sampling_client(self._loop, self._holder, self._settings, model_path, None)

    def create_sampling_client(
        self, model_path: str, retry_config: Any = None, record_stability_info: bool = False
    ) -> SamplingClient:
        return self._loop.run(self.create_sampling_client_async(model_path))

    async def save_weights_and_get_sampling_client_async(
        self,
        name: str | None = None,
        retry_config: Any = None,
        record_stability_info: bool = False,
        kind: str = "snapshot",
    ) -> SamplingClient:
        """Save the weights as they are after every op sent so far, and sample from them.
        Without a name the weights are ephemeral: kept QT_EPHEMERAL_SAMPLER_TTL_S, and not
        listed among the run's checkpoints. kind="inflight" (without a name): the run's
        inflight weights move to this save, and every inflight client of the run samples
        from the newest such save, samples already running included (queue/ops/inflight.py)."""
        if kind not in ("snapshot", "inflight"):
            raise UserInputError(f"kind: must be 'snapshot' or 'inflight', got {kind!r}")
        if name is not None:
            unused("kind", kind, "snapshot", "a named save is a snapshot; drop the name")
            saved = await self.save_weights_for_sampler_async(name)
            return await self.create_sampling_client_async((await saved).path)
        ttl = self._settings.ephemeral_sampler_ttl_s
        label = f"{kind if kind == 'inflight' else 'ephemeral'}-{new_id()[:16]}"
        saved = await self._save_for_sampler(label, ttl, ephemeral=True)
        path = (await saved).path
        if kind == "snapshot":
            return await self.create_sampling_client_async(path)
        return await self._loop.call(self._open_inflight(saved.request_id, path))

    async def _open_inflight(self, save_job: str, path: str) -> SamplingClient:
        """Move the run's inflight weights to the save (by its seq), then open a client on it."""
        job, _ = await self._holder.jobs.job(save_job)
        await self._holder.inflight.publish(self.model_id, int(job["seq"]), path)
        return await new_sampling_client(
            self._loop, self._holder, self._settings, path, None, inflight_of=self.model_id
        )

    def save_weights_and_get_sampling_client(
        self,
        name: str | None = None,
        retry_config: Any = None,
        record_stability_info: bool = False,
        kind: str = "snapshot",
    ) -> SamplingClient:
        return self._loop.run(self.save_weights_and_get_sampling_client_async(name, kind=kind))

    # --- the model -------------------------------------------------------------------------
    async def get_info_async(self) -> GetInfoResponse:
        info = await self._loop.call(self._holder.jobs.model_info(self.model_id))
        return GetInfoResponse(
            model_id=self.model_id,
            lora_rank=info["lora_config"].get("rank"),
            model_name=info["base_model"],
            user_metadata=info["user_metadata"],
            model_data=ModelData(
                arch="causal_lm", model_name=info["base_model"], tokenizer_id=info["base_model"]
            ),
        )

    def get_info(self) -> GetInfoResponse:
        return self._loop.run(self.get_info_async())

    def get_tokenizer(self) -> Any:
        """The base model's Hugging Face tokenizer (built locally for built-in models)."""
        return load_tokenizer(served_base(self.base_model), self._settings.models_dir)

    def encode(self, text: str) -> list[int]:
        return list(self.get_tokenizer().encode(text, add_special_tokens=False))

    def decode(self, tokens: Sequence[int]) -> str:
        return str(self.get_tokenizer().decode(list(tokens)))

    async def unload_model_async(self) -> APIFuture[UnloadModelResponse]:
        """Free the model on its worker and end it: later ops fail. Checkpoints stay."""
        return await self._submit(OpKind.UNLOAD_MODEL, {}, decoder(UnloadModelResponse))

    def unload_model(self) -> APIFuture[UnloadModelResponse]:
        return self._loop.run(self.unload_model_async())

    # --- diagnostics -----------------------------------------------------------------------
    async def ping_async(
        self, data: Any = None, *, delay_ms: int = 0, idempotency_key: str | None = None
    ) -> APIFuture[dict[str, Any]]:
        """A no-op round trip through the model's queue: it waits behind the model's earlier
        ops, so its result means they have finished. `delay_ms` simulates work."""
        body = {"data": data, "delay_ms": delay_ms}
        return await self._submit(OpKind.PING, body, codec.decode, idempotency_key)

    def ping(
        self, data: Any = None, *, delay_ms: int = 0, idempotency_key: str | None = None
    ) -> APIFuture[dict[str, Any]]:
        return self._loop.run(
            self.ping_async(data, delay_ms=delay_ms, idempotency_key=idempotency_key)
        )

    def __repr__(self) -> str:
        return f"TrainingClient(model_id={self.model_id!r}, base_model={self.base_model!r})"
