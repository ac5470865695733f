"""Every benchmark, one command: `python -m bench` runs them in sequence, each writing its own
section of docs/benchmarks.md, then heads the page with the machine they ran on.

Each benchmark runs as its own process (`python -m bench.<module> ...`), so one that fails is
reported and the rest still run; the exit status says whether all of them passed. The models
are built once, in a data directory the benchmarks share.

    .venv/bin/python -m bench                     # the full run (about 25 minutes on 2 cores)
    .venv/bin/python -m bench --quick             # smoke run of every benchmark, docs left alone
    .venv/bin/python -m bench --only train_throughput mfu
    .venv/bin/python -m bench --only moe
    .venv/bin/python -m bench --only soak         # not in the default set (5 minutes of load)
    .venv/bin/python -m bench --only memory       # not in the default set (25 minutes of CPU)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.harness import cli
from bench.harness.machine import gpu_name, machine, now
from bench.harness.report import DOCS, reproduce, write_block
from bench.harness.services import POSTGRES_ENV, REDIS_ENV, REPO

COMMAND = ".venv/bin/python -m bench"
DATA_DIR = "{data_dir}"  # stands for the shared data directory in a benchmark's arguments


@dataclass(frozen=True)
class Bench:
    """One benchmark: its module, its arguments for a full and for a quick run, and about how
    long its full run takes on a quiet 2-core machine (from the runs recorded in the docs)."""

    name: str
    module: str
    full: tuple[str, ...]
    quick: tuple[str, ...]
    estimate_s: int
    what: str
    default: bool = True  # part of a run without --only


DATA = ("--data-dir", DATA_DIR)  # the benchmarks that share the built models
QUICK = ("--quick",)
# name, module, the full run's arguments, the quick run's, about how long a full run takes (s),
# what it measures; the ones marked False are left out of a run without --only.
BENCHES: tuple[Bench, ...] = tuple(
    Bench(*row) for row in (
        ("queue", "bench.queue_overhead", (), QUICK, 75,
         "queue overhead: trivial-op round trip p50/p99, ops/s, rq baseline"),
        ("train_step", "bench.train_step", DATA, (*QUICK, *DATA), 150,
         "one training step through the service against the bare PEFT loop"),
        ("train_throughput", "bench.train_throughput", DATA, (*QUICK, *DATA), 900,
         "aggregate training tokens/s of 1-16 models: batched, one at a time, a process each"),
        # Its quick run on the tiny model alone: at 100M even a smoke run takes minutes.
        ("sampling", "bench.sampling", (), (*QUICK, "--models", "queue-tinker/tiny-llama"), 420,
         "sampling tokens/s against transformers' generate()"),
        ("sampling_engine", "bench.sampling_engine", (), QUICK, 240,
         "sampling engine: staggered arrivals, num_samples sharing, fair turns with training"),
        ("sample_cache", "bench.sample_cache", (), QUICK, 150,
         "long samples under a KV-cache budget: peak cache, RSS and time against none"),
        ("prefix_cache", "bench.prefix_cache", (), QUICK, 240,
         "sampling: the prefix cache and chunked prefill against the same loop without them"),
        ("gateway", "bench.gateway_round_trip", DATA, (*QUICK, *DATA), 120,
         "a training round trip through the official SDK and the gateway vs the client"),
        ("small_op", "bench.small_op", (), QUICK, 45,
         "a 2-token forward's round trip against the queue's trivial op, and where it goes"),
        ("big_bodies", "bench.big_bodies", (), QUICK, 60,
         "another tenant's small requests while one sends ten 57 MiB bodies"),
        ("moe", "bench.moe", (), QUICK, 100,
         "a LoRA step of the tiny mixture of experts against the dense model of its active size"),
        ("checkpoints", "bench.checkpoint_storage", (), QUICK, 120,
         "checkpoint save and load, time and bytes: an S3 object store against local disk, 100M"),
        ("mfu", "bench.mfu", ("--device", "cuda"), QUICK, 180,
         "LoRA forward_backward tokens/s and MFU on a Llama-3.1-8B shape (CUDA only)"),
        ("decode_step", "bench.decode_step", (), QUICK, 60,
         "the sampler's decode step (padded, slots, CUDA graphs) against the memory floor and "
         "generate() (a Llama-3.1-8B shape on CUDA)", False),
        ("memory", "bench.memory", (), QUICK, 1500,
         "peak RSS and step time of one forward_backward at 2k-32k tokens, 128k vocabulary",
         False),
        ("protocol", "bench.protocol_wire", (), QUICK, 90,
         "zstd forward_backward bodies and batched sample polling, on against off", False),
        ("soak", "bench.soak", ("--minutes", "5", "--clients", "20", "--models", "50"),
         ("--minutes", "0.5", "--clients", "4", "--models", "8", "--max-slope", "1000",
          "--no-docs"), 330,
         "many clients over many models for minutes: nothing stuck, lost or leaked", False),
    )
)  # fmt: skip

NAMES = [b.name for b in BENCHES]


def chosen(args: argparse.Namespace) -> list[Bench]:
    if args.only:
        return [b for b in BENCHES if b.name in args.only]
    return [b for b in BENCHES if b.default]


def command(bench: Bench, quick: bool, data_dir: Path, cuda: bool) -> list[str] | None:
    """The benchmark's command line, or None when it cannot run here (mfu for real without a
    GPU; its quick run smoke-tests the code path on the CPU instead)."""
    if bench.name == "mfu" and not cuda and not quick:
        return None
    argv = [str(data_dir) if a == DATA_DIR else a for a in (bench.quick if quick else bench.full)]
    return [sys.executable, "-m", bench.module, *argv]


# --- the page's head ---------------------------------------------------------------------------
def header(info: dict[str, str], took: dict[str, float], failed: list[str], total_s: float) -> str:
    """The top of docs/benchmarks.md: the command, the machine, what ran and for how long."""
    ran = ", ".join(f"{name} {seconds / 60:.1f} min" for name, seconds in took.items())
    default = [b for b in BENCHES if b.default]
    soak = next(b for b in BENCHES if b.name == "soak")
    return "\n".join(
        [
            "# Benchmarks",
            "",
            "Every section below is written by one command, run from the repository root with "
            "Redis on 127.0.0.1:6379 and Postgres on 127.0.0.1:5432 (`--redis-url` / "
            "`--postgres-url` point elsewhere):",
            "",
            *reproduce(COMMAND),
            "",
            "It runs " + "; ".join(f"`{b.name}` ({b.what})" for b in default) + ". Each section "
            "names its own command, to rerun that part alone, and the machine it ran on; `--only "
            "NAME ...` reruns chosen ones through the suite, `--quick` smoke-runs them all and "
            f"leaves this file alone. The {soak.estimate_s // 60}-minute soak is not in the "
            "default set (`--only soak` runs it), and `mfu` needs a CUDA GPU: without one its "
            "section says so. Full run: about "
            f"{sum(b.estimate_s for b in default if b.name != 'mfu') / 60:.0f} minutes on a quiet "
            "2-core machine, plus a few for `mfu` on a GPU.",
            "",
            "Last full run: "
            + ", ".join(f"{k} {v}" for k, v in info.items())
            + f". It took {total_s / 60:.1f} min ({ran})"
            + (f"; **failed: {', '.join(failed)}**" if failed else "; every benchmark passed")
            + ".",
            "",
        ]
    )


def write_header(path: Path, head: str) -> None:
    """Replace what comes before the first `## ` section with `head`."""
    text = path.read_text() if path.exists() else ""
    start = text.find("\n## ")
    rest = text[start + 1 :] if start >= 0 else ""
    path.write_text(head.rstrip("\n") + "\n\n" + rest)


def mfu_not_measured(path: Path) -> None:
    """Without a GPU, the MFU section's block says so, unless it holds numbers of a GPU run."""
    from bench.mfu import NOT_MEASURED, SECTION, not_measured_block

    text = path.read_text() if path.exists() else ""
    start = text.find(SECTION + "\n")
    if start >= 0 and NOT_MEASURED not in text[start : text.find("\n## ", start + 1)]:
        return
    write_block(
        path, SECTION, not_measured_block("no CUDA GPU on the machine of the last full run")
    )


