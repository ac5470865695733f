"""One error hierarchy. Each error says whose fault it is: the user's input or the service."""

from __future__ import annotations

from enum import StrEnum


class ErrorCategory(StrEnum):
    USER = "user"  # bad input: retrying the same request fails the same way
    SERVER = "server"  # the service failed: retrying may succeed


class QueueTinkerError(Exception):
    """Base of every error queue_tinker raises."""

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
