"""One run of a service benchmark: its clock, the machine line it prints first, its data
directory (`--data-dir`, or a temporary one) and its scratch database, dropped at the end."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.cli import data_dir
from bench.harness.machine import announce, machine
from bench.harness.services import deployment, make_settings, scratch_database
from bench.harness.workers import worker_threads
from queue_tinker.settings import Settings

TORCH = ("torch", "transformers", "peft")  # the packages a torch benchmark's machine line names


@dataclass(frozen=True)
class Run:
    info: dict[str, str]  # the machine, as the report prints it
    data_dir: Path  # models, checkpoints and logs
    redis_url: str
    database_url: str  # the run's scratch database
    began: float  # perf_counter() at the start

    @property
    def total_s(self) -> float:
        return time.perf_counter() - self.began

    def deployment(
        self, part: str, data_dir: Path | None = None, **changes: Any
    ) -> AbstractContextManager[Settings]:
        """Settings for one part of the run on a fresh key prefix (services.deployment)."""
        return deployment(
            self.redis_url, self.database_url, part, data_dir or self.data_dir, **changes
        )

    def worker_threads(self) -> dict[str, int]:
        """The torch threads a worker of this run computes with (workers.worker_threads)."""
        return worker_threads(
            make_settings(self.redis_url, self.database_url, "qt-bench-probe", self.data_dir)
        )


@contextmanager
def service_run(args: argparse.Namespace, packages: Sequence[str], prefix: str) -> Iterator[Run]:
    """The run of a benchmark whose options include the services' URLs (and maybe --data-dir);
    `packages` go into its machine line, `prefix` names its temporary directory."""
    began = time.perf_counter()
    info = announce(machine(args.redis_url, args.postgres_url, packages))
    with (
        data_dir(getattr(args, "data_dir", None), prefix) as directory,
        scratch_database(args.postgres_url) as database_url,
    ):
        yield Run(info, directory, args.redis_url, database_url, began)
