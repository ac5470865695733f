"""One background event loop per process: where every client's Redis I/O lives.

The async API hands its coroutines to this loop and awaits them from the caller's loop; the
sync API blocks on the same coroutines. One implementation, two facades.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class BackgroundLoop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="qt-client-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run on the background loop and block for the result (the sync facade)."""
        if _on_loop(self.loop):
            coro.close()
            raise RuntimeError("a sync queue_tinker call was made from its own event loop")
        return self.submit(coro).result(timeout)

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run on the background loop and await it from the caller's loop (the async facade)."""
        if _on_loop(self.loop):
            return await coro
        return await asyncio.wrap_future(self.submit(coro))

    def stop(self) -> None:
        """Cancel what still runs (listeners, unawaited futures), then stop the loop."""
        if not self.loop.is_running():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop).result(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


async def _cancel_all() -> None:
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


_shared: BackgroundLoop | None = None
_lock = threading.Lock()


def background_loop() -> BackgroundLoop:
    global _shared
    with _lock:
        if _shared is None:
            _shared = BackgroundLoop()
            atexit.register(_shared.stop)
        return _shared
