"""What a worker tells the rest of the deployment about itself: the registry entry its
heartbeat refreshes (the dashboard's and `queue-tinker status`'s live view) and the worker
record kept in Postgres (their history)."""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from queue_tinker.types import WorkerRecord
from queue_tinker.types.service.ops import Op


@dataclass
class Activity:
    """What the worker is doing: the op it runs now (the dashboard's "current op") and how
    many ops it published."""

    current: Op | None = None
    ops_done: int = 0


@dataclass(frozen=True)
class Identity:
    """Who a worker is: fixed for its life."""

    worker_id: str
    base_model: str
    device: str
    started_at: float


def registry_fields(
    who: Identity,
    activity: Activity,
    *,
    owned: int,
    stopping: bool,
    device_memory_bytes: int,
    resident: Any,
    context_length: int | None,
) -> dict[str, Any]:
    """The worker's registry entry, as one heartbeat writes it."""
    return {
        "base_model": who.base_model,
        "context_length": context_length or "",
        "device": who.device,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started_at": who.started_at,
        "owned": owned,
        "ops_done": activity.ops_done,
        "current_op": f"{current.kind}:{current.job_id}" if (current := activity.current) else "",
        "stopping": int(stopping),
        "memory_bytes": process_memory_bytes(),
        "device_memory_bytes": device_memory_bytes,
        "resident": json.dumps(resident),
    }


def worker_record(who: Identity, *, stopped: bool = False) -> WorkerRecord:
    """The worker's record event: alive now, or stopped now."""
    now = time.time()
    return WorkerRecord(
        id=who.worker_id,
        base_model=who.base_model,
        device=who.device,
        host=socket.gethostname(),
        pid=os.getpid(),
        started_at=who.started_at,
        last_heartbeat_at=now,
        stopped_at=now if stopped else None,
    )


def process_memory_bytes() -> int:
    """This process's resident memory (Linux: /proc; elsewhere its peak, from getrusage)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
