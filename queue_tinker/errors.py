"""One error hierarchy. Each error says whose fault it is: the user's input or the service.

Every exception class of queue_tinker is defined here, under QueueTinkerError, with a
category (tests/test_errors.py checks it). The gateway answers a user error with a 4xx and a
server error with a 5xx (gateway/app.py add_error_handlers); a worker publishes the category
with a failed op, and the client raises it as RequestFailedError.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCategory(StrEnum):
    USER = "user"  # bad input: retrying the same request fails the same way
    SERVER = "server"  # the service failed: retrying may succeed


class QueueTinkerError(Exception):
    """Base of every error queue_tinker raises; a server error unless a subclass says so."""

    category: ErrorCategory = ErrorCategory.SERVER

    def __init__(self, message: str, *, category: ErrorCategory | None = None) -> None:
        super().__init__(message)
        self.message = message
        if category is not None:
            self.category = category


class UserInputError(QueueTinkerError):
    """The request is malformed; the message names the field and what is wrong with it."""

    category = ErrorCategory.USER


class OpCancelledError(QueueTinkerError):
    """The op was cancelled (cancel_future, the dashboard) while it waited or ran; the message
    says by whom and when."""

    category = ErrorCategory.USER


class UnknownModelError(UserInputError):
    """The model id does not exist (or belongs to another tenant)."""


class DeviceMemoryError(UserInputError):
    """One op's data does not fit in a worker's device memory, even alone; the message names
    the tokens it held and the most one pass has held. Retrying the same call fails the same
    way: split it."""


class WorkerFitError(QueueTinkerError):
    """A worker's base model, resident adapters and budgets do not fit its device memory
    (workers/model/fit.py: the message names each part's GiB and the changes that would fit),
    or a setting asks for what its device or installation lacks (QT_LIGER_KERNELS=on without
    CUDA or liger-kernel): it refuses to start. The deployment's to fix, not a request's: a
    server error."""


class WorkerGroupError(QueueTinkerError):
    """A sharded worker group cannot serve the base model as configured (an architecture it
    does not split, heads not divisible by its ranks), so it refuses to start; the message
    names the setting and the reason. The deployment's to fix: a server error."""


class RanksPartedError(QueueTinkerError):
    """The ranks of a worker group came out of one engine call differently (one raised, the
    others did not): their states no longer match, so the group ends, as a crash would, and
    a new one replays the op. The message names the call and each rank's outcome."""


class NotFoundError(UserInputError):
    """A training run, checkpoint, session or sampler the tenant does not have (missing and
    another tenant's read the same)."""


class RequestFailedError(QueueTinkerError):
    """A job reached the worker and failed there; carries the worker's message."""

    def __init__(
        self, message: str, *, category: ErrorCategory, request_id: str, detail: str = ""
    ) -> None:
        super().__init__(message, category=category)
        self.request_id = request_id
        self.detail = detail  # traceback for server errors, empty for user errors

    def __str__(self) -> str:
        return f"request {self.request_id} failed ({self.category}): {self.message}"


class ResultExpiredError(QueueTinkerError):
    """The job's result is no longer kept in Redis (older than QT_RESULT_TTL_S)."""


class LeaseLostError(QueueTinkerError):
    """A worker tried to write for a model whose lease it no longer holds (fenced out)."""


class HeldOpsFullError(QueueTinkerError):
    """A model already holds as many early ops (sent ahead of a seq_id that has not arrived)
    as it may; the same request succeeds once the missing one arrives. Retry shortly."""


class SeqIdUsedError(UserInputError):
    """A seq_id below the model's next one arrived, and its first job is no longer known."""


class MalformedProtobufError(UserInputError):
    """Not well-formed protobuf (gateway/proto/wire.py's quick look at a body): the gateway
    leaves it to the real parser, which says what is wrong."""


class RedisUnavailableError(QueueTinkerError, ConnectionError):
    """Redis did not answer within the time the caller was willing to wait. Also Python's
    ConnectionError (not redis-py's: errors.py imports nothing, so the types that use it
    stay free of redis)."""


class HousekeeperUnavailableError(QueueTinkerError):
    """No housekeeper ran a job the caller waits for (a Python client's checkpoint delete or
    TTL change) within the time it waits: none is running for the deployment."""


class EmbeddedServerError(QueueTinkerError):
    """An embedded Redis or Postgres could not be started."""


class StorageUnavailableError(QueueTinkerError):
    """Checkpoint storage is not there: not mounted, or not shared with the workers."""


class CheckpointReplacedError(StorageUnavailableError):
    """A file set was replaced by another writer after this one read it (a worker whose lease
    lapsed writing a snapshot after the model's next owner): the write is refused."""


class CheckpointPathError(QueueTinkerError):
    """A directory the housekeeper must not delete (outside checkpoint storage)."""
