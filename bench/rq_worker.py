"""The rq baseline: the trivial job and an rq `SimpleWorker` (no fork) in its own process.

Run as `python -m bench.rq_worker --redis-url URL --queue NAME [--burst]`. On exit it prints one
JSON line: when `work()` started and returned (wall clock).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def echo(value: T) -> T:
    """The trivial job: return the argument (the rq twin of a queue_tinker ping)."""
    return value


def main(argv: Sequence[str] | None = None) -> int:
    from redis import Redis
    from rq import Queue, SimpleWorker

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--burst", action="store_true", help="drain the queue, then exit")
    args = parser.parse_args(argv)

    connection = Redis.from_url(args.redis_url)
    queue = Queue(args.queue, connection=connection)
    worker = SimpleWorker([queue], connection=connection)
    started = time.time()
    # WARNING: rq's default INFO logs two lines per job; silenced, rq gets its best case.
    worker.work(burst=args.burst, logging_level="WARNING", with_scheduler=False)
    ended = time.time()
    print(json.dumps({"start": started, "end": ended}), flush=True)
    connection.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
