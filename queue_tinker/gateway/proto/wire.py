"""Sizes read off a ForwardBackwardRequest's protobuf wire bytes without parsing it: the field
headers only (a tag and a length each), over a memoryview, so nothing is copied. A body whose
datum count or a datum's tokens pass a limit is refused from these lengths alone (a token is
4 bytes of `EncodedTextChunk.tokens`).

It works on a prefix of the body too: a field's declared length counts even where its bytes
have not arrived, and a message cut short is read as far as it goes. The protobuf encoder
writes fields in number order, so the envelope and the first datum's headers come first: the
gateway's body reader (envelope/body_limit.py) stops reading a protobuf as soon as its first bytes
prove it over a limit, and hands the route just those.

Field numbers (tinker_public.proto): ForwardBackwardRequest model_id 1, seq_id 2, data 3,
forward_only 6; Datum model_input 1; Chunk encoded_text 1; EncodedTextChunk tokens 1.
"""

from __future__ import annotations

from collections.abc import Iterator

from queue_tinker.errors import MalformedProtobufError, UserInputError
from queue_tinker.types.requests.request_limits import (
    RequestLimits,
    check_datum_count,
    check_tokens,
)

LENGTH_DELIMITED, VARINT = 2, 0
_SKIP = {1: 8, 5: 4}  # fixed64, fixed32


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while pos < len(buf) and shift < 70:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
    raise MalformedProtobufError("body: not well-formed protobuf")


def fields(buf: memoryview) -> Iterator[tuple[int, int, memoryview | int, int]]:
    """(field number, wire type, value, declared length): a view of a length-delimited
    field's bytes (only those present, in a prefix), a varint's value, or 0 for a
    fixed-width one; the declared length is a length-delimited field's, else 0."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        value: memoryview | int = 0
        length = 0
        if wire == VARINT:
            value, pos = _varint(buf, pos)
        elif wire == LENGTH_DELIMITED:
            length, pos = _varint(buf, pos)
            value, pos = buf[pos : pos + length], pos + length
        elif wire in _SKIP:
            pos += _SKIP[wire]
        else:
            raise MalformedProtobufError("body: not well-formed protobuf")
        yield number, wire, value, length


def _views(buf: memoryview, number: int) -> Iterator[tuple[memoryview, int]]:
    for got, wire, value, length in fields(buf):
        if got == number and wire == LENGTH_DELIMITED and isinstance(value, memoryview):
            yield value, length


def _tokens(datum: memoryview) -> int:
    """Tokens the datum's chunks declare (a token is 4 bytes)."""
    return sum(
        length // 4
        for chunk, _ in _views(datum, 1)
        for text, _ in _views(chunk, 1)
        for _, length in _views(text, 1)
    )


def oversize(body: memoryview, limits: RequestLimits) -> UserInputError | None:
    """The error of a body whose datum count or a datum's tokens pass a limit, else None."""
    try:
        data = [datum for datum, _ in _views(body, 3)]
        check_datum_count(len(data), limits)
        for index, datum in enumerate(data):
            check_tokens(f"data[{index}].model_input", _tokens(datum), limits)
    except MalformedProtobufError:  # before its base: not an oversize body
        return None
    except UserInputError as exc:
        return exc
    return None


def envelope_of(body: memoryview) -> tuple[str, int, bool] | None:
    """(model_id, seq_id, forward_only) of a well-formed body, else None."""
    model_id, seq_id, forward_only = "", 0, False
    try:
        for number, _, value, length in fields(body):
            if number == 1 and isinstance(value, memoryview):
                if len(value) < length:
                    return None  # cut short inside the model id
                model_id = bytes(value).decode()
            elif number == 2 and isinstance(value, int):
                seq_id = value - (1 << 64) if value >= 1 << 63 else value  # int32, sign-extended
            elif number == 6 and isinstance(value, int):
                forward_only = bool(value)
    except (MalformedProtobufError, UnicodeDecodeError):
        return None
    return model_id, seq_id, forward_only
