"""The cap on an HTTP request body (QT_MAX_REQUEST_BYTES), enforced before anything parses it.

An ASGI middleware, not a check in the endpoints: by the time an endpoint runs, Starlette has
read the whole body into memory. A declared Content-Length over the cap is answered 413 at
once; otherwise the body is counted as it streams in (a chunked body declares no length, and a
declared one is not trusted), and the request is answered 413 as soon as the count passes the
cap, holding at most the cap in memory. The server discards the rest of that body, so the
client reads the 413 once it has sent it.

Only protobuf bodies (forward_backward, the SDK's big one) may be as big as the cap. A JSON
body is held to JSON_BODY_BYTES: json.loads runs in C holding the interpreter lock, so
parsing it stalls the event loop whatever thread it runs in (80 MiB took 3 s here; 1 MiB
takes ~30 ms), and no JSON request of the protocol needs more (a sample's longest prompt is
~230 KB; the SDK sends forward_backward as protobuf, in chunks of at most 5 MB).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from queue_tinker.gateway.proto.convert import PROTOBUF_MEDIA_TYPE
from queue_tinker.gateway.proto.wire import oversize
from queue_tinker.settings import Settings
from queue_tinker.types.requests.request_limits import RequestLimits, size_text, too_many_bytes

JSON_BODY_BYTES = 1 << 20
PEEK_BYTES = 64 * 1024  # the envelope and the first datums' headers are well inside this
FORWARD_BACKWARD_PATH = "/api/v1/forward_backward"


class BodyLimit:
    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.limits = RequestLimits.of(settings)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        cap, error = self._cap(scope)
        if declared is not None and declared > cap:
            await _too_large(send, error(declared))
            return
        peek = self._peeks(scope)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: nothing to answer
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cap:
                await _too_large(send, error(None))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
            if peek and size >= PEEK_BYTES:
                peek = False
                if oversize(memoryview(b"".join(chunks)), self.limits) is not None:
                    break  # the route refuses it from this prefix (proto/wire.py)
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    def _peeks(self, scope: Scope) -> bool:
        """Whether the body is a forward_backward protobuf, whose first bytes can prove it
        over a limit: then the rest (57 MiB of tokens, ~100 ms of this process's CPU to take
        in) is never read."""
        media = _header(scope, b"content-type").split(";", 1)[0].strip().lower()
        plain = _header(scope, b"content-encoding").strip().lower() in ("", "identity")
        # A compressed body's prefix is not protobuf: the route inflates it, then checks.
        return plain and media == PROTOBUF_MEDIA_TYPE and scope.get("path") == FORWARD_BACKWARD_PATH

    def _cap(self, scope: Scope) -> tuple[int, Callable[[int | None], str]]:
        """The most bytes this request's body may hold, and the message of a bigger one."""
        media = _header(scope, b"content-type").split(";", 1)[0].strip().lower()
        if media == PROTOBUF_MEDIA_TYPE or self.limits.request_bytes <= JSON_BODY_BYTES:
            return (
                self.limits.request_bytes,
                lambda size: too_many_bytes(self.limits, "the HTTP body", size).message,
            )

        def message(size: int | None) -> str:
            amount = f"is {size_text(size)}, more than" if size is not None else "is more than"
            return (
                f"request: the HTTP body {amount} the {size_text(JSON_BODY_BYTES)} a "
                "non-protobuf body may be; send forward_backward as protobuf (the tinker "
                "SDK does) or split the request"
            )

        return JSON_BODY_BYTES, message


async def _too_large(send: Send, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, wanted: bytes) -> str:
    for name, value in scope.get("headers", []):
        if name == wanted:
            return str(value.decode("latin-1"))
    return ""


def _content_length(scope: Scope) -> int | None:
    try:
        return int(_header(scope, b"content-length"))
    except ValueError:
        return None  # absent; a malformed one the server refuses before we see it


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the app the whole body at once, then what the client does next
    (a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
