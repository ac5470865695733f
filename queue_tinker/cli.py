"""`queue-tinker` command line: one subcommand per way of running the service."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from queue_tinker.settings import Settings, load_settings


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
        print("QT_DATABASE_URL is not set (use `queue-tinker up` for the embedded stack)",
              file=sys.stderr)
        return 2
    if args.downgrade:
        downgrade(settings.database_url, args.revision or "base")
    else:
        upgrade(settings.database_url, args.revision or "head")
    return 0


def _cmd_worker(args: argparse.Namespace, settings: Settings) -> int:
    from workers.main import run_worker

    return run_worker(settings, base_model=args.base_model, device=args.device,
                      engine=args.engine)


def _cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    from queue_tinker.gateway.serve import serve

    return serve(settings, host=args.host, port=args.port)


def _cmd_housekeeper(args: argparse.Namespace, settings: Settings) -> int:
    from queue_tinker.housekeeping import run_housekeeper

    return run_housekeeper(settings, sweep_interval_s=args.sweep_interval)


def _cmd_up(args: argparse.Namespace, settings: Settings) -> int:
    from queue_tinker.up import run_up

    return run_up(settings, base_model=args.base_model, device=args.device, workers=args.workers)


def _cmd_keys(args: argparse.Namespace, settings: Settings) -> int:
    import asyncio

    from queue_tinker.keys_cli import run_keys

    if not settings.database_url:
        print("QT_DATABASE_URL is not set (use `queue-tinker up` for the embedded stack)",
              file=sys.stderr)
        return 2
    return asyncio.run(run_keys(settings.database_url, args))


def _cmd_demo(args: argparse.Namespace, settings: Settings) -> int:
    from queue_tinker.demo import run_demo

    return run_demo(settings, steps=args.steps, seed=args.seed)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="queue-tinker", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("config", help="print the effective settings").set_defaults(fn=_cmd_config)

    migrate = sub.add_parser("migrate", help="apply alembic migrations to QT_DATABASE_URL")
    migrate.add_argument("--revision", default=None, help="target revision (default head/base)")
    migrate.add_argument("--downgrade", action="store_true", help="downgrade instead")
    migrate.set_defaults(fn=_cmd_migrate)

    worker = sub.add_parser("worker", help="run a worker that serves one base model")
    worker.add_argument("--base-model", required=True, help="Hub id or local path")
    worker.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    worker.add_argument(
        "--engine", default="lora", choices=["lora", "queue-only"],
        help="lora: train and sample (needs the worker extra); queue-only: create_model and "
        "ping only, for queue tests and benchmarks",
    )
    worker.set_defaults(fn=_cmd_worker)

    serve = sub.add_parser("serve", help="run the HTTP gateway")
    serve.add_argument("--host", default=None)
    serve.add_argument("--port", type=int, default=None)
    serve.set_defaults(fn=_cmd_serve)

    housekeeper = sub.add_parser(
        "housekeeper", help="run the rq housekeeper: expires checkpoints past their TTL"
    )
    housekeeper.add_argument("--sweep-interval", type=float, default=60.0, metavar="SECONDS",
                             help="how often to sweep Postgres for expired checkpoints")
    housekeeper.set_defaults(fn=_cmd_housekeeper)

    up = sub.add_parser("up", help="embedded Redis + Postgres, migrations, gateway and workers")
    up.add_argument("--base-model", default="queue-tinker/tiny-llama",
                    help="base model the worker serves")
    up.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    up.add_argument("--workers", type=int, default=1)
    up.set_defaults(fn=_cmd_up)

    keys = sub.add_parser("keys", help="API keys (tml-...) of tenants: create, list, revoke")
    keys_sub = keys.add_subparsers(dest="action", required=True)
    create = keys_sub.add_parser("create", help="make a key (printed once, stored hashed)")
    create.add_argument("--tenant", required=True, help="tenant id (created on its first key)")
    create.add_argument("--name", default=None, help="a note to tell keys apart")
    listing = keys_sub.add_parser("list", help="list keys (never the keys themselves)")
    listing.add_argument("--tenant", default=None, help="only this tenant's keys")
    revoke = keys_sub.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("key_id", help="the id `keys list` shows (key-...)")
    keys.set_defaults(fn=_cmd_keys)

    demo = sub.add_parser("demo", help="run the service on the embedded default and drive it")
    demo.add_argument("--steps", type=int, default=100, help="training steps")
    demo.add_argument("--seed", type=int, default=0, help="LoRA initialisation seed")
    demo.set_defaults(fn=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    fn: Callable[[argparse.Namespace, Settings], int] = args.fn
    return fn(args, load_settings())


if __name__ == "__main__":
    sys.exit(main())
