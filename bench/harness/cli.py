"""The command-line options benchmarks share, each said once: where the services are, where the
report goes, a smoke run and what it shrinks, where models are built, torch's threads and
device; and a benchmark's own numeric knobs, declared as data."""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.harness.report import DOCS
from bench.harness.services import postgres_url, redis_url


def parser(
    prog: str,
    doc: str | None,
    *,
    knobs: Mapping[str, Knob] | None = None,
    quick: str | None = "smoke run",
    services: bool = False,
    data_dir: bool = False,
    report: bool = True,
) -> argparse.ArgumentParser:
    """A benchmark's parser, its module docstring as the help, with the options benchmarks
    share: the services' URLs (by default what bench.with_services or the suite set),
    --data-dir, its numeric `knobs`, --quick (`quick`: what the smoke run does; None: no smoke
    run), and where the report goes (--json: the raw results too)."""
    parser = argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if services:
        parser.add_argument("--redis-url", default=redis_url())
        parser.add_argument(
            "--postgres-url",
            default=postgres_url(),
            help="admin URL; a scratch database is created beside it",
        )
    if data_dir:
        parser.add_argument(
            "--data-dir",
            type=Path,
            default=None,
            help="where models are built and checkpoints and logs go (default: a temp dir); "
            "reuse one to skip building the 100M model again",
        )
    for flag, (default, help_text) in (knobs or {}).items():
        parser.add_argument(flag, type=type(default), default=default, help=help_text)
    if quick is not None:
        parser.add_argument("--quick", action="store_true", help=f"{quick}, docs left alone")
    if report:
        parser.add_argument("--docs", type=Path, default=DOCS, help="where to write the results")
        parser.add_argument("--no-docs", action="store_true", help="leave docs/benchmarks.md alone")
        parser.add_argument("--json", type=Path, default=None, help="also write raw results here")
    return parser


Knob = tuple[int | float, str]  # a numeric option's default (its type is the option's) and help


def parse(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    quick: Mapping[str, Any] | None = None,
) -> argparse.Namespace:
    """The parsed command line; with --quick, the `quick` values replace the parsed ones and
    the docs are left alone."""
    args = parser.parse_args(argv)
    if getattr(args, "quick", False):
        for name, value in (quick or {}).items():
            setattr(args, name, value)
        args.no_docs = True
    return args


def add_batch(parser: argparse.ArgumentParser, flag: str, default: tuple[int, int]) -> None:
    """A batch shape: how many datums of how many tokens."""
    parser.add_argument(
        flag, type=int, nargs=2, default=list(default), metavar=("DATUMS", "TOKENS")
    )


def add_models(
    parser: argparse.ArgumentParser, models: Iterable[str], default: Iterable[str]
) -> None:
    """--models: which of the benchmark's models to run."""
    parser.add_argument("--models", nargs="+", default=list(default), choices=list(models))


def add_torch(parser: argparse.ArgumentParser) -> None:
    """--threads and --device of a benchmark that computes in its own process too."""
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads on every side (OMP_NUM_THREADS for the worker)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="the worker's and this process's device (cuda: bf16, its own docs section)",
    )


@contextlib.contextmanager
def data_dir(given: Path | None, prefix: str) -> Iterator[Path]:
    """`given` (made if missing), or a temporary directory removed afterwards."""
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)
