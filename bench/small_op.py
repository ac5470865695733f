"""A small op's fixed cost: a `forward` of 1 datum x 2 tokens on tiny-llama through the Python
client, against the queue's trivial op (`TrainingClient.ping`: no model work) on a queue-only
worker as bench.queue_overhead runs it, and on the LoRA worker itself, in one run: blocks of
sequential ops of each kind, in turn, so drift hits them alike; each op split at the Redis-clock
times the scripts write (pick-up, on the worker). How: the `## Small op` section of
docs/benchmarks.md.

    .venv/bin/python -m bench.small_op            # the full run (about a minute)
    .venv/bin/python -m bench.small_op --quick    # a smoke run, docs left alone
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from bench.harness import cli
from bench.harness.data import RANK, datums, token_rows
from bench.harness.report import Report, Table, Target, docs_of, emit
from bench.harness.run import Run, service_run
from bench.harness.services import service_client
from bench.harness.stats import STAGE_NAMES, LatencyResult, Sample
from bench.harness.workers import lora_worker, running_workers
from bench.queue_overhead import summarise
from queue_tinker.client import TrainingClient
from queue_tinker.queue.keys import Keys

SECTION = "## Small op: a 2-token forward against the trivial op"
COMMAND = ".venv/bin/python -m bench.small_op"
MODEL = "queue-tinker/tiny-llama"
TARGET_RATIO = 3.0  # a small forward's round trip against the trivial op's (p50)
KNOBS = {
    "--blocks": (8, "blocks of each kind, in turn"),
    "--block": (50, "sequential ops a block"),
    "--warmup": (50, "ops of each kind first, not measured"),
}
TRIVIAL, TRIVIAL_LORA, FORWARD = (
    "trivial op (queue-only worker, as bench.queue_overhead)",
    "trivial op (the LoRA worker)",
    "`forward`, 1 datum x 2 tokens (the LoRA worker)",
)


@dataclass
class Kind:
    """One kind of op: its client, its keys, the call that makes one op, its samples."""

    name: str
    client: TrainingClient
    keys: Keys
    call: Callable[[TrainingClient, int], object]
    samples: list[Sample] = field(default_factory=list)

    def run(self, ops: int, measured: bool = True) -> None:
        for i in range(ops):
            wall, t0 = time.time(), time.perf_counter()
            future = self.call(self.client, i)
            t1 = time.perf_counter()
            future.result(timeout=60)  # type: ignore[attr-defined]
            if measured:
                request_id = future.request_id  # type: ignore[attr-defined]
                self.samples.append(Sample(request_id, wall, t1 - t0, time.perf_counter() - t0))


def ping(client: TrainingClient, i: int) -> object:
    return client.ping(i)


def forward_of(data: list[object]) -> Callable[[TrainingClient, int], object]:
    def forward(client: TrainingClient, _: int) -> object:
        return client.forward(data, "cross_entropy")  # type: ignore[arg-type]

    return forward


@contextlib.contextmanager
def busy_cores(on: bool) -> Iterator[None]:
    """Meanwhile (`on`) a lowest-priority spinning process per core, so no core halts while
    the ops wait on each other: what a round trip costs when waking an idle core costs
    nothing. They take a core only when nothing else wants it (nice 19)."""
    spinners = [
        subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 1)
        if on
    ]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    data = datums(token_rows(1, 2))
    with (
        service_run(args, ("torch",), "qt-bench-small-op-") as run,
        run.deployment("small-op-queue") as queue_settings,
        run.deployment("small-op-lora") as lora_settings,
        running_workers(queue_settings, 1, run.data_dir, "small-op"),
        lora_worker(lora_settings, MODEL, run.data_dir / "lora-worker.log"),
        service_client(queue_settings) as queue_service,
        service_client(lora_settings) as lora_service,
    ):
        queue_only = queue_service.create_lora_training_client("tiny")
        trainer = lora_service.create_lora_training_client(MODEL, rank=RANK, seed=0)
        queue_keys, lora_keys = Keys(queue_settings.key_prefix), Keys(lora_settings.key_prefix)
        kinds = [
            Kind(TRIVIAL, queue_only, queue_keys, ping),
            Kind(TRIVIAL_LORA, trainer, lora_keys, ping),
            Kind(FORWARD, trainer, lora_keys, forward_of(list(data))),
        ]
        with busy_cores(args.busy_cores):
            for kind in kinds:
                kind.run(args.warmup, measured=False)
            for block in range(args.blocks):
                print(f"[block {block + 1}/{args.blocks}]", flush=True)
                for kind in kinds if block % 2 == 0 else kinds[::-1]:
                    kind.run(args.block)
        results = {k.name: summarise(args.redis_url, k.keys, k.samples) for k in kinds}
    docs = None if args.busy_cores else docs_of(args)  # the docs show the machine as it is
    emit(report(args, run, results), docs, args.json)
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser("bench.small_op", __doc__, knobs=KNOBS, services=True, data_dir=True)
    parser.add_argument(
        "--busy-cores",
        action="store_true",
        help="keep every core busy with a nice-19 spinner meanwhile (no core halts between "
        "ops); the docs section is left alone",
    )
    args = cli.parse(parser, argv, quick={"blocks": 2, "block": 10, "warmup": 5})
    if args.blocks < 1 or args.block < 1:
        parser.error("--blocks and --block must be at least 1")
    return args


def report(args: argparse.Namespace, run: Run, results: dict[str, LatencyResult]) -> Report:
    trivial, forward = results[TRIVIAL].latency.p50, results[FORWARD].latency.p50
    ratio = forward / trivial
    facts = [
        f"`{MODEL}`, rank {RANK}, one LoRA worker (`--engine lora --device cpu`, production "
        "defaults) and one queue-only worker; "
        f"{args.warmup} warm-up ops of each kind, then {args.blocks} blocks of {args.block} "
        "sequential ops of each kind, in turn (the order reversed every other block).",
        f"The run took {run.total_s:.0f} s; the client, the workers, Redis and Postgres share "
        "its cores"
        + ("; a nice-19 spinner kept each core busy meanwhile." if args.busy_cores else "."),
    ]
    targets = [
        Target(
            f"a 2-token `forward` round trip ≤ {TARGET_RATIO:g}× the trivial op's (p50)",
            f"{forward:.2f} / {trivial:.2f} ms = {ratio:.2f}×",
            ratio <= TARGET_RATIO,
        )
    ]
    rows = []
    for name, result in results.items():
        lat, stages = result.latency, result.stages.medians_ms()
        split = [stages.get(stage, float("nan")) for stage in STAGE_NAMES]
        figures = (lat.p50, lat.p90, lat.p99, lat.mean, *split)
        rows.append((name, len(lat.samples), *(f"{v:.2f}" for v in figures)))
    stage_columns = ["submit call", "-> queued", "pick-up", "on the worker", "-> in hand"]
    table = Table(
        ["op", "ops", "p50 ms", "p90 ms", "p99 ms", "mean ms", *stage_columns],
        rows,
        caption="Round trip per op, and where it goes (medians, ms; stages from the Redis "
        "clock: an op a worker runs inline, as the trivial op, is marked started and finished "
        "by its publish, so its pick-up holds its execution):",
    )
    results_dict = {
        "ratio_p50": ratio,
        "ops": {
            name: {"latency": r.latency.summary(), "stages_p50_ms": r.stages.medians_ms()}
            for name, r in results.items()
        },
    }
    return Report(SECTION, COMMAND, run.info, facts, targets, [table], results_dict)


if __name__ == "__main__":
    sys.exit(main())
