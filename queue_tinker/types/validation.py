"""Wire types built from what a caller sent, with errors that name the field."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from queue_tinker.errors import UserInputError

R = TypeVar("R", bound=BaseModel)


def validated(model: type[R], field: str, value: Any) -> R:
    """Build a wire type from what the user passed; a bad field becomes a UserInputError that
    names it (`field` is the argument's name; '' when `value` holds several arguments)."""
    try:
        return value if isinstance(value, model) else model.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in (field, *first["loc"]) if p != "")
        raise UserInputError(f"{where}: {first['msg']} (got {first.get('input')!r})") from None
