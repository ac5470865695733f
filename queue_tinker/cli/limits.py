"""`queue-tinker limits show|set|clear`: tenants' limits, kept in Redis where the queue reads
them (a change applies to the next op, with nothing to restart)."""

from __future__ import annotations

import argparse
import sys

from queue_tinker.cli.status import table
from queue_tinker.errors import UserInputError
from queue_tinker.queue.connection import connect
from queue_tinker.queue.control.limits import (
    DEFAULT_TENANT_KEY,
    Limits,
    clear_limits,
    list_limits,
    set_limits,
)
from queue_tinker.queue.keys import Keys


def _limit(value: float) -> str:
    return f"{value:g}" if value else "unlimited"


def _tenant_name(tenant: str) -> str:
    return "(default)" if tenant == DEFAULT_TENANT_KEY else tenant


def describe_limits(tenant: str, limits: Limits) -> str:
    return (
        f"limits of {_tenant_name(tenant)}: training runs {_limit(limits.training_runs)}, "
        f"inflight ops {_limit(limits.inflight_ops)}, "
        f"tokens/s {_limit(limits.tokens_per_s)}"
    )


def limits_table(limits: dict[str, Limits]) -> list[str]:
    """Every tenant with its own limits, the default first (it applies to all the others)."""
    order = sorted(limits, key=lambda t: (t != DEFAULT_TENANT_KEY, t))
    rows = [
        [
            _tenant_name(t),
            _limit(limits[t].training_runs),
            _limit(limits[t].inflight_ops),
            _limit(limits[t].tokens_per_s),
        ]
        for t in order
    ]
    return table(["tenant", "training runs", "inflight ops", "tokens/s"], rows)


async def run_limits(redis_url: str, keys: Keys, args: argparse.Namespace) -> int:
    redis = connect(redis_url)
    try:
        if args.action == "show":
            print("\n".join(limits_table(await list_limits(redis, keys))))
            return 0
        tenant = DEFAULT_TENANT_KEY if args.default else args.tenant
        if args.action == "clear":
            await clear_limits(redis, keys, tenant)
            print(f"cleared the limits of {_tenant_name(tenant)}", file=sys.stderr)
            return 0
        values = {
            "training_runs": args.training_runs,
            "inflight_ops": args.inflight_ops,
            "tokens_per_s": args.tokens_per_s,
        }
        if all(v is None for v in values.values()):
            print(
                "limits set: give at least one of --training-runs, --inflight-ops, --tokens-per-s",
                file=sys.stderr,
            )
            return 2
        try:
            limits = await set_limits(redis, keys, tenant, **values)
        except UserInputError as exc:
            print(exc.message, file=sys.stderr)
            return 2
        print(describe_limits(tenant, limits))
        return 0
    finally:
        await redis.aclose()
