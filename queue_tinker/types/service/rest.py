"""The REST answers (training runs, checkpoints, sessions, samplers, capabilities), shaped as
the Tinker SDK's types: the gateway answers them as JSON and the Python client's RestClient
returns them as these objects (attribute access: `run.user_metadata`,
`caps.supported_models[0].model_name`). Field names and optionality follow tinker 0.38.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict


class _Answer(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", protected_namespaces=())


class SupportedModel(_Answer):
    model_name: str
    max_context_length: int | None = None  # tokens per sequence; None: no loaded worker yet


class GetServerCapabilitiesResponse(_Answer):
    supported_models: list[SupportedModel]


class Checkpoint(_Answer):
    checkpoint_id: str  # weights/<name>, sampler_weights/<name> or external_weights/<name>
    checkpoint_type: Literal["training", "sampler", "external"]
    time: datetime
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    expires_at: datetime | None = None


class Cursor(_Answer):
    offset: int
    limit: int
    total_count: int


class CheckpointsListResponse(_Answer):
    checkpoints: list[Checkpoint]
    cursor: Cursor | None = None


class TrainingRun(_Answer):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    corrupted: bool = False
    lora_rank: int | None = None
    last_request_time: datetime
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict[str, str] | None = None


class TrainingRunsResponse(_Answer):
    training_runs: list[TrainingRun]
    cursor: Cursor


class WeightsInfoResponse(_Answer):
    base_model: str
    is_lora: bool
    lora_rank: int | None = None
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None


class GetSessionResponse(_Answer):
    training_run_ids: list[str]
    sampler_ids: list[str]


class ListSessionsResponse(_Answer):
    sessions: list[str]


class GetSamplerResponse(_Answer):
    sampler_id: str
    base_model: str
    model_path: str | None = None
