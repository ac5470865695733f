"""`queue-tinker` command line: one subcommand per way of running the service."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from queue_tinker.extras import extra_for
from queue_tinker.settings import Settings, load_settings, up_env, with_running_up


def _cmd_config(args: argparse.Namespace, settings: Settings) -> int:
    """Print the effective settings, with where each one comes from."""
    fields = type(settings).model_fields
    rows = {
        name: {
            "value": str(getattr(settings, name)) if getattr(settings, name) is not None else None,
            "env": f"QT_{name.upper()}",
            "description": info.description,
        }
        for name, info in fields.items()
    }
    print(json.dumps(rows, indent=2))
    return 0


def _cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    from queue_tinker.store.migrate import downgrade, upgrade

    if not settings.database_url:
        print(
            "QT_DATABASE_URL is not set (use `queue-tinker up` for the embedded stack)",
            file=sys.stderr,
        )
        return 2
    if args.wait_s is not None:
        return _wait_for_schema(args, settings.database_url)
    if args.downgrade:
        downgrade(settings.database_url, args.revision or "base")
    else:
        upgrade(settings.database_url, args.revision or "head")
    return 0


def _wait_for_schema(args: argparse.Namespace, database_url: str) -> int:
    """`migrate --wait-s S`: 0 once another process has migrated the database, 1 if it is not
    migrated within S seconds."""
    from queue_tinker.store.migrate import wait_for_schema

    if args.downgrade or args.revision:
        print(
            "queue-tinker migrate: --wait-s waits for head; it takes no --revision or --downgrade",
            file=sys.stderr,
        )
        return 2
    state = wait_for_schema(database_url, args.wait_s)
    if state.ready:
        print(state.reason)
        return 0
    print(f"after {args.wait_s:g} s: {state.reason}", file=sys.stderr)
    return 1


def _cmd_probe(args: argparse.Namespace, settings: Settings) -> int:
    """0 when the health file was touched within the bound, 1 otherwise, saying why."""
    from queue_tinker.health import default_max_age_s, judge

    if settings.health_file is None:
        print(
            "queue-tinker probe: QT_HEALTH_FILE is not set, so no process touches a health "
            "file to judge",
            file=sys.stderr,
        )
        return 2
    bound = args.max_age_s or default_max_age_s(settings.heartbeat_ms)
    verdict = judge(settings.health_file, bound)
    if verdict.healthy:
        print(f"healthy: {verdict.reason}")
        return 0
    print(f"unhealthy: {verdict.reason}", file=sys.stderr)
    return 1


def _exit_now(code: int) -> NoReturn:
    """Leave a long-running service process without the interpreter's teardown. By the time its
    run returns it has handed its work back, flushed its record and closed its connections:
    nothing is owed to anyone. Tearing down torch, transformers and peft took 1.25 s of a
    worker's 1.33 s stop on the CPU (SIGTERM to exit) and the housekeeper's imports 0.5 s, so
    `queue-tinker up` (2 s to stop before) and a fleet's rolling restarts waited for nothing."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _cmd_worker(args: argparse.Namespace, settings: Settings) -> int:
    if args.ranks > 1:
        from queue_tinker.workers.group.launcher import run_group

        if args.engine != "lora":
            print("queue-tinker worker: --ranks needs --engine lora", file=sys.stderr)
            return 2
        _exit_now(run_group(ranks=args.ranks, base_model=args.base_model, device=args.device))
    from queue_tinker.workers.main import run_worker

    _exit_now(
        run_worker(settings, base_model=args.base_model, device=args.device, engine=args.engine)
    )


def _cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    from queue_tinker.gateway.serve import serve

    return serve(settings, host=args.host, port=args.port)


def _cmd_housekeeper(args: argparse.Namespace, settings: Settings) -> int:
    from queue_tinker.services.housekeeper import run_housekeeper

    _exit_now(run_housekeeper(settings, sweep_interval_s=args.sweep_interval))


def _cmd_up(args: argparse.Namespace, settings: Settings) -> int:
    if args.env:
        env = up_env(settings.data_dir)
        if env is None:
            print(f"queue-tinker up --env: no `queue-tinker up` runs on {settings.data_dir}")
            return 1
        print(env)
        return 0
    from queue_tinker.local.up import run_up

    return run_up(settings, base_model=args.base_model, device=args.device, workers=args.workers)


