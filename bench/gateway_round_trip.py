"""Gateway round trip: the same training round trip through the official `tinker` SDK and the
HTTP gateway (`queue-tinker serve`), and through queue_tinker's own client (Redis directly).

Both doors drive one LoRA worker process (`python -m queue_tinker.cli worker --engine lora
--device cpu`, production defaults) on the same model, in the same run, with the same data,
LoRA rank and call sequence:

- client: `queue_tinker.ServiceClient(settings)`, talking to Redis directly;
- SDK: `tinker.ServiceClient(base_url=<gateway>, api_key=<tml- key>)` (SDK defaults: its own
  background event loop, long-polled `retrieve_future`, telemetry as shipped), talking HTTP to
  a `queue-tinker serve` process (uvicorn, access log at INFO) on the same Redis and Postgres.

Each door gets a fresh LoRA training client (rank 32, seed 0) per shape.

A round trip is the natural Tinker loop, `fb = tc.forward_backward(batch, "cross_entropy");
opt = tc.optim_step(adam); fb.result(); opt.result()` (both submitted before waiting on
either), or, for the "ping" shape, one `tc.forward([1 datum of 2 tokens]).result()`: the least
model work a door can carry, so what is left is the door's own cost. Shapes: ping (forward
1 x 2 tokens), small (4 x 32: queue and protocol overhead dominate), large (8 x 128).

Per shape, each door first runs its warm-up round trips, then the doors alternate one round
trip each (client, SDK, client, SDK, ...), so drift from other jobs on the machine hits both
alike and every round trip follows one of the other door. Reported per door: p50/p90/p99 and
mean ms per round trip; the ratio SDK / client; the gateway's absolute overhead per round trip
(SDK minus client: of the p50s, of the means, and the median of the per-round paired
differences, the figure drift disturbs least). Also, from the Redis-clock `queued_at` /
`started_at` / `finished_at` the queue writes into every job hash and this process's wall clock
(same host), where a round trip goes; the CPU time this process (client or SDK, all threads),
the gateway, the worker, the run's Postgres backends and Redis spent per round trip; the HTTP
requests the gateway answered per SDK round trip, from its access log; and the CPU the rest of
the machine used meanwhile (everything but this process, the gateway and the worker).

Results go to the `## Gateway: the official SDK against the Python client` section of
docs/benchmarks.md (bench/gateway_report.py renders it).

    .venv/bin/python -m bench.gateway_round_trip --out gateway_round_trip.json
    .venv/bin/python -m bench.gateway_round_trip --quick    # smoke run, docs left alone
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis
import tinker
from sqlalchemy.engine import make_url
from tinker import types as sdk_types

from bench.gateway_report import (
    CLIENT,
    NO_OP,
    SDK,
    DoorResult,
    Shape,
    ShapeResult,
    Trip,
    markdown,
    render,
    results_json,
)
from bench.harness import cli
from bench.harness.data import RANK, token_rows
from bench.harness.gateway import gateway_proc, make_key, requests_by_endpoint
from bench.harness.meters import CpuMeter, find_pids, process_cpu_s
from bench.harness.report import publish, save
from bench.harness.run import service_run
from bench.harness.services import deployment, service_client
from bench.harness.workers import lora_worker
from queue_tinker import types as qt_types
from queue_tinker.client import ServiceClient
from queue_tinker.queue.keys import Keys
from queue_tinker.settings import Settings

DEFAULT_MODEL = "queue-tinker/tiny-llama"
SEED = 0
LEARNING_RATE = 1e-4
RESULT_TIMEOUT_S = 120.0
OpTimes = tuple[float, ...]  # an op's (queued_at, started_at, finished_at), Redis clock


# --- the two doors -----------------------------------------------------------------------------
@dataclass
class Door:
    """A training client of either API with the batch and Adam params in its own types; the
    two APIs have the same method names, so one function drives both."""

    name: str
    trainer: Any  # queue_tinker.client.TrainingClient or tinker.TrainingClient
    data: list[Any]
    adam: Any


def door_data(types: Any, rows: np.ndarray) -> list[Any]:
    """The batch in one API's own types (queue_tinker's or the SDK's: the same names)."""
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(row[:-1].tolist()),
            loss_fn_inputs={
                "target_tokens": types.TensorData.from_numpy(row[1:].astype(np.int64)),
                "weights": types.TensorData.from_numpy(np.ones(len(row) - 1, dtype=np.float32)),
            },
        )
        for row in rows
    ]


def client_door(service: ServiceClient, model: str, rows: np.ndarray) -> Door:
    trainer = service.create_lora_training_client(model, rank=RANK, seed=SEED)
    data = door_data(qt_types, rows)
    return Door(CLIENT, trainer, data, qt_types.AdamParams(learning_rate=LEARNING_RATE))


