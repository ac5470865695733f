"""Types shared by client, queue, store, gateway and workers: one definition per wire shape."""

from queue_tinker.types.enums import JobStatus, OpKind, QueueState
from queue_tinker.types.records import (
    RECORD_ADAPTER,
    ModelRecord,
    Record,
    RequestRecord,
    SessionRecord,
    WorkerRecord,
)

__all__ = [
    "RECORD_ADAPTER",
    "JobStatus",
    "ModelRecord",
    "OpKind",
    "QueueState",
    "Record",
    "RequestRecord",
    "SessionRecord",
    "WorkerRecord",
]
