"""APIFuture: the handle every client call returns; `.result()` blocks, `await` awaits."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")


class APIFuture(Generic[T]):
    """A request in flight. Resolves to the typed result or raises RequestFailedError."""

    def __init__(self, future: Future[T], request_id: str) -> None:
        self._future = future
        self.request_id = request_id

    def result(self, timeout: float | None = None) -> T:
        """Block until the request finishes (TimeoutError after `timeout` seconds)."""
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def __await__(self) -> Generator[Any, None, T]:
        return asyncio.wrap_future(self._future).__await__()

    async def result_async(self, timeout: float | None = None) -> T:
        return await asyncio.wait_for(asyncio.wrap_future(self._future), timeout)

    def then(self, fn: Callable[[T], U]) -> APIFuture[U]:
        """A future of fn(result), settled from this one's callback (no thread, no task)."""
        mapped: Future[U] = Future()

        def settle(done: Future[T]) -> None:
            try:
                mapped.set_result(fn(done.result()))
            except BaseException as exc:
                mapped.set_exception(exc)

        self._future.add_done_callback(settle)
        return APIFuture(mapped, self.request_id)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"APIFuture(request_id={self.request_id!r}, {state})"
