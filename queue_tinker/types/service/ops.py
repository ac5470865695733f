"""An op as a worker's engine receives it: read from a model's log by the queue, run by an
engine that knows no Redis (so engines depend on this module, not on the queue's)."""

from __future__ import annotations

from dataclasses import dataclass

from queue_tinker.types.enums import OpKind


@dataclass(frozen=True)
class Op:
    job_id: str
    model_id: str
    seq: int  # its place in the model's order
    kind: OpKind
    payload: bytes  # the request body, msgpack
