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

from bench.harness.services import POSTGRES_ENV, REDIS_ENV, local_services


def main(argv: list[str]) -> int:
    command = argv[argv.index("--") + 1 :] if "--" in argv else argv
    if not command:
        print(__doc__, file=sys.stderr)
        return 2
    with local_services(dict(os.environ)) as env:
        print(f"services: redis {env[REDIS_ENV]}, postgres {env[POSTGRES_ENV]}", flush=True)
        return subprocess.run(command, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