def sdk_door(service: tinker.ServiceClient, model: str, rows: np.ndarray) -> Door:
    # SDK 0.38: create_lora_training_client returns a future.
    trainer = service.create_lora_training_client(base_model=model, rank=RANK, seed=SEED).result()
    data = door_data(sdk_types, rows)
    return Door(SDK, trainer, data, sdk_types.AdamParams(learning_rate=LEARNING_RATE))


def round_trip(door: Door, op: str) -> float:
    """One round trip, the same calls whichever the door; the batch loss."""
    if op == "forward":
        out = door.trainer.forward(door.data, "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
        return float(out.metrics["loss:sum"])
    # The Tinker loop: submit the optim_step before waiting on the forward_backward.
    fb = door.trainer.forward_backward(door.data, "cross_entropy")
    optim = door.trainer.optim_step(door.adam)
    out = fb.result(timeout=RESULT_TIMEOUT_S)
    optim.result(timeout=RESULT_TIMEOUT_S)
    return float(out.metrics["loss:sum"])


THIS_PROCESS = "this process"


@dataclass
class Parts:
    """The processes a round trip's CPU is counted for, by label. This process (the client or
    the SDK, all threads, their background event loops included) is read precisely; the others
    from /proc in 10 ms ticks, which add up to a fair mean over many round trips."""

    gateway: int
    worker: int
    database: str  # the run's scratch database: its Postgres backends
    others: dict[str, list[int]] = field(default_factory=dict)

    def refresh(self) -> None:
        """Look the Postgres backends and Redis up again (pools open connections lazily)."""
        self.others = {
            "gateway": [self.gateway],
            "worker": [self.worker],
            "Postgres (the run's backends)": find_pids(self.database.encode()),
            "Redis (whole server)": find_pids(b"redis-server"),
        }

    def cpu_s(self) -> dict[str, float]:
        totals = {THIS_PROCESS: time.process_time()}
        for label, pids in self.others.items():
            totals[label] = 0.0
            for pid in pids:
                with contextlib.suppress(OSError):  # a backend that has gone
                    totals[label] += process_cpu_s(pid)
        return totals


def timed_trip(door: Door, op: str, parts: Parts) -> tuple[Trip, float]:
    """One round trip with its wall time and CPU; the trip and its loss. The CPU reads sit
    outside the timed span."""
    before = parts.cpu_s()
    wall, t0 = time.time(), time.perf_counter()
    loss = round_trip(door, op)
    total = time.perf_counter() - t0
    after = parts.cpu_s()
    return Trip(wall, total, {k: after[k] - v for k, v in before.items()}), loss


# --- one shape ---------------------------------------------------------------------------------
def measure_shape(
    shape: Shape,
    doors: list[Door],
    parts: Parts,
    warmup: int,
    rounds: int,
    gateway_log: Callable[[], str],
) -> ShapeResult:
    """Warm-up round trips, then `rounds` rounds of one round trip per door, alternating."""
    first: dict[str, float] = {}
    for _ in range(warmup):
        for door in doors:
            _, loss = timed_trip(door, shape.op, parts)
            first.setdefault(door.name, loss)
    results = {
        d.name: DoorResult(d.trainer.model_id, first.get(d.name, float("nan"))) for d in doors
    }
    before = requests_by_endpoint(gateway_log())
    parts.refresh()
    meter = CpuMeter([os.getpid(), parts.gateway, parts.worker])
    mark = meter.mark()
    for r in range(rounds):
        for door in doors:
            trip, _ = timed_trip(door, shape.op, parts)
            results[door.name].trips.append(trip)
        if (r + 1) % max(1, rounds // 4) == 0:
            print(
                f"    {r + 1}/{rounds} rounds: "
                + ", ".join(
                    f"{name} p50 {res.latency.p50:.1f} ms" for name, res in results.items()
                ),
                flush=True,
            )
    foreign = meter.foreign_since(mark)
    time.sleep(0.2)  # the gateway writes its last access lines
    return ShapeResult(shape, results, requests_by_endpoint(gateway_log()) - before, foreign)


def add_stages(redis_url: str, keys: Keys, result: ShapeResult, warmup: int) -> None:
    """Split every measured round trip at the Redis-clock times of its ops (each door's
    training client is its own model, so its ops in seq order are its round trips' ops)."""
    ops = ops_by_model(redis_url, keys, {r.model_id for r in result.doors.values()})
    per = result.shape.ops
    for door in result.doors.values():
        times = ops.get(door.model_id, [])[warmup * per :]
        if len(times) != len(door.trips) * per:
            print(
                f"warning: {door.model_id}: {len(times)} ops for {len(door.trips)} round "
                "trips; no stage split",
                file=sys.stderr,
            )
            continue
        for i, trip in enumerate(door.trips):
            door.stages.append(split(trip, times[i * per : (i + 1) * per]))


def split(trip: Trip, ops: list[OpTimes]) -> tuple[float, ...]:
    """The round trip's STAGES, from its ops' (queued_at, started_at, finished_at)."""
    first, last = ops[0], ops[-1]
    between = (last[1] - first[2], last[2] - last[1]) if len(ops) == 2 else (NO_OP, NO_OP)
    return (
        first[0] - trip.wall,
        first[1] - first[0],
        first[2] - first[1],
        *between,
        trip.wall + trip.total_s - last[2],
    )


def ops_by_model(redis_url: str, keys: Keys, models: set[str]) -> dict[str, list[OpTimes]]:
    """(queued_at, started_at, finished_at) of every model's training ops, in seq order, from
    the job hashes under the run's key prefix."""
    client = redis.Redis.from_url(redis_url)
    try:
        names = [
            k
            for k in client.scan_iter(match=keys.job("*"), count=1000)
            if not k.endswith(b":reply")
        ]
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.hmget(name, ["model_id", "kind", "seq", "queued_at", "started_at", "finished_at"])
        rows = pipe.execute()
    finally:
        client.close()
    found: dict[str, list[tuple[int, OpTimes]]] = {m: [] for m in models}
    for model, kind, seq, *times in rows:
        model_id = (model or b"").decode()
        if model_id in found and kind != b"create_model" and None not in (seq, *times):
            found[model_id].append((int(seq), tuple(float(t) for t in times)))
    return {m: [t for _, t in sorted(rows)] for m, rows in found.items()}


# --- the run -----------------------------------------------------------------------------------
def shapes(args: argparse.Namespace) -> list[Shape]:
    return [
        Shape("ping", "forward", 1, 2),
        Shape("small", "step", *args.small_batch),
        Shape("large", "step", *args.large_batch),
    ]


def measure(args: argparse.Namespace, database_url: str, data_dir: Path) -> list[ShapeResult]:
    """One worker and one gateway on a fresh key prefix; every shape."""
    results = []
    with deployment(args.redis_url, database_url, "gateway", data_dir) as settings:
        began = time.perf_counter()
        with (
            lora_worker(settings, args.model, data_dir / "worker.log") as worker,
            gateway_proc(settings, data_dir / "gateway.log") as (gateway, url),
        ):
            print(
                f"worker and gateway ready in {time.perf_counter() - began:.0f} s ({url})",
                flush=True,
            )
            parts = Parts(gateway.pid, worker.pid, make_url(database_url).database or "")
            key = make_key(settings, f"bench-{uuid.uuid4().hex[:8]}")
            with (
                service_client(settings) as service,
                tinker.ServiceClient(base_url=url, api_key=key) as sdk,
            ):
                for shape in shapes(args):
                    results.append(
                        run_shape(args, settings, shape, service, sdk, parts, gateway.log)
                    )
    return results


def run_shape(
    args: argparse.Namespace,
    settings: Settings,
    shape: Shape,
    service: ServiceClient,
    sdk: tinker.ServiceClient,
    parts: Parts,
    gateway_log: Callable[[], str],
) -> ShapeResult:
    print(
        f"[{shape.label}] {shape.calls} on {shape.batch} × {shape.seq} tokens: "
        f"{args.warmup} warm-up + {args.rounds} rounds per door ...",
        flush=True,
    )
    rows = token_rows(shape.batch, shape.seq)
    doors = [client_door(service, args.model, rows), sdk_door(sdk, args.model, rows)]
    result = measure_shape(shape, doors, parts, args.warmup, args.rounds, gateway_log)
    add_stages(args.redis_url, Keys(settings.key_prefix), result, args.warmup)
    return result


# --- main --------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser("bench.gateway_round_trip", __doc__)
    cli.add_services(parser)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="base model the worker serves")
    cli.add_knobs(
        parser,
        {
            "--rounds": (400, "measured rounds per shape (one round trip per door each)"),
            "--warmup": (20, "warm-up round trips per door and shape, not measured"),
        },
    )
    cli.add_batch(parser, "--small-batch", (4, 32))
    cli.add_batch(parser, "--large-batch", (8, 128))
    cli.add_data_dir(parser)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    cli.add_report(parser, json=False)
    cli.add_quick(parser, "smoke run (10 rounds, 3 warm-up)")
    args = cli.parse(parser, argv, quick={"rounds": 10, "warmup": 3})
    if args.rounds < 1 or args.warmup < 1:
        parser.error("--rounds and --warmup must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    packages = ("torch", "tinker", "fastapi", "uvicorn", "httpx")
    with service_run(args, packages, "qt-bench-gateway-") as run:
        results = measure(args, run.database_url, run.data_dir)
    total_s, info = run.total_s, run.info
    print("\n" + markdown(results, args.model) + f"\n\ntotal {total_s:.0f} s")
    save(args.out, results_json(info, args, results, total_s))
    section = render(info, args.model, args.rounds, args.warmup, results, total_s)
    publish(args.docs, args.no_docs, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
