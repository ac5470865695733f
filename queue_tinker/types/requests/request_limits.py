"""How big one request may be, and the one check of each limit.

The client (before it enqueues), the gateway (on the decoded request) and the worker (before it
runs an op, for bodies that came some other way) call these same functions, so a limit means the
same thing at every door and the messages read the same. The limits are settings (QT_MAX_*);
the messages name the field, the number and the setting, so a user knows what to change and an
operator what to raise. A whole request's size is checked beside its other checks, with these
(loss_inputs.check_batch_size, sampling.check_sample_size); what only the model knows
(vocabulary, context length) is checked on the worker (loss_inputs.check_batch,
sampling.check_sample).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from queue_tinker.errors import UserInputError
from queue_tinker.types import codec

# msgpack carries integers from -2**63 to 2**64 - 1; anything beyond cannot travel.
_INT_RANGE = (-(2**63), 2**64)


class LimitSettings(Protocol):
    """The QT_MAX_* fields of the settings (a Protocol, so types need not import settings)."""

    @property
    def max_tokens_per_datum(self) -> int: ...
    @property
    def max_datums_per_request(self) -> int: ...
    @property
    def max_samples_per_request(self) -> int: ...
    @property
    def max_request_bytes(self) -> int: ...
    @property
    def max_image_bytes(self) -> int: ...
    @property
    def max_image_pixels(self) -> int: ...


@dataclass(frozen=True)
class RequestLimits:
    """The QT_MAX_* settings, as the checks take them. The defaults here are the settings'
    defaults too (settings.py reads them from DEFAULT_LIMITS), so they are written once."""

    tokens_per_datum: int = 32_768
    datums_per_request: int = 1_024
    samples_per_request: int = 1_024
    request_bytes: int = 64 * 1024 * 1024
    image_bytes: int = 10 * 1024 * 1024
    image_pixels: int = 4096 * 4096

    @classmethod
    def of(cls, settings: LimitSettings) -> RequestLimits:
        return cls(
            tokens_per_datum=settings.max_tokens_per_datum,
            datums_per_request=settings.max_datums_per_request,
            samples_per_request=settings.max_samples_per_request,
            request_bytes=settings.max_request_bytes,
            image_bytes=settings.max_image_bytes,
            image_pixels=settings.max_image_pixels,
        )

    @classmethod
    def defaults(cls) -> RequestLimits:
        """The settings' defaults, whatever the environment says."""
        return DEFAULT_LIMITS


DEFAULT_LIMITS = RequestLimits()


def size_text(size: int) -> str:
    """Bytes as a person reads them: '70.2 MiB', '512.0 KiB', '900 bytes'."""
    if size >= 1 << 20:
        return f"{size / (1 << 20):.1f} MiB"
    if size >= 1 << 10:
        return f"{size / (1 << 10):.1f} KiB"
    return f"{size} bytes"


# --- each limit ----------------------------------------------------------------------------
def check_datum_count(count: int, limits: RequestLimits) -> None:
    if count > limits.datums_per_request:
        raise UserInputError(
            f"data: {count} datums is more than QT_MAX_DATUMS_PER_REQUEST="
            f"{limits.datums_per_request} allows in one request; split the batch into "
            "several calls"
        )


def check_tokens(where: str, count: int, limits: RequestLimits, what: str = "tokens") -> None:
    if count > limits.tokens_per_datum:
        raise UserInputError(
            f"{where}: {count} {what} is more than QT_MAX_TOKENS_PER_DATUM="
            f"{limits.tokens_per_datum} allows in one sequence"
        )


def check_request_bytes(size: int, limits: RequestLimits, what: str = "the encoded body") -> None:
    if size > limits.request_bytes:
        raise too_many_bytes(limits, what, size)


def too_many_bytes(limits: RequestLimits, what: str, size: int | None) -> UserInputError:
    """The error of a request over QT_MAX_REQUEST_BYTES (`size` None: counted only as far as
    the limit, as the gateway does with a body it stops reading)."""
    amount = f"is {size_text(size)}, more than" if size is not None else "is more than"
    return UserInputError(
        f"request: {what} {amount} QT_MAX_REQUEST_BYTES={limits.request_bytes} "
        f"({size_text(limits.request_bytes)}) allows; split it into smaller requests"
    )


def encode_request(body: Any, limits: RequestLimits) -> bytes:
    """An op body as the bytes that go on the queue, refused as the user's error (naming the
    field) when a value cannot travel (an integer beyond 64 bits, a string that is not valid
    Unicode) or the whole is over QT_MAX_REQUEST_BYTES."""
    try:
        payload = codec.encode(body)
    except (TypeError, ValueError, OverflowError) as exc:
        where = unencodable(body, "") or "request"
        raise UserInputError(f"{where}: cannot be sent ({exc})") from None
    check_request_bytes(len(payload), limits)
    return payload


def unencodable(value: Any, path: str) -> str | None:
    """The path of the first value in `value` the queue's codec cannot carry (only walked
    after an encode failed)."""
    if not isinstance(value, dict | list | tuple):
        return None if _leaf_encodes(value) else path or "request"
    for where, item in _items(value, path):
        found = unencodable(item, where)
        if found is not None:
            return found
    return None


def _leaf_encodes(value: Any) -> bool:
    """Whether a value that holds no others can travel: an integer within msgpack's range (a
    bool is one), a string that is valid Unicode. Any other leaf is left to the codec."""
    if isinstance(value, int):
        return _INT_RANGE[0] <= value < _INT_RANGE[1]
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return False
    return True


def _items(
    value: dict[Any, Any] | list[Any] | tuple[Any, ...], path: str
) -> Iterator[tuple[str, Any]]:
    """The values a dict, list or tuple holds, each with its path."""
    if isinstance(value, dict):
        return ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
    return ((f"{path}[{i}]", v) for i, v in enumerate(value))
