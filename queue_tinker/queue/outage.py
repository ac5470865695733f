"""How a process rides out a Redis outage (a restart, a failover, a dropped connection): calls
that fail because Redis is not there wait for it and run again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from queue_tinker.errors import RedisUnavailableError

log = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")

# What "Redis is not there" looks like to redis-py: refused or dropped connections, timeouts,
# and LOADING while a restarted Redis reads its append-only file (BusyLoadingError is a
# ConnectionError).
REDIS_DOWN: tuple[type[Exception], ...] = (RedisConnectionError, RedisTimeoutError)
# Probes of a Redis that went away back off to this interval: a worker is back within 2 s of a
# restarted Redis, well inside a lease (QT_LEASE_TTL_MS, 10 s), so its leases survive a quick
# restart.
MAX_RETRY_DELAY_S = 2.0
# While Redis stays away, say so again this often.
STILL_DOWN_LOG_S = 30.0


def is_redis_error(exc: BaseException) -> bool:
    """Whether Redis (not the caller's other stores) raised `exc`: an outage or a refusal."""
    return isinstance(exc, RedisError)


def describe(exc: BaseException) -> str:
    """An exception as one short line for a log."""
    text = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Reconnector:
    """Rides out Redis outages for one process's tasks.

    A call that fails because Redis is not there waits here until Redis answers again, then
    runs again (every caller makes only calls that are safe to repeat: fenced scripts, reads,
    idempotent writes). The first caller to notice starts one probe, which pings Redis with
    backoff (up to MAX_RETRY_DELAY_S) and logs what happens; the others wait for the same probe.
    After give_up_after(s), an outage longer than s fails every waiter with
    RedisUnavailableError instead (a stopping worker: its leases lapse anyway).
    """

    def __init__(self, redis: Redis, who: str, *, max_delay_s: float = MAX_RETRY_DELAY_S) -> None:
        self.redis = redis
        self.who = who
        self.max_delay_s = max_delay_s
        self.outages = 0
        self.down_since: float | None = None  # monotonic
        self.error: RedisUnavailableError | None = None  # set once it gave up
        self._up = asyncio.Event()
        self._up.set()
        self._nudge = asyncio.Event()  # the patience changed: the probe looks again now
        self._patience_s: float | None = None
        self._probe: asyncio.Task[None] | None = None

    @property
    def down(self) -> bool:
        return not self._up.is_set()

    def give_up_after(self, seconds: float) -> None:
        """From now on, stop waiting for Redis once an outage has lasted `seconds`."""
        self._patience_s = seconds
        self._nudge.set()

    async def call(self, fn: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
        """fn(*args, **kwargs), run again after each outage until it gets an answer."""
        while True:
            try:
                return await fn(*args, **kwargs)
            except REDIS_DOWN as exc:  # a RedisUnavailableError (given up) is not one: raised
                await self.wait(exc)

    async def wait(self, exc: BaseException) -> None:
        """Return once Redis answers again (it failed with `exc`)."""
        if self.error is not None:
            raise self.error
        if self._up.is_set():
            self._up.clear()
            self.down_since = time.monotonic()
            self.outages += 1
            self._probe = asyncio.create_task(
                self._probe_until_up(exc), name=f"qt-redis-probe-{self.who}"
            )
        await self._up.wait()
        if self.error is not None:
            raise self.error

    async def close(self) -> None:
        if self._probe is not None and not self._probe.done():
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe

    async def _probe_until_up(self, first: BaseException) -> None:
        started = self.down_since or time.monotonic()
        delay, failures, last_said = 0.0, 0, started
        error: BaseException = first
        try:
            while True:
                try:
                    await self.redis.ping()
                    break
                except REDIS_DOWN as exc:
                    error, failures = exc, failures + 1
                now = time.monotonic()
                if self._patience_s is not None and now - started >= self._patience_s:
                    self.error = RedisUnavailableError(
                        f"Redis unreachable for {now - started:.0f} s ({describe(error)}); "
                        f"{self.who} gave up waiting for it"
                    )
                    log.error("%s", self.error)
                    return
                delay = min(max(delay * 2, 0.1), self.max_delay_s)
                if failures == 1:
                    log.warning(
                        "%s: Redis unreachable (%s); retrying in %.1fs",
                        self.who,
                        describe(error),
                        delay,
                    )
                elif now - last_said >= STILL_DOWN_LOG_S:
                    last_said = now
                    log.warning(
                        "%s: Redis still unreachable after %.0f s (%s); retrying every %.1fs",
                        self.who,
                        now - started,
                        describe(error),
                        delay,
                    )
                self._nudge.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._nudge.wait(), delay)
            if failures:
                log.warning(
                    "%s: reconnected to Redis after %.1fs", self.who, time.monotonic() - started
                )
            else:  # one dropped connection (e.g. a pooled one from before a restart)
                log.info(
                    "%s: a Redis connection dropped (%s); reconnected", self.who, describe(first)
                )
        finally:
            self.down_since = None
            self._up.set()
