"""Big request bodies are parsed off the event loop, so one tenant's 57 MiB JSON does not hold
every other tenant's requests behind it (json.loads of 57 MiB is ~0.5 s of one core).

FastAPI parses a route's JSON body with Starlette's `Request.json()` on the loop. Every
gateway route is an `OffLoopRoute`: before FastAPI's handler runs, a body of at least
OFF_LOOP_BYTES is parsed in a worker thread and left where `Request.json()` keeps its result,
so FastAPI finds it parsed. A body that is not JSON (bad UTF-8, nesting past the parser's
depth) is a 422 naming `body`, as FastAPI answers other bad JSON (it answered those two with a
bare 400 "There was an error parsing the body"). Routes that convert big payloads themselves
run that in a thread too (`to_thread`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

OFF_LOOP_BYTES = 64 * 1024  # below this, parsing costs less than the thread hand-off
T = TypeVar("T")


class OffLoopRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:  # no body, or one the route reads itself
            return handler

        async def parse_off_loop(request: Request) -> Response:
            media = request.headers.get("content-type", "application/json").split(";")[0]
            body = await request.body()
            if body and media.strip().lower().endswith("json"):
                try:
                    # Starlette's Request.json() returns this attribute when it is set.
                    request._json = await off_loop(lambda: json.loads(body), len(body))
                except (ValueError, RecursionError) as exc:  # also bad UTF-8, deep nesting
                    raise RequestValidationError(
                        [
                            {
                                "type": "json_invalid",
                                "loc": ("body",),
                                "input": None,
                                "msg": f"body: not valid JSON ({type(exc).__name__})",
                            }
                        ]
                    ) from None
            return await handler(request)

        return parse_off_loop


async def off_loop(work: Callable[[], T], size: int) -> T:
    """`work()` in a worker thread when `size` (the bytes it converts) makes it worth it."""
    if size >= OFF_LOOP_BYTES:
        return await asyncio.to_thread(work)
    return work()
