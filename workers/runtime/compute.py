"""The worker's compute thread, and what an engine's result becomes on the queue.

Every engine call runs on one dedicated thread: the event loop keeps beating (heartbeats,
reading, publishing) while a pass computes, and an engine's state is only ever touched from
that one thread.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from queue_tinker.errors import ErrorCategory, QueueTinkerError
from queue_tinker.queue.dispatch.dispatcher import Op, Outcome
from queue_tinker.types import JobStatus
from queue_tinker.workers.interface import OpResult, ResultOrError

log = logging.getLogger(__name__)
T = TypeVar("T")
P = ParamSpec("P")


class ComputeThread:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qt-compute")

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """fn(*args) on the compute thread, once what runs there now is done."""
        call = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    def later(self, fn: Callable[[str], object], arg: str) -> None:
        """fn(arg) on the compute thread after what runs there now, without waiting for it."""
        self._pool.submit(fn, arg)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def outcome_of(op: Op, result: ResultOrError, worker_id: str) -> Outcome:
    """The outcome published for an op: its result, or its error with the category the client
    sees (a user error's message alone; a server error's traceback, logged here too)."""
    if isinstance(result, OpResult):
        return Outcome(
            status=JobStatus.DONE,
            result=result.result,
            metrics=result.metrics,
            tokens=result.tokens,
        )
    detail = "".join(traceback.format_exception(result))
    if isinstance(result, QueueTinkerError):
        user = result.category is ErrorCategory.USER
        return Outcome(
            status=JobStatus.FAILED,
            error=result.message,
            error_category=result.category.value,
            error_detail="" if user else detail,
        )
    log.error("%s: op %s (%s) failed\n%s", worker_id, op.job_id, op.kind, detail)
    return Outcome(
        status=JobStatus.FAILED,
        error=f"{type(result).__name__}: {result}",
        error_category=ErrorCategory.SERVER.value,
        error_detail=detail,
    )
