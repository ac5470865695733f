"""Training requests and results, shaped as in Tinker (field names and defaults match)."""

from __future__ import annotations

import json
import math
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from queue_tinker.errors import UserInputError
from queue_tinker.types.enums import LossFn, Optimizer
from queue_tinker.types.model_names import parse_model_name
from queue_tinker.types.requests.custom_loss import CustomLoss
from queue_tinker.types.tensors import Datum, TensorData

# LoRA settings not exposed by Tinker's API; fixed here and written into every checkpoint's
# adapter_config.json. Dropout 0 keeps a step deterministic (and replayable).
LORA_ALPHA = 32
LORA_DROPOUT = 0.0
MAX_LORA_RANK = 1024
# Tinker caps LoRA on mixture-of-experts models at rank 32 (its error: "rank 128 exceeds max
# LoRA rank 32 for model Qwen3-235B-A22B-Instruct-2507"): an expert each has its own A and B.
MAX_MOE_LORA_RANK = 32

# A seed as torch takes it (torch.manual_seed / Generator.manual_seed: -2**63 to 2**64 - 1).
Seed = Annotated[int, Field(ge=-(2**63), lt=2**64)]


MAX_USER_METADATA_BYTES = 64 * 1024


def check_user_metadata(value: object, field: str = "user_metadata") -> dict[str, str] | None:
    """A training run's user_metadata: string keys to string values (the SDK's TrainingRun
    reads it as dict[str, str]), at most 64 KiB as JSON; None or {} is no metadata."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise UserInputError(
            f"{field}: must be a mapping of strings to strings, got {type(value).__name__}"
        )
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, str):
            raise UserInputError(
                f"{field}[{key!r}]: keys and values must be strings, got {type(item).__name__}"
            )
    if len(json.dumps(value)) > MAX_USER_METADATA_BYTES:
        raise UserInputError(f"{field}: larger than {MAX_USER_METADATA_BYTES} bytes as JSON")
    return dict(value) or None


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())


class LoraConfig(_Wire):
    rank: int = Field(32, ge=1, le=MAX_LORA_RANK)
    seed: Seed | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    # Kept with the LoRA settings so that it travels where they do (model meta, checkpoints,
    # the compatibility check of load_state): a run's optimizer is fixed at creation.
    optimizer: Optimizer = Optimizer.ADAMW


def _check_finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


class AdamParams(_Wire):
    """Hyperparameters of one optimizer step; the update is torch.optim.AdamW's."""

    learning_rate: float = Field(1e-4, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip_norm: float = Field(0.0, ge=0)  # 0: no clipping

    _finite = field_validator("*")(_check_finite)


class DimuonParams(_Wire):
    """Hyperparameters of one Dimuon step (Tinker's DimuonParams;
    workers/training/optimizers.py says what the update is)."""

    type: Literal["dimuon"] = "dimuon"
    learning_rate: float = Field(ge=0)  # for a direction of Frobenius norm sqrt(rank)
    grad_clip_norm: float = 0.0  # <= 0: no clipping
    beta1: float = Field(0.9, ge=0, lt=1)  # momentum: EMA coefficient of the gradients
    damping: float = Field(1e-4, gt=0)  # smooths the row and column preconditioner
    rank_lr_correction_exponent: float = 0.175  # lr * (32 / rank) ** this; 0: none

    _finite = field_validator(
        "learning_rate", "grad_clip_norm", "beta1", "damping", "rank_lr_correction_exponent"
    )(_check_finite)


OptimParams = AdamParams | DimuonParams


MAX_TTL_SECONDS = 10 * 365 * 86_400
MAX_BASE_MODEL = 512


def check_base_model(value: object, field: str = "base_model") -> str:
    """A base model name: a Hub id (org/name), a local directory or a built-in
    queue-tinker/... name, with an optional :peft:<tokens> context cap (model_names.py).
    Printable text without quotes or angle brackets, at most
    MAX_BASE_MODEL characters: a NUL made the run's record unstorable (dead-lettered) and
    markup would reach the dashboard."""
    if (
        not isinstance(value, str)
        or not value.strip()
        or len(value) > MAX_BASE_MODEL
        or not value.isprintable()
        or any(c in value for c in "<>\"'`")
    ):
        raise UserInputError(
            f"{field}: must be a Hub id, a local directory or a queue-tinker/... name (1 to "
            f"{MAX_BASE_MODEL} printable characters, no quotes or < >), got {value!r:.200}"
        )
    parse_model_name(value, field)  # a Base:peft:<tokens> name's cap
    return value


class CreateModelInput(_Wire):
    """The body of a create_model op."""

    lora_config: LoraConfig
    tenant_id: str
    base_model: str


class SaveInput(_Wire):
    """The body of a save_state / save_weights_for_sampler / save_weights_external op
    (age_encryption_recipients: external only; empty is no encryption)."""

    name: str
    ttl_seconds: int | None = Field(None, gt=0, le=MAX_TTL_SECONDS)
    age_encryption_recipients: list[str] = Field(default_factory=list)
    # Sampler weights saved for a sampling client without a name of the user's
    # (save_weights_and_get_sampling_client): kept for their TTL, not listed as a checkpoint.
    ephemeral: bool = False


class SaveWeightsExternalResponse(_Wire):
    path: str  # tinker://<run>/external_weights/<name>
    size_bytes: int | None = None
    type: Literal["save_weights_external"] = "save_weights_external"


class LoadInput(_Wire):
    """The body of a load_state op: weights, and with `optimizer` the optimizer state too."""

    path: str
    optimizer: bool = False


class ForwardBackwardInput(_Wire):
    """The body of a forward or forward_backward op."""

    data: list[Datum]
    loss_fn: LossFn
    loss_fn_config: dict[str, float] | None = None
    custom_loss: CustomLoss | None = None  # with loss_fn "custom": the uploaded loss

    @model_validator(mode="after")
    def _custom_loss_with_custom(self) -> ForwardBackwardInput:
        if (self.loss_fn is LossFn.CUSTOM) != (self.custom_loss is not None):
            raise ValueError(
                "loss_fn 'custom' runs an uploaded loss: send it with its "
                "custom_loss (create_custom_loss), and custom_loss only with it"
            )
        return self


class ForwardBackwardOutput(_Wire):
    loss_fn_output_type: str = "ArrayRecord"
    loss_fn_outputs: list[dict[str, TensorData]]  # per datum; always has "logprobs"
    metrics: dict[str, float] = Field(default_factory=dict)  # "name:reduction" -> value

    @property
    def loss(self) -> float:
        """The batch loss (the sum over data of each datum's loss)."""
        return self.metrics["loss:sum"]


class OptimStepResponse(_Wire):
    metrics: dict[str, float] | None = None


class SaveWeightsResponse(_Wire):
    path: str  # tinker://<run>/weights/<name>
    type: Literal["save_weights"] = "save_weights"


class SaveWeightsForSamplerResponse(_Wire):
    path: str  # tinker://<run>/sampler_weights/<name>
    type: Literal["save_weights_for_sampler"] = "save_weights_for_sampler"


class LoadWeightsResponse(_Wire):
    path: str
    type: Literal["load_weights"] = "load_weights"


class UnloadModelResponse(_Wire):
    model_id: str
    type: Literal["unload_model"] = "unload_model"


class ModelData(_Wire):
    arch: str | None = None
    model_name: str | None = None
    tokenizer_id: str | None = None


class GetInfoResponse(_Wire):
    model_id: str
    model_data: ModelData
    is_lora: bool = True
    lora_rank: int | None = None
    model_name: str | None = None
    user_metadata: dict[str, str] | None = None
    type: Literal["get_info"] = "get_info"
