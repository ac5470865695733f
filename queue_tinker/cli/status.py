"""`queue-tinker status`: the queue overview and the op counters in the terminal.

It reads Redis directly (the same `queue_overview` and `read_metrics` the gateway serves), so it
works with the gateway down. The rendering functions take the JSON form that `--json` prints,
so what the table shows and what a script reads are one thing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from queue_tinker.queue.connection import RedisClient, connect
from queue_tinker.queue.keys import Keys
from queue_tinker.settings import Settings

if TYPE_CHECKING:
    from queue_tinker.queue.observe.metrics import MetricsSnapshot

CLEAR_SCREEN = "\x1b[H\x1b[2J"


async def read_status(redis: RedisClient, keys: Keys, settings: Settings) -> dict[str, Any]:
    """Everything `status` shows, JSON-able: {"overview": ..., "metrics": ...}."""
    # Imported here: they pull in the wire types (numpy, pydantic: ~0.3 s), which `limits`
    # (it uses table()) and the text functions do without.
    from queue_tinker.queue.observe.metrics import read_metrics
    from queue_tinker.queue.observe.overview import queue_overview

    overview = await queue_overview(redis, keys, settings)
    return {"overview": overview, "metrics": snapshot_json(await read_metrics(redis, keys))}


def snapshot_json(snapshot: MetricsSnapshot) -> dict[str, Any]:
    """The snapshot as plain JSON: the last bucket bound (infinity) is written "+Inf", as
    Prometheus does, because JSON has no infinity."""
    data = dataclasses.asdict(snapshot)
    for hist in data["latency"]:
        hist["buckets"] = [["+Inf" if math.isinf(le) else le, n] for le, n in hist["buckets"]]
    return data


# --- text --------------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns two spaces apart; the last column is not padded (it may be long)."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    lines = []
    for row in [list(headers), *rows]:
        cells = [c.ljust(w) for c, w in zip(row[:-1], widths, strict=False)]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return lines


def seconds_text(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1:
        return f"{value * 1000:.0f}ms"
    if value < 60:
        return f"{value:.1f}s"
    if value < 3600:
        return f"{int(value // 60)}m{int(value % 60):02d}s"
    return f"{int(value // 3600)}h{int(value % 3600 // 60):02d}m"


def bytes_text(value: int) -> str:
    if value <= 0:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def used_of(used: float, limit: float) -> str:
    """`3/5` against a limit; just `3` where there is none (0 = unlimited)."""
    return f"{used:g}/{limit:g}" if limit else f"{used:g}"


def quantile_bound(buckets: Sequence[Sequence[Any]], count: int, q: float) -> str:
    """The upper bound of the bucket the q-quantile falls in (`<=0.5s`), from cumulative
    counts: a histogram says no more than that."""
    if count == 0:
        return "-"
    finite = [le for le, _ in buckets if le != "+Inf"]
    for le, n in buckets:
        if n >= q * count:
            if le == "+Inf":
                return f">{finite[-1]:g}s" if finite else "-"
            return f"<={le:g}s"
    return "-"


def render_workers(workers: list[dict[str, Any]]) -> list[str]:
    lines = [f"WORKERS ({len(workers)})"]
    if not workers:
        return [*lines, "  (no live worker)"]
    rows = [
        [
            w["id"] + (" (stopping)" if w["stopping"] else ""),
            w["base_model"],
            w["device"],
            seconds_text(w["heartbeat_age_s"]),
            str(w["owned"]),
            str(len(w["resident"])),
            str(w["ops_done"]),
            bytes_text(w["memory_bytes"]),
            bytes_text(w.get("device_memory_bytes", 0)),
            w["current_op"] or "-",
        ]
        for w in sorted(workers, key=lambda w: (w["base_model"], w["id"]))
    ]
    headers = [
        "id",
        "base model",
        "device",
        "heartbeat",
        "owned",
        "resident",
        "ops done",
        "memory",
        "gpu memory",
        "current op",
    ]
    return lines + ["  " + line for line in table(headers, rows)]


def render_queues(queues: list[dict[str, Any]]) -> list[str]:
    depth = sum(q["depth"] for q in queues)
    lines = [f"QUEUES ({plural(len(queues), 'model')}, {plural(depth, 'op')} unfinished)"]
    if not queues:
        return [*lines, "  (nothing queued)"]
    rows = [
        [
            q["model_id"],
            q["tenant_id"],
            q["kind"],
            q["base_model"],
            str(q["depth"]),
            seconds_text(q["oldest_wait_s"]),
            q["owner"] or "-",
            q["state"] + (f": {q['reason']}" if q["reason"] else ""),
        ]
        for q in sorted(queues, key=lambda q: (-(q["oldest_wait_s"] or 0), q["model_id"]))
    ]
    headers = ["model", "tenant", "kind", "base model", "depth", "oldest wait", "owner", "state"]
    return lines + ["  " + line for line in table(headers, rows)]


def render_tenants(tenants: list[dict[str, Any]]) -> list[str]:
    lines = [f"TENANTS ({len(tenants)}; in use/limit, no limit shown when unlimited)"]
    if not tenants:
        return [*lines, "  (none)"]
    rows = []
    for t in sorted(tenants, key=lambda t: t["tenant_id"]):
        limits = t["limits"]
        level = t["tokens_level"]
        rows.append(
            [
                t["tenant_id"],
                used_of(t["training_runs"], limits["training_runs"]),
                used_of(t["inflight_ops"], limits["inflight_ops"]),
                f"{limits['tokens_per_s']:g}" if limits["tokens_per_s"] else "-",
                f"{level:.0f}" if level is not None else "-",
                ", ".join(t["paused_models"]) or "-",
            ]
        )
    headers = [
        "tenant",
        "training runs",
        "inflight ops",
        "tokens/s limit",
        "token bucket",
        "paused models",
    ]
    return lines + ["  " + line for line in table(headers, rows)]


def render_ops(metrics: dict[str, Any]) -> list[str]:
    counts: dict[str, dict[str, int]] = {}
    for op in metrics["ops"]:
        counts.setdefault(op["kind"], {})[op["status"]] = op["count"]
    latency = {h["kind"]: h for h in metrics["latency"]}
    tokens: dict[str, int] = metrics["tokens"]
    kinds = sorted(set(counts) | set(latency) | set(tokens))
    total_tokens = sum(tokens.values())
    lines = [f"OPS (since the deployment began; {total_tokens} tokens)"]
    if not kinds:
        return [*lines, "  (no op finished yet)"]
    statuses = _status_columns(counts)
    rows = [
        _op_row(
            kind,
            [counts.get(kind, {}).get(s, 0) for s in statuses],
            latency.get(kind, {"buckets": [], "count": 0, "sum_s": 0.0}),
            tokens.get(kind, 0),
        )
        for kind in kinds
    ]
    headers = ["kind", *statuses, "mean latency", "p50", "p95", "tokens"]
    lines += ["  " + line for line in table(headers, rows)]
    if metrics["tenant_tokens"]:
        per_tenant = ", ".join(f"{t} {n}" for t, n in sorted(metrics["tenant_tokens"].items()))
        lines.append(f"  tokens by tenant: {per_tenant}")
    return lines


def _status_columns(counts: dict[str, dict[str, int]]) -> list[str]:
    """Every status any kind has, done and failed first, the rest by name."""
    return sorted(
        {s for c in counts.values() for s in c},
        key=lambda s: (s not in ("done", "failed"), s != "done", s),
    )


def _op_row(kind: str, counts: list[int], hist: dict[str, Any], tokens: int) -> list[str]:
    """One kind's line: its count in each status, its latency and its tokens."""
    n = hist["count"]
    return [
        kind,
        *(str(count) for count in counts),
        seconds_text(hist["sum_s"] / n) if n else "-",
        quantile_bound(hist["buckets"], n, 0.5),
        quantile_bound(hist["buckets"], n, 0.95),
        str(tokens),
    ]


