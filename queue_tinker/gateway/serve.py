"""`queue-tinker serve`: run the gateway with uvicorn."""

from __future__ import annotations

import uvicorn

from queue_tinker.gateway.app import create_app
from queue_tinker.settings import Settings


def serve(settings: Settings, *, host: str | None = None, port: int | None = None) -> int:
    app = create_app(settings)
    # uvicorn picks its C parser, httptools (a dependency), when it is installed: big bodies
    # cost the loop less than with h11 (bench/big_bodies.py). "auto" still serves without it.
    uvicorn.run(
        app,
        host=host or settings.gateway_host,
        port=port or settings.gateway_port,
        log_level="info",
        http="auto",
    )
    return 0
