"""APIFuture: the handle every client call returns; `.result()` blocks, `await` awaits."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Generator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from queue_tinker.client.loop import BackgroundLoop

T = TypeVar("T")
U = TypeVar("U")
# How the service is asked to cancel a request: True if it took the request back.
Canceller = Callable[[], Coroutine[Any, Any, bool]]
CANCEL_TIMEOUT_S = 60.0


class APIFuture(Generic[T]):
    """A request in flight. Resolves to the typed result or raises RequestFailedError."""

    def __init__(
        self,
        future: Future[T],
        request_id: str,
        canceller: tuple[BackgroundLoop, Canceller] | None = None,
    ) -> None:
        self._future = future
        self.request_id = request_id
        self._canceller = canceller

    def cancel(self) -> bool:
        """Ask the service to cancel the request: one still waiting in its queue fails at
        once, a running sample stops at its worker's next decode step, and `result()` then
        raises RequestFailedError (category user, "cancelled by the client"). False when it
        had finished, or runs and is not a sample (a training op runs to its end)."""
        if self._canceller is None or self.done():
            return False
        loop, cancel = self._canceller
        return loop.run(cancel(), timeout=CANCEL_TIMEOUT_S)

    async def cancel_async(self) -> bool:
        """cancel(), awaited."""
        if self._canceller is None or self.done():
            return False
        loop, cancel = self._canceller
        return await loop.call(cancel())

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
        return APIFuture(mapped, self.request_id, self._canceller)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"APIFuture(request_id={self.request_id!r}, {state})"
