"""The request limits' settings (QT_MAX_*); types/requests/request_limits.py checks each."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from queue_tinker.types.requests.request_limits import DEFAULT_LIMITS


class LimitsConfig(BaseModel):
    """How big one request may be (QT_MAX_*): client, gateway and worker check the same limits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens_per_datum: int = Field(
        default=DEFAULT_LIMITS.tokens_per_datum,
        ge=1,
        description="Most tokens in one sequence of a request: a training datum's model_input "
        "(and each of its loss_fn_inputs), a sample's prompt, a sample's max_tokens. 32K is the "
        "longest context most served models train at; the model's own context length still "
        "applies on the worker.",
    )
    max_datums_per_request: int = Field(
        default=DEFAULT_LIMITS.datums_per_request,
        ge=1,
        description="Most datums in one forward / forward_backward request. The tinker SDK "
        "splits a bigger call into chunks of 1,024, so its calls of any size pass; the Python "
        "client refuses a bigger batch (split it into several calls).",
    )
    max_samples_per_request: int = Field(
        default=DEFAULT_LIMITS.samples_per_request,
        ge=1,
        description="Most samples (num_samples) one sample request may ask for; a worker "
        "generates them sample_batch_sequences at a time.",
    )
    max_request_bytes: int = Field(
        default=DEFAULT_LIMITS.request_bytes,
        ge=1024,
        description="Most bytes of one request: the gateway refuses a bigger HTTP body (413, "
        "counted as it streams in, before it is parsed), and client, gateway and worker refuse "
        "an op body that encodes bigger. 64 MiB is ~4M tokens of training data, far over the "
        "SDK's own 5 MB chunks, and bounds what one op holds in Redis.",
    )
    max_image_bytes: int = Field(
        default=DEFAULT_LIMITS.image_bytes,
        ge=1,
        description="Most bytes of one image chunk (its encoded PNG or JPEG) in a model "
        "input; client, gateway and worker refuse a bigger one, naming the chunk.",
    )
    max_image_pixels: int = Field(
        default=DEFAULT_LIMITS.image_pixels,
        ge=1,
        description="Most pixels (width x height, read off the image's header) of one image "
        "chunk: a worker never decodes more (a small file can describe a huge image). The "
        "model's processor then resizes it to what the model reads.",
    )