def _cmd_keys(args: argparse.Namespace, settings: Settings) -> int:
    import asyncio

    from queue_tinker.cli.keys import run_keys

    if not settings.database_url:
        print(
            "QT_DATABASE_URL is not set (use `queue-tinker up` for the embedded stack)",
            file=sys.stderr,
        )
        return 2
    return asyncio.run(run_keys(settings.database_url, args))


def _redis_url(settings: Settings) -> str | None:
    """QT_REDIS_URL, or None after saying that it is missing (these commands read Redis)."""
    if not settings.redis_url:
        print("QT_REDIS_URL is not set: point it at the deployment's Redis", file=sys.stderr)
    return settings.redis_url


def _cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    import asyncio

    if not _redis_url(settings):
        return 2
    from queue_tinker.cli.status import run_status
    from queue_tinker.queue.outage import REDIS_DOWN

    try:
        return asyncio.run(run_status(settings, as_json=args.json, watch_s=args.watch))
    except KeyboardInterrupt:  # how --watch ends
        return 0
    except REDIS_DOWN as exc:  # refused, dropped or timed out
        print(f"cannot reach Redis at {settings.redis_url}: {exc}", file=sys.stderr)
        return 1


def _cmd_limits(args: argparse.Namespace, settings: Settings) -> int:
    import asyncio

    redis_url = _redis_url(settings)
    if not redis_url:
        return 2
    from queue_tinker.cli.limits import run_limits
    from queue_tinker.queue.keys import Keys

    return asyncio.run(run_limits(redis_url, Keys(settings.key_prefix), args))


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {text}")
    return value


def _add_limits_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    limits = sub.add_parser(
        "limits", help="tenants' limits (training runs, ops in flight, tokens per second)"
    )
    limits_sub = limits.add_subparsers(dest="action", required=True)
    limits_sub.add_parser("show", help="every tenant with its own limits, and the default")
    setting = limits_sub.add_parser(
        "set", help="set some limits of a tenant or of the default (others stay as they are)"
    )
    clearing = limits_sub.add_parser(
        "clear", help="remove a tenant's own limits (it gets the default's again)"
    )
    for action in (setting, clearing):
        who = action.add_mutually_exclusive_group(required=True)
        who.add_argument("--tenant", help="the tenant id")
        who.add_argument(
            "--default", action="store_true", help="the limits of every tenant without its own"
        )
    setting.add_argument(
        "--training-runs",
        type=int,
        default=None,
        metavar="N",
        help="training runs open at once (0 = unlimited)",
    )
    setting.add_argument(
        "--inflight-ops",
        type=int,
        default=None,
        metavar="N",
        help="ops running at once, over all its models (0 = unlimited)",
    )
    setting.add_argument(
        "--tokens-per-s",
        type=float,
        default=None,
        metavar="X",
        help="tokens processed per second, averaged (0 = unlimited)",
    )
    limits.set_defaults(fn=_cmd_limits)


