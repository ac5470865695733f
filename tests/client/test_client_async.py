"""The async facade: the same futures, awaited from the caller's own event loop."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from procs import running_workers

from queue_tinker.client import ServiceClient
from queue_tinker.errors import ErrorCategory, RequestFailedError, UnknownModelError
from queue_tinker.settings import Settings


def test_async_calls_await_results_in_order(
    settings: Settings, service: ServiceClient, tmp_path: Path
) -> None:
    """`await client.ping_async(...)` holds the op's place; `await future` gives its result;
    ops submitted one after another run in that order."""

    async def main() -> list[dict]:
        client = await service.create_lora_training_client_async("tiny", rank=4)
        futures = [await client.ping_async(i) for i in range(50)]
        return list(await asyncio.gather(*(f.result_async(timeout=30) for f in futures)))

    with running_workers(settings, 1, tmp_path):
        results = asyncio.run(main())
    assert results == [{"data": i, "seq": i + 2} for i in range(50)]


def test_async_errors_are_typed(settings: Settings, service: ServiceClient, tmp_path: Path) -> None:
    """A failed op raises RequestFailedError when awaited; a bad submit raises at once."""

    async def main() -> None:
        client = await service.create_lora_training_client_async("tiny", rank=4)
        future = await client.ping_async("x", delay_ms=10**9)
        with pytest.raises(RequestFailedError) as caught:
            await future
        assert caught.value.category is ErrorCategory.USER
        assert "delay_ms" in str(caught.value)
        with pytest.raises(UnknownModelError, match="model_id"):
            service.training_client("m-does-not-exist")

    with running_workers(settings, 1, tmp_path):
        asyncio.run(main())


def test_result_timeout_raises_while_the_op_waits(
    settings: Settings, service: ServiceClient
) -> None:
    """With no worker for the base model, `.result(timeout)` times out instead of hanging."""
    model = service._loop.run(
        service._holder.jobs.register_model(
            "m-orphan",
            base_model="nobody-serves-this",
            tenant_id="default",
            session_id=None,
            lora_config={},
        )
    )
    assert model is True
    future = service.training_client("m-orphan").ping("hello")
    with pytest.raises(TimeoutError):
        future.result(timeout=0.3)
    assert not future.done()
