"""Wire types built from what a caller sent, with errors that name the field."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from queue_tinker.errors import UserInputError
from queue_tinker.types.tensors import CHUNK_TAGS

R = TypeVar("R", bound=BaseModel)


def validated(model: type[R], field: str, value: Any) -> R:
    """Build a wire type from what the user passed; a bad field becomes a UserInputError that
    names it (`field` is the argument's name; '' when `value` holds several arguments)."""
    try:
        return value if isinstance(value, model) else model.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = field_path(field, first["loc"])
        raise UserInputError(f"{where}: {first['msg']} (got {shown(first.get('input'))})") from None


def shown(value: Any, limit: int = 200) -> str:
    """A value's repr for an error message, cut short: a bad field may hold megabytes."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def field_path(field: str, loc: tuple[int | str, ...]) -> str:
    """`data[0].model_input`, as the user wrote it (pydantic says `data.0.model_input`). A
    request that is not an object at all names no field: it is the body's fault."""
    path = field
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part != "" and part not in CHUNK_TAGS:  # a union's tag is no field
            path += f".{part}" if path else str(part)
    return path or "body"
