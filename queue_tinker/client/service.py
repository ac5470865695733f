"""ServiceClient: the entry point. Creates training clients and answers what the service offers."""

from __future__ import annotations

from typing import Any

from queue_tinker.client.compat import adamw_only, no_weights_token
from queue_tinker.client.holder import ClientHolder, decode_outcome, new_id
from queue_tinker.client.loop import BackgroundLoop, background_loop
from queue_tinker.client.queue_state import QueueStateObserver
from queue_tinker.client.rest import RestClient, server_capabilities
from queue_tinker.client.sampling import SamplingClient, new_sampling_client
from queue_tinker.client.training import TrainingClient
from queue_tinker.errors import UserInputError
from queue_tinker.queue.ops import runs
from queue_tinker.settings import Settings, load_settings, with_running_up
from queue_tinker.types import codec
from queue_tinker.types.requests.training import MAX_LORA_RANK, LoraConfig
from queue_tinker.types.service.rest import GetServerCapabilitiesResponse
from queue_tinker.types.validation import validated


def lora_config(
    rank: int, seed: int | None, train_attn: bool, train_mlp: bool, train_unembed: bool
) -> LoraConfig:
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= MAX_LORA_RANK:
        raise UserInputError(f"rank: must be an integer from 1 to {MAX_LORA_RANK}, got {rank!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise UserInputError(f"seed: must be an integer or None, got {seed!r}")
    if not (train_attn or train_mlp or train_unembed):
        raise UserInputError(
            "train_attn, train_mlp, train_unembed: at least one must be True, or nothing trains"
        )
    return validated(
        LoraConfig,
        "",
        {
            "rank": rank,
            "seed": seed,
            "train_attn": bool(train_attn),
            "train_mlp": bool(train_mlp),
            "train_unembed": bool(train_unembed),
        },
    )


class ServiceClient:
    """Connects to a queue_tinker deployment (QT_REDIS_URL, or settings=/overrides)."""

    def __init__(self, settings: Settings | None = None, **overrides: Any) -> None:
        self.settings = settings or with_running_up(load_settings(**overrides))
        self._loop: BackgroundLoop = background_loop()
        self._holder: ClientHolder = self._loop.run(self._open())
        self._rest_clients: list[RestClient] = []  # their database connections close with us

    async def _open(self) -> ClientHolder:
        holder = ClientHolder(self.settings)
        await holder.open_session()
        return holder

    # --- training clients ------------------------------------------------------------------
    async def create_lora_training_client_async(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: dict[str, str] | None = None,
        optimizer: Any = None,
    ) -> TrainingClient:
        """A new LoRA run on base_model; user_metadata (string to string) is kept with it."""
        if not isinstance(base_model, str) or not base_model.strip():
            raise UserInputError(f"base_model: must be a non-empty string, got {base_model!r}")
        adamw_only(optimizer)
        config = lora_config(rank, seed, train_attn, train_mlp, train_unembed)
        model_id = f"m-{new_id()}"
        holder = self._holder

        async def create() -> None:
            await holder.registry.check_served(
                base_model, allow_unserved=self.settings.queue_unserved_base_models
            )
            _, outcome = await runs.open_training_run(
                holder.jobs,
                holder.submit,
                model_id,
                base_model=base_model,
                tenant_id=holder.tenant_id,
                session_id=holder.session_id,
                config=config,
                user_metadata=user_metadata,
            )
            decode_outcome(await outcome, codec.decode)

        await self._loop.call(create())
        return TrainingClient(
            self._loop, holder, model_id, base_model, self.settings, lora_rank=config.rank
        )

    def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: dict[str, str] | None = None,
        optimizer: Any = None,
    ) -> TrainingClient:
        return self._loop.run(
            self.create_lora_training_client_async(
                base_model,
                rank,
                seed,
                train_mlp,
                train_attn,
                train_unembed,
                user_metadata,
                optimizer,
            )
        )

    async def create_training_client_from_state_async(
        self,
        path: str,
        base_model: str | None = None,
        user_metadata: dict[str, str] | None = None,
        weights_access_token: str | None = None,
        optimizer: Any = None,
        *,
        with_optimizer: bool = False,
    ) -> TrainingClient:
        """A new run that starts from a saved state (tinker://<run>/weights/<name>): the
        checkpoint's base model, LoRA config and weights; with_optimizer=True its optimizer
        state too, to continue exactly where the checkpoint left off."""
        no_weights_token(weights_access_token)
        adamw_only(optimizer)
        model_id = f"m-{new_id()}"
        holder = self._holder

        async def create() -> dict[str, Any]:
            _, outcome = await runs.open_training_run_from_state(
                holder.jobs,
                holder.submit,
                model_id,
                path,
                tenant_id=holder.tenant_id,
                session_id=holder.session_id,
                optimizer=with_optimizer,
                base_model=base_model,
                user_metadata=user_metadata,
            )
            decode_outcome(await outcome, codec.decode)
            return await holder.jobs.model_info(model_id)

        info = await self._loop.call(create())
        return TrainingClient(
            self._loop,
            holder,
            model_id,
            info["base_model"],
            self.settings,
            lora_rank=info["lora_config"].get("rank"),
        )

    def create_training_client_from_state(
        self,
        path: str,
        base_model: str | None = None,
        user_metadata: dict[str, str] | None = None,
        weights_access_token: str | None = None,
        optimizer: Any = None,
    ) -> TrainingClient:
        """Weights from the checkpoint; the optimizer starts afresh."""
        return self._loop.run(
            self.create_training_client_from_state_async(
                path, base_model, user_metadata, weights_access_token, optimizer
            )
        )

    async def create_training_client_from_state_with_optimizer_async(
        self,
        path: str,
        base_model: str | None = None,
        user_metadata: dict[str, str] | None = None,
        weights_access_token: str | None = None,
    ) -> TrainingClient:
        return await self.create_training_client_from_state_async(
            path, base_model, user_metadata, weights_access_token, with_optimizer=True
        )

    def create_training_client_from_state_with_optimizer(
        self,
        path: str,
        base_model: str | None = None,
        user_metadata: dict[str, str] | None = None,
        weights_access_token: str | None = None,
    ) -> TrainingClient:
        """Weights and optimizer state from the checkpoint."""
        return self._loop.run(
            self.create_training_client_from_state_with_optimizer_async(
                path, base_model, user_metadata, weights_access_token
            )
        )

    def training_client(self, model_id: str) -> TrainingClient:
        """A client for an existing model (another process may have created it)."""
        info = self._loop.run(self._holder.jobs.model_info(model_id))
        if info["kind"] != "training":
            raise UserInputError(f"model_id: {model_id!r} is a sampling session, not a run")
        return TrainingClient(
            self._loop,
            self._holder,
            model_id,
            info["base_model"],
            self.settings,
            lora_rank=info["lora_config"].get("rank"),
        )

    # --- sampling clients ------------------------------------------------------------------
    async def create_sampling_client_async(
        self,
        model_path: str | None = None,
        base_model: str | None = None,
        retry_config: Any = None,
        record_stability_info: bool = False,
    ) -> SamplingClient:
        """Sample from a checkpoint (tinker://<run>/sampler_weights/<name> or
        .../weights/<name>) or, with base_model only, from the base model itself.
        retry_config and record_stability_info are accepted and not needed: a lost connection
        is resubmitted under the same job id, and sampler and trainer share their numerics."""
        return await new_sampling_client(
            self._loop, self._holder, self.settings, model_path, base_model
        )

    def create_sampling_client(
        self,
        model_path: str | None = None,
        base_model: str | None = None,
        retry_config: Any = None,
        record_stability_info: bool = False,
    ) -> SamplingClient:
        return self._loop.run(self.create_sampling_client_async(model_path, base_model))

    def create_rest_client(self) -> RestClient:
        """Training runs, checkpoints, sessions and samplers of this client's tenant."""
        rest = RestClient(self._loop, self._holder, self.settings)
        self._rest_clients.append(rest)
        return rest

    # --- the service -----------------------------------------------------------------------
    async def get_server_capabilities_async(self) -> GetServerCapabilitiesResponse:
        """Base models served by live workers right now."""
        return await self._loop.call(server_capabilities(self._holder, self.settings))

    def get_server_capabilities(self) -> GetServerCapabilitiesResponse:
        return self._loop.run(self.get_server_capabilities_async())

    # --- queue state -------------------------------------------------------------------------
    def add_queue_state_observer(self, observer: QueueStateObserver) -> None:
        """Call `observer(change)` whenever a model this client waits on changes queue state
        (`paused_rate_limit`, `paused_capacity`, back to `active`), with the reason. It runs on
        the client's background loop: keep it quick, and never block in it. The default
        observer, which logs a warning at most once a minute per model, stays in place."""
        self._loop.run(self._add_observer(observer))

    async def _add_observer(self, observer: QueueStateObserver) -> None:
        self._holder.queue_state.observers.append(observer)

    def close(self, status: str = "success", detail: str | None = None) -> None:
        """End the client's session (status and detail are the SDK's; nothing reads them) and
        close the database connections of the RestClients it made."""
        for rest in self._rest_clients:
            rest.close()
        self._rest_clients.clear()
        self._loop.run(self._holder.close())

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
