"""Run a command with a real Redis and Postgres beside it: the ones at the benchmarks' default
URLs when they answer, else the embedded ones (`queue_tinker.local.embedded`), started here and
stopped after. For a machine that has neither, such as a lent GPU machine:

    python -m bench.with_services -- python -m bench.sampling_engine --device cuda

The command gets QT_BENCH_REDIS_URL and QT_BENCH_DATABASE_URL, which every service benchmark
reads; its exit code is this one's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

if __package__ in (None, ""):  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness.services import DEFAULT_POSTGRES, DEFAULT_REDIS
from queue_tinker.local.embedded import EmbeddedPostgres, EmbeddedRedis, answers


def main(argv: list[str]) -> int:
    command = argv[argv.index("--") + 1 :] if "--" in argv else argv
    if not command:
        print(__doc__, file=sys.stderr)
        return 2
    env = dict(os.environ)
    with ExitStack() as stack:
        # Not under pytest's or a user's tmp: as root, pgserver runs Postgres as its own user.
        data = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="qt-services-")))
        data.chmod(0o755)
        if "QT_BENCH_REDIS_URL" not in env:
            redis_url = DEFAULT_REDIS
            if not answers("127.0.0.1", 6379):
                redis_url = stack.enter_context(EmbeddedRedis(data / "redis"))
            env["QT_BENCH_REDIS_URL"] = redis_url
        if "QT_BENCH_DATABASE_URL" not in env:
            postgres_url = DEFAULT_POSTGRES
            if not answers("127.0.0.1", 5432):
                postgres_url = stack.enter_context(EmbeddedPostgres(data / "postgres"))
            env["QT_BENCH_DATABASE_URL"] = postgres_url
        print(
            f"services: redis {env['QT_BENCH_REDIS_URL']}, postgres {env['QT_BENCH_DATABASE_URL']}",
            flush=True,
        )
        return subprocess.run(command, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
