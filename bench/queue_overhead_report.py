"""How the queue-overhead results are shown: the `## Queue overhead` section of
docs/benchmarks.md, the table on stdout, and the raw JSON."""

from __future__ import annotations

from bench.harness.report import json_document, machine_line, reproduce, table
from bench.harness.stats import STAGE_NAMES, Latency, LatencyResult, Throughput
from bench.rq_baseline import RqResult

SECTION = "## Queue overhead"
COMMAND = ".venv/bin/python -m bench.queue_overhead"

# The targets from the issue.
TARGET_P50_MS = 1.0
TARGET_P99_MS = 5.0
TARGET_OPS_1W = 2_000.0

INTRO = (
    "What one trivial op costs when it goes through the queue, and how many per second it "
    "moves. The op is `TrainingClient.ping` (the worker decodes the payload and returns it: "
    "no model work), so everything measured is queue overhead: client, Redis scripts, "
    "worker dispatch, publish, wake-up, and the Postgres write-behind running beside it. "
    "Everything is real: the local Redis and Postgres, worker processes started as "
    "`python -m queue_tinker.cli worker --base-model tiny --device cpu` with production "
    "defaults (lease/heartbeat/linger), a scratch database migrated for the run, a fresh "
    "Redis key prefix per part."
)
REPRODUCE = (
    "Reproduce (from the repository root, with Redis on 127.0.0.1:6379 and Postgres on "
    "127.0.0.1:5432; `--redis-url` / `--postgres-url` point elsewhere, `--help` lists the "
    "knobs, `--quick` is a smoke run that leaves this file alone):"
)
RQ_WAIT = (
    "rq waits with `Job.latest_result(timeout=...)`, which rq 3 implements as a blocking "
    "`XREAD` on the job's result stream (no polling loop). Its worker logs at WARNING, "
    "not rq's default INFO (two log lines per job), to give it its best case."
)
STAGES = (
    "Where one round trip goes (medians / p99 in ms; stage boundaries are the Redis-clock "
    "timestamps the Lua scripts write into the job hash — `queued_at`, `started_at`, "
    "`finished_at` — and the client's wall clock on the same host; the first row overlaps "
    "the others, which add up to the total). An op the engine runs inline (a ping) is "
    "marked started and finished by the one publish script, so its `started_at -> "
    "finished_at` is 0 and `queued_at -> started_at` covers pick-up, execution and the "
    "publish script:"
)
THROUGHPUT = (
    "queue_tinker's throughput is client-inclusive: the clock runs from the first submit "
    "to the last result seen by the client, with a bounded window of in-flight futures "
    "(asyncio semaphore), after a warm-up that lets the worker(s) claim every model. "
    "rq's is worker-only (the queue is full before its clock starts)."
)


# --- docs/benchmarks.md ------------------------------------------------------------------------
def errors_text(errors: dict[str, int]) -> str:
    """The failed ops of a throughput run, for its notes column."""
    if not errors:
        return "no op failed"
    return "**ops failed: " + ", ".join(f"{n:,} × `{name}`" for name, n in errors.items()) + "**"


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def intro_lines(info: dict[str, str], total_s: float) -> list[str]:
    """What is measured, how to reproduce it, and on what machine."""
    return [
        SECTION,
        "",
        INTRO,
        "",
        REPRODUCE,
        "",
        *reproduce(COMMAND),
        "",
        machine_line(info) + ".",
        f"The run took {total_s:.0f} s. Client, worker(s), Redis and Postgres all share "
        "this machine's cores.",
        "",
    ]


