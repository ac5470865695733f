"""The cap on an HTTP request body (QT_MAX_REQUEST_BYTES), enforced before anything parses it.

An ASGI middleware, not a check in the endpoints: by the time an endpoint runs, Starlette has
read the whole body into memory. A declared Content-Length over the cap is answered 413 at
once; otherwise the body is counted as it streams in (a chunked body declares no length, and a
declared one is not trusted), and the request is answered 413 as soon as the count passes the
cap, holding at most the cap in memory. The server discards the rest of that body, so the
client reads the 413 once it has sent it.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from queue_tinker.settings import Settings
from queue_tinker.types.request_limits import RequestLimits, too_many_bytes

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyLimit:
    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.limits = RequestLimits.of(settings)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.limits.request_bytes:
            await _too_large(send, too_many_bytes(self.limits, "the HTTP body", declared).message)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: nothing to answer
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.request_bytes:
                await _too_large(send, too_many_bytes(self.limits, "the HTTP body", None).message)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)


async def _too_large(send: Send, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses a malformed one before we see it
    return None


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
