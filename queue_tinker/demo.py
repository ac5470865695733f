"""`queue-tinker demo`: the whole service on this machine, driven by a short client script.

Starts the embedded Redis and Postgres (or uses QT_REDIS_URL / QT_DATABASE_URL), a worker
process, then submits ops through the ordinary client, shows progress and latency, checks the
Postgres record, and stops everything.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from contextlib import ExitStack

from queue_tinker.client import ServiceClient
from queue_tinker.processes import ProcessGroup
from queue_tinker.settings import Settings
from queue_tinker.store.db import make_engine, session_factory
from queue_tinker.store.queries import count_requests_by_status
from queue_tinker.up import child_env, start_backends, stop_children

DEMO_BASE_MODEL = "tiny"
MODELS = 2


def _progress(done: int, total: int, started: float) -> None:
    width = 30
    filled = width * done // total
    rate = done / max(time.monotonic() - started, 1e-9)
    sys.stderr.write(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
                     f"ops  {rate:,.0f} ops/s")
    sys.stderr.flush()


def _workload(settings: Settings, ops: int) -> list[float]:
    """Submit `ops` pings over two models, one at a time; per-op round trip in ms."""
    latencies: list[float] = []
    with ServiceClient(settings) as service:
        print(f"creating {MODELS} models on base model {DEMO_BASE_MODEL!r} ...", file=sys.stderr)
        clients = [service.create_lora_training_client(DEMO_BASE_MODEL, rank=8)
                   for _ in range(MODELS)]
        print(f"round trips of a trivial op through Redis and the worker ({ops} ops):",
              file=sys.stderr)
        started = time.monotonic()
        for i in range(ops):
            t0 = time.perf_counter()
            result = clients[i % MODELS].ping(i).result(timeout=60)
            latencies.append((time.perf_counter() - t0) * 1000)
            assert result["data"] == i
            if (i + 1) % 50 == 0 or i + 1 == ops:
                _progress(i + 1, ops, started)
        sys.stderr.write("\n")
    return latencies


async def _record_counts(database_url: str) -> dict[str, int]:
    engine = make_engine(database_url)
    try:
        return await count_requests_by_status(session_factory(engine))
    finally:
        await engine.dispose()


def run_demo(settings: Settings, *, ops: int = 1_000) -> int:
    with ExitStack() as stack:
        print("starting Redis and Postgres (embedded unless QT_*_URL are set) ...", file=sys.stderr)
        settings = start_backends(settings, stack)
        group = ProcessGroup()
        stack.callback(stop_children, group)
        group.start("worker", [sys.executable, "-m", "queue_tinker.cli", "worker",
                               "--base-model", DEMO_BASE_MODEL, "--device", "cpu"],
                    child_env(settings))
        latencies = _workload(settings, ops)
        ordered = sorted(latencies)
        print(f"  p50 {statistics.median(ordered):.2f} ms   "
              f"p99 {ordered[int(len(ordered) * 0.99) - 1]:.2f} ms", file=sys.stderr)
        time.sleep(1.5)  # the recorder writes Postgres behind the hot path
        counts = asyncio.run(_record_counts(settings.database_url or ""))
        print(f"Postgres record: {counts}", file=sys.stderr)
        print("stopping ...", file=sys.stderr)
    return 0
