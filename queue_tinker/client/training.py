"""TrainingClient: one model (LoRA adapter). Every method enqueues an op and returns a future."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from queue_tinker.client.future import APIFuture
from queue_tinker.client.holder import ClientHolder
from queue_tinker.client.loop import BackgroundLoop
from queue_tinker.queue import codec
from queue_tinker.types import OpKind

T = TypeVar("T")


class TrainingClient:
    def __init__(
        self, loop: BackgroundLoop, holder: ClientHolder, model_id: str, base_model: str
    ) -> None:
        self._loop = loop
        self._holder = holder
        self.model_id = model_id
        self.base_model = base_model

    async def _submit(
        self, kind: OpKind, body: Any, decode: Callable[[bytes], T], idempotency_key: str | None
    ) -> APIFuture[T]:
        """Enqueue (returns once the op holds its place in the model's order), then wait."""
        job_id, result = await self._loop.call(
            self._holder.submit_for_thread(
                self.model_id, kind, codec.encode(body), idempotency_key, decode
            )
        )
        return APIFuture(result, job_id)

    async def ping_async(
        self, data: Any = None, *, delay_ms: int = 0, idempotency_key: str | None = None
    ) -> APIFuture[dict[str, Any]]:
        """A no-op round trip through the model's queue: it waits behind the model's earlier
        ops, so its result means they have finished. `delay_ms` simulates work."""
        body = {"data": data, "delay_ms": delay_ms}
        return await self._submit(OpKind.PING, body, codec.decode, idempotency_key)

    def ping(
        self, data: Any = None, *, delay_ms: int = 0, idempotency_key: str | None = None
    ) -> APIFuture[dict[str, Any]]:
        return self._loop.run(self.ping_async(data, delay_ms=delay_ms,
                                              idempotency_key=idempotency_key))

    def __repr__(self) -> str:
        return f"TrainingClient(model_id={self.model_id!r}, base_model={self.base_model!r})"
