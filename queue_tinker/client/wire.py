"""Wire types in and out of the client: user arguments checked into request types (validated),
and result bytes decoded into result types."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel

from queue_tinker.types import codec
from queue_tinker.types.validation import validated

__all__ = ["decoder", "validated"]

R = TypeVar("R", bound=BaseModel)


def decoder(model: type[R]) -> Callable[[bytes], R]:
    return lambda raw: model.model_validate(codec.decode(raw))