def target_lines(lat: dict[str, LatencyResult], tput: dict[int, Throughput]) -> list[str]:
    """The targets table: each target, the measured value, met or not."""
    sync, async_ = lat["sync"].latency, lat["async"].latency
    lines = [
        "### Targets",
        "",
        "| target | sync API | async API | verdict |",
        "| --- | --- | --- | --- |",
        f"| p50 round trip ≤ {TARGET_P50_MS:g} ms | {sync.p50:.2f} ms | {async_.p50:.2f} ms | "
        f"sync {verdict(sync.p50 <= TARGET_P50_MS)}, async "
        f"{verdict(async_.p50 <= TARGET_P50_MS)} |",
        f"| p99 round trip ≤ {TARGET_P99_MS:g} ms | {sync.p99:.2f} ms | {async_.p99:.2f} ms | "
        f"sync {verdict(sync.p99 <= TARGET_P99_MS)}, async "
        f"{verdict(async_.p99 <= TARGET_P99_MS)} |",
    ]
    one = tput.get(1)
    if one is not None:
        lines.append(
            f"| ≥ {TARGET_OPS_1W:,.0f} ops/s, one worker | {one.per_s:,.0f} ops/s "
            f"(async) | | {verdict(one.per_s >= TARGET_OPS_1W)} |"
        )
    return [*lines, ""]


def round_trip_lines(
    ops: int,
    warmup: int,
    info: dict[str, str],
    lat: dict[str, LatencyResult],
    rq_result: RqResult | None,
) -> list[str]:
    """The round-trip table, queue_tinker's two APIs beside rq."""
    rows: list[tuple[str, str, Latency]] = [
        ("queue_tinker", "`client.ping(i).result()`", lat["sync"].latency),
        ("queue_tinker", "`await (await client.ping_async(i))`", lat["async"].latency),
    ]
    if rq_result is not None:
        s = rq_result.latency
        rows.append(
            (
                f"rq {info['rq']} `SimpleWorker`",
                f"`q.enqueue(echo, i)` + `job.latest_result(timeout=30)` ({len(s.samples):,} ops)",
                s,
            )
        )
    return [
        f"### Round trip, one worker ({ops:,} sequential ops after {warmup} warm-up)",
        "",
        *table(
            ("system", "API / wait", "p50 ms", "p90 ms", "p99 ms", "max ms", "mean ms"),
            (
                (system, api, *(f"{v:.2f}" for v in (s.p50, s.p90, s.p99, s.max, s.mean)))
                for system, api, s in rows
            ),
        ),
        "",
        RQ_WAIT,
        "",
    ]


def stage_lines(lat: dict[str, LatencyResult]) -> list[str]:
    """Where one round trip goes, stage by stage."""
    sm, sp = lat["sync"].stages.medians_ms(), lat["sync"].stages.p99s_ms()
    am, ap = lat["async"].stages.medians_ms(), lat["async"].stages.p99s_ms()
    rows = ((name, *(f"{m.get(name, 0):.3f}" for m in (sm, sp, am, ap))) for name in STAGE_NAMES)
    columns = ("stage", "sync p50", "sync p99", "async p50", "async p99")
    return [STAGES, "", *table(columns, rows), ""]


def throughput_lines(
    info: dict[str, str], tput: dict[int, Throughput], rq_result: RqResult | None
) -> list[str]:
    """The throughput table, one row per worker count, then rq."""
    rows = [
        (
            "queue_tinker (async API)",
            workers,
            f"{t.ops:,} over {t.extra['models']} models",
            f"{t.extra['window']:,}",
            f"{t.per_s:,.0f}",
            f"models per worker {t.extra['models_per_worker']}; records not yet in Postgres at "
            f"the end: {t.extra['record_backlog_at_end']:,}; {errors_text(t.extra['errors'])}",
        )
        for workers, t in sorted(tput.items())
    ]
    if rq_result is not None:
        t = rq_result.throughput
        rows.append(
            (
                f"rq {info['rq']} `SimpleWorker`",
                1,
                f"{t.ops:,}",
                "all queued up front",
                f"{t.per_s:,.0f}",
                "`work(burst=True)` timed inside the worker process; enqueueing them "
                f"(`enqueue_many`, pipelined) took {rq_result.enqueue_s:.2f} s, not counted",
            )
        )
    columns = ("system", "workers", "ops", "in flight", "ops/s", "notes")
    return ["### Throughput", "", *table(columns, rows), "", THROUGHPUT, ""]


