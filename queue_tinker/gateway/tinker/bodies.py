"""The JSON request bodies of the Tinker protocol (docs/tinker-http-protocol.md, sections 5 and
6), as the tinker SDK sends them. Unknown fields are ignored (newer SDKs add some); what the
service cannot honour is refused by the endpoint with a message naming the field.

forward_backward is protobuf in SDK 0.38 (proto/convert.py); its older JSON form is here too.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from queue_tinker.types.requests.training import LoraConfig


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class CreateModelRequest(_Request):
    session_id: str
    model_seq_id: int = Field(ge=0)
    base_model: str
    lora_config: LoraConfig = Field(default_factory=LoraConfig)
    optimizer_config: dict[str, Any] | None = None
    user_metadata: Any = None  # checked by runs.open_training_run, naming the bad key


class ModelRequest(_Request):
    """get_info (and anything else that names only a model)."""

    model_id: str


class OrderedRequest(_Request):
    """A training call: the model and the client's seq_id for it (1, 2, ...)."""

    model_id: str
    seq_id: int = Field(ge=1)


class JsonForwardBackwardRequest(OrderedRequest):
    """The older JSON form of forward_backward (`forward_backward_input`) and of forward
    (`forward_input`, on /forward); SDK 0.38 sends protobuf instead."""

    forward_backward_input: dict[str, Any] | None = None
    forward_input: dict[str, Any] | None = None


class OptimStepRequest(OrderedRequest):
    # Checked by the endpoint, so a bad value still takes its turn in the model's order.
    adam_params: dict[str, Any] | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeightsRequest(OrderedRequest):
    path: str | None = None  # the checkpoint's name; None (sampler only): an ephemeral save
    ttl_seconds: int | None = None
    overwrite: bool = False
    sampling_session_seq_id: int | None = None
    # Without a path: a snapshot of the weights, or the run's mutable inflight weights.
    kind: Literal["snapshot", "inflight"] = "snapshot"


class SaveWeightsExternalRequest(OrderedRequest):
    path: str  # the name: tinker://<model>/external_weights/<path>
    ttl_seconds: int | None = None
    age_encryption_recipients: Any = None  # checked by the endpoint (queue_tinker.age)


class LoadWeightsRequest(_Request):
    """Into an existing model (model_id + seq_id), or a new model made from the checkpoint
    (session_id + model_seq_id)."""

    path: str
    optimizer: bool = False
    model_id: str | None = None
    seq_id: int | None = Field(None, ge=1)
    session_id: str | None = None
    model_seq_id: int | None = Field(None, ge=0)
    base_model: str | None = None
    user_metadata: Any = None  # create-from-state only


class CreateSamplingSessionRequest(_Request):
    session_id: str
    sampling_session_seq_id: int = Field(ge=0)
    base_model: str | None = None
    model_path: str | None = None


class SampleRequest(_Request):
    sampling_session_id: str
    seq_id: int = Field(ge=0)
    num_samples: int = 1
    prompt: dict[str, Any]
    sampling_params: dict[str, Any] = Field(default_factory=dict)  # checked by the endpoint
    prompt_logprobs: bool = False
    prompt_logprobs_last_n: int | None = Field(None, ge=1)
    topk_prompt_logprobs: int = 0
    target_prompt_logprobs: dict[str, Any] | None = None  # TensorData JSON: tinker/sampling.py
    topk_sample_logprobs: int = 0
    prompt_alt_tokens_k: int = 0


class RetrieveFutureRequest(_Request):
    request_id: str
    allow_metadata_only: bool = False