# --- main --------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    quick = "smoke run of every chosen benchmark"
    parser = cli.parser("bench", __doc__, quick=quick, report=False, services=True, data_dir=True)
    parser.add_argument(
        "--only",
        nargs="+",
        choices=NAMES,
        metavar="NAME",
        help=f"run just these ({', '.join(NAMES)})",
    )
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    return parser.parse_args(argv)


def run_one(bench: Bench, argv: list[str], env: dict[str, str]) -> tuple[int, float]:
    print(f"\n=== {bench.name}: {' '.join(argv[1:])}", flush=True)
    began = time.perf_counter()
    code = subprocess.run(argv, cwd=REPO, env=env, check=False).returncode
    seconds = time.perf_counter() - began
    outcome = "ok" if code == 0 else f"exit {code}"
    print(f"=== {bench.name}: {outcome} in {seconds:.0f} s", flush=True)
    return code, seconds


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for b in BENCHES:
            extra = "" if b.default else " (not in the default set)"
            print(f"{b.name:<18}~{b.estimate_s / 60:.0f} min  {b.what}{extra}")
        return 0
    began = time.perf_counter()
    import torch  # not at the top: --list needs no torch

    cuda = torch.cuda.is_available()
    urls = {REDIS_ENV: args.redis_url, POSTGRES_ENV: args.postgres_url}
    env = {**os.environ, **urls, "PYTHONUNBUFFERED": "1"}
    took: dict[str, float] = {}
    failed: list[str] = []
    with cli.data_dir(args.data_dir, "qt-bench-suite-") as data_dir:
        for bench in chosen(args):
            argv_ = command(bench, args.quick, data_dir, cuda)
            if argv_ is None:
                print(f"\n=== {bench.name}: skipped, no CUDA GPU", flush=True)
                if not args.quick:
                    mfu_not_measured(DOCS)
                continue
            code, took[bench.name] = run_one(bench, argv_, env)
            if code != 0:
                failed.append(bench.name)
    total_s = time.perf_counter() - began
    if not args.quick and not args.only:
        info = machine(args.redis_url, args.postgres_url, packages=("torch",))
        del info["date"]  # the GPU first, then the date the run ended
        info.update(GPU=gpu_name(), date=now())
        write_header(DOCS, header(info, took, failed, total_s))
    outcome = f"failed: {', '.join(failed)}" if failed else "all passed"
    print(f"\nsuite: {len(took)} ran in {total_s / 60:.1f} min; {outcome}", flush=True)
    return 1 if failed else 0
