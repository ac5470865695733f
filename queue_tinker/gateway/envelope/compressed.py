"""Request bodies sent compressed: the SDK zstd-compresses its protobuf forward_backward body
(`Content-Encoding: zstd`) when client/config says `proto_compress_fwdbwd`. Token ids and
float arrays compress several times over, so a big batch costs a fraction of the bytes on the
wire; the gateway inflates it before parsing, no further than QT_MAX_REQUEST_BYTES (the cap
the uncompressed body would have had), so a small body cannot inflate without bound."""

from __future__ import annotations

import zstandard
from fastapi import Request

from queue_tinker.errors import UserInputError
from queue_tinker.types.requests.request_limits import RequestLimits, too_many_bytes

READ_SIZE = 1 << 20


async def request_body(request: Request, limits: RequestLimits) -> bytes:
    """The body as sent, inflated when its Content-Encoding is zstd."""
    body = await request.body()
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding != "zstd":
        raise UserInputError(
            f"Content-Encoding: {encoding!r} is not supported; send the body "
            "as it is, or zstd-compressed"
        )
    return inflate(body, limits)


def inflate(body: bytes, limits: RequestLimits) -> bytes:
    """The zstd body inflated, read in pieces so that no more than the cap is ever held."""
    reader = zstandard.ZstdDecompressor().stream_reader(body, read_across_frames=True)
    pieces: list[bytes] = []
    size = 0
    try:
        while piece := reader.read(min(READ_SIZE, limits.request_bytes + 1 - size)):
            pieces.append(piece)
            size += len(piece)
            if size > limits.request_bytes:
                raise too_many_bytes(limits, "the inflated zstd body", None)
    except zstandard.ZstdError as exc:
        raise UserInputError(f"body: not a valid zstd frame ({exc})") from None
    return b"".join(pieces)