def render(
    ops: int,
    warmup: int,
    info: dict[str, str],
    lat: dict[str, LatencyResult],
    tput: dict[int, Throughput],
    rq_result: RqResult | None,
    total_s: float,
) -> str:
    """The whole `## Queue overhead` section, in Markdown."""
    return "\n".join(
        [
            *intro_lines(info, total_s),
            *target_lines(lat, tput),
            *round_trip_lines(ops, warmup, info, lat, rq_result),
            *stage_lines(lat),
            *throughput_lines(info, tput, rq_result),
        ]
    )


# --- stdout ------------------------------------------------------------------------------------
def print_table(
    lat: dict[str, LatencyResult], tput: dict[int, Throughput], rq_result: RqResult | None
) -> None:
    """The results as plain-text tables, then the targets."""
    print()
    print(f"{'round trip (ms)':<44}{'p50':>8}{'p90':>8}{'p99':>8}{'max':>9}{'n':>7}")
    rows: list[tuple[str, Latency]] = [
        ("queue_tinker sync  ping(i).result()", lat["sync"].latency),
        ("queue_tinker async await ping_async(i)", lat["async"].latency),
    ]
    if rq_result is not None:
        rows.append(("rq SimpleWorker enqueue+latest_result", rq_result.latency))
    for label, s in rows:
        print(f"{label:<44}{s.p50:>8.2f}{s.p90:>8.2f}{s.p99:>8.2f}{s.max:>9.2f}{len(s.samples):>7}")
    print()
    print(f"{'stage p50 (ms)':<50}{'sync':>8}{'async':>8}")
    sm, am = lat["sync"].stages.medians_ms(), lat["async"].stages.medians_ms()
    for name in STAGE_NAMES:
        print(f"{name:<50}{sm.get(name, 0):>8.3f}{am.get(name, 0):>8.3f}")
    print()
    print(f"{'throughput':<44}{'ops':>8}{'sec':>8}{'ops/s':>9}")
    for workers, t in sorted(tput.items()):
        print(
            f"{f'queue_tinker {workers} worker(s), async':<44}{t.ops:>8}{t.seconds:>8.2f}"
            f"{t.per_s:>9.0f}  {t.extra}"
        )
    if rq_result is not None:
        t = rq_result.throughput
        print(f"{'rq SimpleWorker 1 worker, burst':<44}{t.ops:>8}{t.seconds:>8.2f}{t.per_s:>9.0f}")
    print()
    print_targets(lat, tput)


def print_targets(lat: dict[str, LatencyResult], tput: dict[int, Throughput]) -> None:
    """The measured value beside each target."""
    one = tput.get(1)
    print(
        f"target p50 <= {TARGET_P50_MS:g} ms: sync {lat['sync'].latency.p50:.2f}, "
        f"async {lat['async'].latency.p50:.2f}"
    )
    print(
        f"target p99 <= {TARGET_P99_MS:g} ms: sync {lat['sync'].latency.p99:.2f}, "
        f"async {lat['async'].latency.p99:.2f}"
    )
    if one is not None:
        print(f"target >= {TARGET_OPS_1W:,.0f} ops/s (1 worker): {one.per_s:,.0f}")


# --- JSON --------------------------------------------------------------------------------------
def results_json(
    info: dict[str, str],
    lat: dict[str, LatencyResult],
    tput: dict[int, Throughput],
    rq_result: RqResult | None,
) -> str:
    """Every number of the run, for `--json`."""
    return json_document(
        info,
        latency={
            k: {
                "round_trip": v.latency.summary(),
                "enqueue": v.enqueue.summary(),
                "stages_p50_ms": v.stages.medians_ms(),
                "stages_p99_ms": v.stages.p99s_ms(),
            }
            for k, v in lat.items()
        },
        throughput={
            str(k): {"ops": t.ops, "seconds": t.seconds, "ops_per_s": t.per_s, **t.extra}
            for k, t in tput.items()
        },
        rq=None
        if rq_result is None
        else {
            "round_trip": rq_result.latency.summary(),
            "throughput_ops_per_s": rq_result.throughput.per_s,
            "enqueue_many_s": rq_result.enqueue_s,
        },
    )
