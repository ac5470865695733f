"""`queue-tinker keys create|list|revoke`: the API keys of tenants, in Postgres."""

from __future__ import annotations

import argparse
import sys

from queue_tinker.errors import UserInputError
from queue_tinker.store import api_keys
from queue_tinker.store.db import make_engine, session_factory


async def run_keys(database_url: str, args: argparse.Namespace) -> int:
    engine = make_engine(database_url)
    sessions = session_factory(engine)
    try:
        if args.action == "create":
            try:
                info, key = await api_keys.create_key(
                    sessions, args.tenant, args.name, admin=getattr(args, "admin", False)
                )
            except UserInputError as exc:
                print(exc.message, file=sys.stderr)
                return 2
            print(key)
            kind = "admin key" if info.admin else "key"
            print(
                f"created {kind} {info.id} for tenant {info.tenant_id}; the key above is "
                "shown only now (only its hash is stored)",
                file=sys.stderr,
            )
            return 0
        if args.action == "list":
            print(
                f"{'id':<21} {'tenant':<20} {'prefix':<13} {'admin':<6} {'created':<24} "
                f"{'revoked':<24} name"
            )
            for k in await api_keys.list_keys(sessions, args.tenant):
                print(
                    f"{k.id:<21} {k.tenant_id:<20} {k.prefix:<13} "
                    f"{'yes' if k.admin else 'no':<6} "
                    f"{api_keys.utc_text(k.created_at):<24} "
                    f"{api_keys.utc_text(k.revoked_at):<24} {k.name or ''}"
                )
            return 0
        if await api_keys.revoke_key(sessions, args.key_id):
            print(f"revoked {args.key_id}", file=sys.stderr)
            return 0
        print(f"no active key {args.key_id!r}", file=sys.stderr)
        return 1
    finally:
        await engine.dispose()