def render(status: dict[str, Any]) -> str:
    """The whole status screen from `read_status`'s JSON form."""
    overview = status["overview"]
    sections = [
        render_workers(overview["workers"]),
        render_queues(overview["queues"]),
        render_tenants(overview["tenants"]),
        render_ops(status["metrics"]),
    ]
    return "\n\n".join("\n".join(section) for section in sections)


# --- the command -------------------------------------------------------------------------------


async def run_status(settings: Settings, *, as_json: bool, watch_s: float | None) -> int:
    """Print the status once, or every `watch_s` seconds until interrupted (Ctrl-C)."""
    redis = connect(settings.redis_url or "")
    keys = Keys(settings.key_prefix)
    tty = sys.stdout.isatty()
    try:
        while True:
            status = await read_status(redis, keys, settings)
            if as_json:
                # Watching: one JSON document per line, so a pipe can read them one by one.
                print(json.dumps(status, indent=None if watch_s else 2), flush=True)
            elif watch_s is None:
                print(render(status), flush=True)
            else:
                stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                head = f"queue_tinker status, {stamp}, every {watch_s:g}s (Ctrl-C stops)\n\n"
                # On a terminal, redraw in place; into a pipe, append with a blank line between.
                print((CLEAR_SCREEN if tty else "\n") + head + render(status), flush=True)
            if watch_s is None:
                return 0
            await asyncio.sleep(watch_s)
    finally:
        await redis.aclose()
