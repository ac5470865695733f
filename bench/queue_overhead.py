"""Queue overhead: what one trivial op (`TrainingClient.ping`, no model work) costs end to
end, and how many per second the queue moves, against real Redis, Postgres and worker
processes: round trips through the sync and the async API with where the time goes, throughput
with 1 and 2 workers, rq's `SimpleWorker` on the same Redis as the baseline, and the round trip
with writes acknowledged only once a replica holds them against without. How each is
measured: the `## Queue overhead` section of docs/benchmarks.md.

    .venv/bin/python -m bench.queue_overhead            # the full run (about 2-3 minutes)
    .venv/bin/python -m bench.queue_overhead --quick    # a smoke run, docs left alone
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import redis

from bench.harness import cli
from bench.harness.report import Report, Table, Target, docs_of, emit
from bench.harness.run import Run, service_run
from bench.harness.services import deployment, job_times, service_client
from bench.harness.stats import STAGE_NAMES, Latency, LatencyResult, Sample, Stages, Throughput
from bench.harness.workers import running_workers
from bench.rq_baseline import RqResult, run_rq
from queue_tinker.client import TrainingClient
from queue_tinker.errors import QueueTinkerError
from queue_tinker.local.embedded import EmbeddedRedis
from queue_tinker.queue.keys import Keys
from queue_tinker.settings import Settings

SECTION = "## Queue overhead"
COMMAND = ".venv/bin/python -m bench.queue_overhead"
TARGET_P50_MS = 1.0
TARGET_P99_MS = 5.0
TARGET_OPS_1W = 2_000.0


# --- part 1: round-trip latency ----------------------------------------------------------------
def sync_latency(client: TrainingClient, warmup: int, ops: int) -> list[Sample]:
    """Sequential pings through the sync API; the `ops` after `warmup`."""
    samples: list[Sample] = []
    for i in range(warmup + ops):
        wall = time.time()
        t0 = time.perf_counter()
        future = client.ping(i)
        t1 = time.perf_counter()
        result = future.result(timeout=30)
        t2 = time.perf_counter()
        check_ping(i, result)
        if i >= warmup:
            samples.append(Sample(future.request_id, wall, t1 - t0, t2 - t0))
    return samples


async def async_latency(client: TrainingClient, warmup: int, ops: int) -> list[Sample]:
    """Sequential pings through the async API; the `ops` after `warmup`."""
    samples: list[Sample] = []
    for i in range(warmup + ops):
        wall = time.time()
        t0 = time.perf_counter()
        future = await client.ping_async(i)
        t1 = time.perf_counter()
        result = await future
        t2 = time.perf_counter()
        check_ping(i, result)
        if i >= warmup:
            samples.append(Sample(future.request_id, wall, t1 - t0, t2 - t0))
    return samples


def check_ping(i: int, result: dict[str, object]) -> None:
    if result["data"] != i:
        raise AssertionError(f"ping {i} returned {result!r}")


def stage_breakdown(redis_url: str, keys: Keys, samples: list[Sample]) -> Stages:
    """Split each round trip at the Redis-clock timestamps the scripts wrote into the job hash
    (client and Redis share this host's clock)."""
    times = job_times(redis_url, keys, [s.job_id for s in samples])
    stages = Stages()
    for sample, reply in zip(samples, times, strict=True):
        if reply is None:
            continue
        queued, started, finished = reply
        seen = sample.submitted + sample.total_s
        stages.rows.append(
            (
                sample.enqueued_s,
                queued - sample.submitted,
                started - queued,
                finished - started,
                seen - finished,
            )
        )
    return stages


def summarise(redis_url: str, keys: Keys, samples: list[Sample]) -> LatencyResult:
    """Round trips, submit calls and stages of one latency run."""
    return LatencyResult(
        Latency([s.total_s for s in samples]),
        Latency([s.enqueued_s for s in samples]),
        stage_breakdown(redis_url, keys, samples),
    )


def run_latency(
    args: argparse.Namespace, database_url: str, log_dir: Path
) -> dict[str, LatencyResult]:
    """Part 1: sync then async round trips against one worker, on a fresh prefix."""
    results: dict[str, LatencyResult] = {}
    with (
        deployment(args.redis_url, database_url, "latency", log_dir / "data") as settings,
        running_workers(settings, 1, log_dir, "latency"),
        service_client(settings) as service,
    ):
        keys = Keys(settings.key_prefix)
        sync_client = service.create_lora_training_client("tiny")
        samples = sync_latency(sync_client, args.warmup, args.ops)
        results["sync"] = summarise(args.redis_url, keys, samples)
        async_client = service.create_lora_training_client("tiny")
        samples = asyncio.run(async_latency(async_client, args.warmup, args.ops))
        results["async"] = summarise(args.redis_url, keys, samples)
    return results


# --- part 2: throughput ------------------------------------------------------------------------
async def pump(
    clients: list[TrainingClient], total: int, window: int
) -> tuple[float, dict[str, int]]:
    """Keep `window` pings in flight, spread round robin over the clients.

    Returns the seconds taken and the errors the service raised, counted by type (a typed
    queue_tinker error fails that op, not the run: the benchmark reports it). A wrong result
    or any other exception stops the run.
    """
    slots = asyncio.Semaphore(window)
    errors: dict[str, int] = {}
    fatal: list[BaseException] = []

    async def one(client: TrainingClient, i: int) -> None:
        try:
            future = await client.ping_async(i)
            check_ping(i, await future)
        except QueueTinkerError as exc:
            name = type(exc).__name__
            if name not in errors:
                print(f"warning: ping failed: {name}: {exc}", file=sys.stderr, flush=True)
            errors[name] = errors.get(name, 0) + 1
        except BaseException as exc:  # surfaced after the run
            fatal.append(exc)
        finally:
            slots.release()

    tasks: set[asyncio.Task[None]] = set()
    started = time.perf_counter()
    for i in range(total):
        await slots.acquire()
        if fatal:
            break
        task = asyncio.create_task(one(clients[i % len(clients)], i))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - started
    if fatal:
        raise fatal[0]
    return elapsed, errors


def owners(redis_url: str, keys: Keys, clients: list[TrainingClient]) -> dict[str, int]:
    """How many of the models each worker holds the lease on."""
    client = redis.Redis.from_url(redis_url)
    try:
        counts: dict[str, int] = {}
        for tc in clients:
            lease = client.get(keys.model_lease(tc.model_id))
            if isinstance(lease, bytes):
                lease = lease.decode()
            owner = str(lease).split("|")[0] if lease else "(none)"
            counts[owner] = counts.get(owner, 0) + 1
        return counts
    finally:
        client.close()


def record_backlog(redis_url: str, keys: Keys) -> int:
    """Records still waiting in the stream for the Postgres write-behind."""
    client = redis.Redis.from_url(redis_url)
    try:
        return int(client.xlen(keys.records()))
    finally:
        client.close()


def run_throughput(
    args: argparse.Namespace, database_url: str, log_dir: Path, workers: int
) -> Throughput:
    """Part 2: pings in flight over `args.models` models against `workers` workers."""
    with (
        deployment(args.redis_url, database_url, f"tput{workers}", log_dir / "data") as settings,
        running_workers(settings, workers, log_dir, f"tput{workers}"),
        service_client(settings) as service,
    ):
        keys = Keys(settings.key_prefix)
        clients = [service.create_lora_training_client("tiny") for _ in range(args.models)]
        warm = min(args.tput_ops // 10, 1_000)
        asyncio.run(pump(clients, warm, args.window))
        seconds, errors = asyncio.run(pump(clients, args.tput_ops, args.window))
        backlog = record_backlog(args.redis_url, keys)
        return Throughput(
            args.tput_ops,
            seconds,
            {
                "models": args.models,
                "window": args.window,
                "models_per_worker": sorted(owners(args.redis_url, keys, clients).values()),
                "record_backlog_at_end": backlog,
                "errors": errors,
            },
        )


# --- part 4: replication -----------------------------------------------------------------------
REPLICATION_MODES = (0, 1)  # replicas an acknowledged write waits for (QT_REDIS_URL ?replicas=)


def run_replication(
    args: argparse.Namespace, database_url: str, log_dir: Path
) -> dict[int, list[Sample]]:
    """Part 4: sync round trips on a primary with one replica (both redis-servers started here,
    on loopback), acknowledged on the primary's word and after WAIT for the replica, in
    alternating rounds so that both modes meet the same machine."""
    samples: dict[int, list[Sample]] = {mode: [] for mode in REPLICATION_MODES}
    primary = EmbeddedRedis(log_dir / "repl-primary")
    with (
        primary as primary_url,
        EmbeddedRedis(log_dir / "repl-replica", replica_of=primary.port),
        redis.Redis.from_url(primary_url) as client,
    ):
        wait_for_replica(client)
        for round_number in range(args.replication_rounds):
            for mode in REPLICATION_MODES:
                part = f"repl{mode}-{round_number}"
                with deployment(primary_url, database_url, part, log_dir / "data") as plain:
                    settings = with_replicas(plain, mode)
                    with (
                        running_workers(settings, 1, log_dir, part),
                        service_client(settings) as service,
                    ):
                        training = service.create_lora_training_client("tiny")
                        ops = args.ops // args.replication_rounds
                        samples[mode] += sync_latency(training, args.warmup, ops)
    return samples


def with_replicas(settings: Settings, replicas: int) -> Settings:
    return settings.model_copy(update={"redis_url": f"{settings.redis_url}?replicas={replicas}"})


def wait_for_replica(primary: redis.Redis, timeout_s: float = 30) -> None:
    """Until the replica has synced (the primary counts it online)."""
    deadline = time.monotonic() + timeout_s
    while "slave0" not in (info := primary.info("replication")) or "online" not in str(
        info["slave0"]
    ):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no replica online within {timeout_s:g} s: {info}")
        time.sleep(0.05)


# --- main --------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line; `--quick` shrinks every count and leaves the docs alone."""
    parser = cli.parser(
        "bench.queue_overhead",
        __doc__,
        knobs={
            "--ops": (5_000, "sequential ops per latency run"),
            "--warmup": (200, "ops before measuring latency"),
            "--tput-ops": (20_000, "ops per throughput run"),
            "--models": (8, "models the throughput ops use"),
            "--window": (2_000, "throughput: ops in flight"),
            "--rq-ops": (2_000, "rq sequential jobs"),
            "--rq-tput-ops": (10_000, "rq throughput jobs"),
            "--replication-rounds": (2, "round trips with and without a replica: rounds (0: none)"),
        },
        quick="smoke run: few ops everywhere",
        services=True,
    )
    parser.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=[1, 2],
        help="worker counts to measure throughput with",
    )
    parser.add_argument("--no-rq", action="store_true", help="skip the rq baseline")
    quick = {"ops": 300, "warmup": 50, "tput_ops": 2_000, "window": 500}
    quick |= {"rq_ops": 200, "rq_tput_ops": 500, "replication_rounds": 1}
    return cli.parse(parser, argv, quick=quick)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the three parts; hand back the report (stdout, the docs section, JSON if asked)."""
    args = parse_args(argv)
    with service_run(args, ("rq",), "qt-bench-") as run:
        print(f"[1] round trip, 1 worker: {args.ops} sync + {args.ops} async pings ...", flush=True)
        lat = run_latency(args, run.database_url, run.data_dir)
        tput: dict[int, Throughput] = {}
        for workers in args.workers:
            print(
                f"[2] throughput, {workers} worker(s): {args.tput_ops} pings, "
                f"{args.models} models, {args.window} in flight ...",
                flush=True,
            )
            tput[workers] = run_throughput(args, run.database_url, run.data_dir, workers)
            print(f"    {tput[workers].per_s:,.0f} ops/s", flush=True)
        rq_result = None
        if not args.no_rq:
            print(
                f"[3] rq SimpleWorker: {args.rq_ops} sequential jobs, {args.rq_tput_ops} burst ...",
                flush=True,
            )
            rq_result = run_rq(
                args.redis_url,
                run.data_dir,
                warmup=args.warmup,
                ops=args.rq_ops,
                tput_ops=args.rq_tput_ops,
            )
        repl = None
        if args.replication_rounds > 0:
            print("[4] round trip with a replica, acknowledged with and without WAIT ...")
            repl = run_replication(args, run.database_url, run.data_dir)
    emit(report(args, run, lat, tput, rq_result, repl), docs_of(args), args.json)
    return 0


# --- the report --------------------------------------------------------------------------------
def report(
    args: argparse.Namespace,
    run: Run,
    lat: dict[str, LatencyResult],
    tput: dict[int, Throughput],
    rq_result: RqResult | None,
    repl: dict[int, list[Sample]] | None,
) -> Report:
    """The targets, then round trips beside rq's, where one goes, throughput, and the round
    trip with replication against without."""
    targets = [
        Target(f"p{p} round trip ≤ {bound:g} ms, {api} API", f"{ms:.2f} ms", ms <= bound)
        for p, bound in ((50, TARGET_P50_MS), (99, TARGET_P99_MS))
        for api in ("sync", "async")
        for ms in (lat[api].latency.pct(p),)
    ]
    if (one := tput.get(1)) is not None:
        ops = f"{one.per_s:,.0f} ops/s (async)"
        met = one.per_s >= TARGET_OPS_1W
        targets.append(Target(f"≥ {TARGET_OPS_1W:,.0f} ops/s, one worker", ops, met))
    results = {
        "latency": {
            api: {
                "round_trip": r.latency.summary(),
                "enqueue": r.enqueue.summary(),
                "stages_p50_ms": r.stages.medians_ms(),
                "stages_p99_ms": r.stages.p99s_ms(),
            }
            for api, r in lat.items()
        },
        "throughput": {
            str(k): {"ops": t.ops, "ops_per_s": t.per_s, **t.extra} for k, t in tput.items()
        },
        "rq": None
        if rq_result is None
        else {
            "round_trip": rq_result.latency.summary(),
            "throughput_ops_per_s": rq_result.throughput.per_s,
            "enqueue_many_s": rq_result.enqueue_s,
        },
        "replication": None
        if repl is None
        else {
            f"replicas={mode}": Latency([s.total_s for s in got]).summary()
            for mode, got in repl.items()
        },
    }
    facts = [
        f"The run took {run.total_s:.0f} s; client, workers, Redis and Postgres share its cores."
    ]
    body = [round_trips(args, run, lat, rq_result), stages(lat), throughput(run, tput, rq_result)]
    if repl is not None:
        body.append(replication(args, repl))
    return Report(SECTION, COMMAND, run.info, facts, targets, body, results)


def round_trips(
    args: argparse.Namespace, run: Run, lat: dict[str, LatencyResult], rq: RqResult | None
) -> Table:
    rows: list[tuple[str, str, Latency]] = [
        ("queue_tinker", "`client.ping(i).result()`", lat["sync"].latency),
        ("queue_tinker", "`await (await client.ping_async(i))`", lat["async"].latency),
    ]
    if rq is not None:
        ops = f"{len(rq.latency.samples):,} ops"
        wait = f"`q.enqueue(echo, i)` + `job.latest_result(timeout=30)` ({ops})"
        rows.append((f"rq {run.info['rq']} `SimpleWorker`", wait, rq.latency))
    return Table(
        ("system", "API / wait", "p50 ms", "p90 ms", "p99 ms", "max ms", "mean ms"),
        [
            (system, api, *(f"{v:.2f}" for v in (s.p50, s.p90, s.p99, s.max, s.mean)))
            for system, api, s in rows
        ],
        title=f"Round trip, one worker ({args.ops:,} sequential ops after {args.warmup} warm-up)",
    )


def stages(lat: dict[str, LatencyResult]) -> Table:
    sync, async_ = lat["sync"].stages, lat["async"].stages
    columns = (sync.medians_ms(), sync.p99s_ms(), async_.medians_ms(), async_.p99s_ms())
    rows = [(name, *(f"{c.get(name, 0):.3f}" for c in columns)) for name in STAGE_NAMES]
    return Table(
        ("stage", "sync p50", "sync p99", "async p50", "async p99"),
        rows,
        "Where one round trip goes",
    )


def throughput(run: Run, tput: dict[int, Throughput], rq: RqResult | None) -> Table:
    rows: list[tuple[object, ...]] = [
        (
            "queue_tinker (async API)",
            workers,
            f"{t.ops:,} over {t.extra['models']} models",
            f"{t.extra['window']:,}",
            f"{t.per_s:,.0f}",
            f"models per worker {t.extra['models_per_worker']}; records not yet in Postgres at "
            f"the end: {t.extra['record_backlog_at_end']:,}; {failed_ops(t.extra['errors'])}",
        )
        for workers, t in sorted(tput.items())
    ]
    if rq is not None:
        enqueue = (
            f"enqueueing them (`enqueue_many`, pipelined) took {rq.enqueue_s:.2f} s, not counted"
        )
        rows.append(
            (
                f"rq {run.info['rq']} `SimpleWorker`",
                1,
                f"{rq.throughput.ops:,}",
                "all queued up front",
                f"{rq.throughput.per_s:,.0f}",
                f"`work(burst=True)` timed inside the worker process; {enqueue}",
            )
        )
    return Table(("system", "workers", "ops", "in flight", "ops/s", "notes"), rows, "Throughput")


def replication(args: argparse.Namespace, repl: dict[int, list[Sample]]) -> Table:
    rows = []
    for mode, got in repl.items():
        trip, submit = Latency([s.total_s for s in got]), Latency([s.enqueued_s for s in got])
        rows.append(
            (
                f"`?replicas={mode}`",
                "after WAIT: one replica holds it" if mode else "on the primary's word",
                *(f"{v:.2f}" for v in (trip.p50, trip.p90, trip.p99, trip.mean)),
                f"{submit.p50:.2f}",
            )
        )
    ops = sum(len(got) for got in repl.values())
    return Table(
        ("QT_REDIS_URL", "acknowledged", "p50 ms", "p90 ms", "p99 ms", "mean ms", "submit p50 ms"),
        rows,
        title=f"Replication: round trip, one worker, a primary (AOF fsynced at every write, "
        f"as compose and `up` run it) and one replica on loopback ({ops:,} sequential ops in "
        f"{args.replication_rounds} alternating rounds; what WAIT costs is the difference)",
    )


def failed_ops(errors: dict[str, int]) -> str:
    if not errors:
        return "no op failed"
    return "**ops failed: " + ", ".join(f"{n:,} × `{name}`" for name, n in errors.items()) + "**"


if __name__ == "__main__":
    sys.exit(main())
