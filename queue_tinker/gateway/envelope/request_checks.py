"""Checks on a request's envelope before any route sees it, each answered with the status that
says what is wrong: a path no resource can have (a NUL or another control character, which
Postgres cannot even compare) is 404; such a query parameter 422 naming it; a body in a
content type or encoding the protocol does not use 415 naming the header. Every route's id,
query and body pass here first, so no id with a NUL reaches Postgres (it refused them with a
500) and no route parses a body it was never meant to read."""

from __future__ import annotations

import json
import re
from urllib.parse import parse_qsl

from starlette.types import ASGIApp, Receive, Scope, Send

from queue_tinker.gateway.proto.convert import PROTOBUF_MEDIA_TYPE

CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# The one route whose body is protobuf (the SDK's forward_backward, forward_only for forward).
PROTOBUF_ROUTES = {"/api/v1/forward_backward": PROTOBUF_MEDIA_TYPE}
# Bodies the SDK compresses (client/config's proto_compress_fwdbwd): gateway/envelope/compressed.py.
COMPRESSED_ROUTES = {"/api/v1/forward_backward": ("zstd",)}
# What a browser's form posts send; read as JSON they failed with 400s, so they are let through
# to the routes' own "body: not valid JSON" answer instead of a 415 the fuzz suites pinned.
LENIENT = ("application/x-www-form-urlencoded", "text/plain")


class RequestChecks:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = refusal_of(scope)
            if refusal is not None:
                await _answer(send, *refusal)
                return
        await self.app(scope, receive, send)


def refusal_of(scope: Scope) -> tuple[int, str] | None:
    """(status, detail) for a request refused on its envelope, or None."""
    path = scope.get("path", "")
    if CONTROL.search(path):
        return 404, f"path: {path!r} holds a control character; no resource has such an id"
    refusal = _query_refusal(scope.get("query_string", b"").decode("latin-1"))
    if refusal is not None:
        return refusal
    headers = {
        name.decode("latin-1").lower(): value.decode("latin-1")
        for name, value in scope.get("headers", [])
    }
    return _encoding_refusal(path, headers) or _media_refusal(path, scope.get("method"), headers)


def _query_refusal(query: str) -> tuple[int, str] | None:
    """422 for the first query parameter with a control character in its name or value."""
    for name, value in parse_qsl(query, keep_blank_values=True):
        if CONTROL.search(name) or CONTROL.search(value):
            label = name if name.isidentifier() else f"query[{name!r}]"
            return 422, f"{label}: the query parameter holds a control character: {value!r}"
    return None


def _encoding_refusal(path: str, headers: dict[str, str]) -> tuple[int, str] | None:
    """415 for a body compressed in a way this route does not read."""
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity", *COMPRESSED_ROUTES.get(path, ())):
        return None
    return 415, (
        f"Content-Encoding: {encoding!r} is not supported here; send the body "
        "uncompressed" + (" or zstd-compressed" if path in COMPRESSED_ROUTES else "")
    )


def _media_refusal(path: str, method: object, headers: dict[str, str]) -> tuple[int, str] | None:
    """415 for a body, in a method that carries one, of a content type this route does not
    read (form posts and plain text excepted: see LENIENT)."""
    media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if not media or method not in ("POST", "PUT", "PATCH"):
        return None
    wanted = ["application/json", *([PROTOBUF_ROUTES[path]] if path in PROTOBUF_ROUTES else [])]
    if media in (*wanted, *LENIENT):
        return None
    return 415, f"Content-Type: {media!r} is not supported here; send {' or '.join(wanted)}"


async def _answer(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