def _cmd_demo(args: argparse.Namespace, settings: Settings) -> int:
    from queue_tinker.cli.demo import run_demo

    return run_demo(settings, steps=args.steps, seed=args.seed)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="queue-tinker", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("config", help="print the effective settings").set_defaults(fn=_cmd_config)

    migrate = sub.add_parser("migrate", help="apply alembic migrations to QT_DATABASE_URL")
    migrate.add_argument("--revision", default=None, help="target revision (default head/base)")
    migrate.add_argument("--downgrade", action="store_true", help="downgrade instead")
    migrate.add_argument(
        "--wait-s",
        type=_positive_seconds,
        default=None,
        metavar="SECONDS",
        help="migrate nothing: wait up to SECONDS until the schema is at this release's head "
        "(for a pod's init container); exit 1 if it is not by then",
    )
    migrate.set_defaults(fn=_cmd_migrate)

    worker = sub.add_parser("worker", help="run a worker that serves one base model")
    worker.add_argument("--base-model", required=True, help="Hub id or local path")
    worker.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    worker.add_argument(
        "--engine",
        default="lora",
        choices=["lora", "queue-only"],
        help="lora: train and sample (needs the worker extra); queue-only: create_model and "
        "ping only, for queue tests and benchmarks",
    )
    worker.add_argument(
        "--ranks",
        type=_positive_int,
        default=1,
        help="processes of one sharded worker group (a GPU each with --device cuda): the base "
        "model is split across them with tensor parallelism and they serve as one worker",
    )
    worker.set_defaults(fn=_cmd_worker)

    serve = sub.add_parser("serve", help="run the HTTP gateway")
    serve.add_argument("--host", default=None)
    serve.add_argument("--port", type=int, default=None)
    serve.set_defaults(fn=_cmd_serve)

    housekeeper = sub.add_parser(
        "housekeeper", help="run the rq housekeeper: expires checkpoints past their TTL"
    )
    housekeeper.add_argument(
        "--sweep-interval",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how often to sweep Postgres for expired checkpoints",
    )
    housekeeper.set_defaults(fn=_cmd_housekeeper)

    up = sub.add_parser("up", help="embedded Redis + Postgres, migrations, gateway and workers")
    up.add_argument(
        "--base-model", default="queue-tinker/tiny-llama", help="base model the worker serves"
    )
    up.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    up.add_argument("--workers", type=int, default=1)
    up.add_argument(
        "--env",
        action="store_true",
        help="start nothing: print the running `up`'s settings as export lines, for "
        '`eval "$(queue-tinker up --env)"`',
    )
    up.set_defaults(fn=_cmd_up, own_stores=True)

    keys = sub.add_parser("keys", help="API keys (tml-...) of tenants: create, list, revoke")
    keys_sub = keys.add_subparsers(dest="action", required=True)
    create = keys_sub.add_parser("create", help="make a key (printed once, stored hashed)")
    create.add_argument("--tenant", required=True, help="tenant id (created on its first key)")
    create.add_argument("--name", default=None, help="a note to tell keys apart")
    create.add_argument(
        "--admin",
        action="store_true",
        help="a key that sees every tenant on the dashboard and may drain workers",
    )
    listing = keys_sub.add_parser("list", help="list keys (never the keys themselves)")
    listing.add_argument("--tenant", default=None, help="only this tenant's keys")
    revoke = keys_sub.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("key_id", help="the id `keys list` shows (key-...)")
    keys.set_defaults(fn=_cmd_keys)

    status = sub.add_parser(
        "status", help="workers, queues, tenants' limits and op totals, read from Redis"
    )
    status.add_argument(
        "--json", action="store_true", help="print the overview and the metrics as JSON"
    )
    status.add_argument(
        "--watch",
        type=_positive_seconds,
        default=None,
        metavar="SECONDS",
        help="redraw every SECONDS until Ctrl-C",
    )
    status.set_defaults(fn=_cmd_status)

    _add_limits_parser(sub)

    probe = sub.add_parser(
        "probe",
        help="exit 0 if this container's worker or housekeeper touched QT_HEALTH_FILE "
        "recently (an exec probe), else 1, saying why",
    )
    probe.add_argument(
        "--max-age-s",
        type=_positive_seconds,
        default=None,
        metavar="SECONDS",
        help="the oldest touch that passes (default: 3 heartbeats, QT_HEARTBEAT_MS, 5 s at least)",
    )
    probe.set_defaults(fn=_cmd_probe)

    demo = sub.add_parser("demo", help="run the service on the embedded default and drive it")
    demo.add_argument("--steps", type=int, default=100, help="training steps")
    demo.add_argument("--seed", type=int, default=0, help="LoRA initialisation seed")
    demo.set_defaults(fn=_cmd_demo, own_stores=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    fn: Callable[[argparse.Namespace, Settings], int] = args.fn
    try:
        settings = load_settings()
        # `up` and `demo` start stores of their own; any other command with no Redis set
        # uses a running `up`'s, and says so.
        if not getattr(args, "own_stores", False):
            settings = with_running_up(settings)
        return fn(args, settings)
    except ModuleNotFoundError as exc:
        # Each command imports its part lazily, so a light install fails here, not at --help.
        extra = extra_for(exc.name)
        if extra is None:
            raise
        print(
            f"queue-tinker {args.command}: needs `{exc.name}`, which this install lacks: "
            f"pip install 'queue-tinker[{extra}]'",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
