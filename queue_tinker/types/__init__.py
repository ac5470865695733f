"""Types shared by client, queue, store, gateway and workers: one definition per wire shape.

User code reads like Tinker's: `from queue_tinker import types; types.Datum(...)`.
"""

from queue_tinker.types.enums import CheckpointKind, JobStatus, LossFn, OpKind, QueueState
from queue_tinker.types.requests.sampling import (
    PromptAltTokens,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    StopReason,
)
from queue_tinker.types.requests.training import (
    AdamParams,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    GetInfoResponse,
    LoadWeightsResponse,
    LoraConfig,
    ModelData,
    OptimStepResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    UnloadModelResponse,
)
from queue_tinker.types.service.checkpoints import CheckpointPath
from queue_tinker.types.service.records import (
    RECORD_ADAPTER,
    CheckpointRecord,
    ModelRecord,
    Record,
    RequestRecord,
    SamplingSessionRecord,
    SessionRecord,
    WorkerRecord,
)
from queue_tinker.types.tensors import Datum, EncodedTextChunk, ImageChunk, ModelInput, TensorData

__all__ = [
    "RECORD_ADAPTER",
    "AdamParams",
    "CheckpointKind",
    "CheckpointPath",
    "CheckpointRecord",
    "Datum",
    "EncodedTextChunk",
    "ForwardBackwardInput",
    "ForwardBackwardOutput",
    "GetInfoResponse",
    "ImageChunk",
    "JobStatus",
    "LoadWeightsResponse",
    "LoraConfig",
    "LossFn",
    "ModelData",
    "ModelInput",
    "ModelRecord",
    "OpKind",
    "OptimStepResponse",
    "PromptAltTokens",
    "QueueState",
    "Record",
    "RequestRecord",
    "SampleResponse",
    "SampledSequence",
    "SamplingParams",
    "SamplingSessionRecord",
    "SaveWeightsForSamplerResponse",
    "SaveWeightsResponse",
    "SessionRecord",
    "StopReason",
    "TensorData",
    "UnloadModelResponse",
    "WorkerRecord",
]
