"""`queue-tinker serve`: run the gateway with uvicorn."""

from __future__ import annotations

import uvicorn

from queue_tinker.gateway.app import create_app
from queue_tinker.settings import Settings


def serve(settings: Settings, *, host: str | None = None, port: int | None = None) -> int:
    app = create_app(settings)
    uvicorn.run(app, host=host or settings.gateway_host, port=port or settings.gateway_port,
                log_level="info")
    return 0
