"""Training step: time per forward_backward + optim_step through the service (a real LoRA worker)
against a bare PEFT loop in this process, in alternating blocks, on the tiny and the 100M model.
How: the `## Training step: service vs bare PEFT` section of docs/benchmarks.md."""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial

import numpy as np
import torch
from sqlalchemy.engine import make_url

from bench.harness import cli, engine
from bench.harness.baselines import ADAM, BareLoop
from bench.harness.data import RANK, datums, token_rows
from bench.harness.meters import CpuMeter, SideCpu, load1, median_ms, turns
from bench.harness.models import ensure_model
from bench.harness.report import Report, Table, Target, docs_of, emit
from bench.harness.run import TORCH, Run, service_run
from bench.harness.services import job_times, service_client
from bench.harness.stats import Latency, Stages
from bench.harness.workers import lora_worker, quiet_transformers, worker_threads
from queue_tinker.builtin_models import BUILTIN_MODELS, VOCAB_SIZE
from queue_tinker.client import TrainingClient
from queue_tinker.client.training import forward_backward_input
from queue_tinker.queue.keys import Keys
from queue_tinker.types import codec
from queue_tinker.types.requests.loss_inputs import ModelLimits, check_batch
from queue_tinker.types.requests.training import ForwardBackwardInput, ForwardBackwardOutput
from queue_tinker.types.tensors import Datum, TensorData

SECTION = "## Training step: service vs bare PEFT"
COMMAND = ".venv/bin/python -m bench.train_step"
TARGET_RATIO = 1.10
QUIET_CORES = 0.25  # cores other processes may take in each block of a quiet round
RESULT_TIMEOUT_S = 600.0
KNOBS = {
    "--rounds": (40, "most service/bare block pairs per size"),
    "--warmup": (3, "steps of each before measuring"),
    "--tiny-steps": (5, "steps per block, tiny"),
    "--big-steps": (1, "steps per block, 100M"),
    "--tiny-budget": (45.0, "seconds of tiny rounds after which no new round starts"),
    "--big-budget": (200.0, "seconds of 100M rounds after which no new round starts"),
}
STAGE_NAMES: tuple[str, ...] = (
    "both submit calls return (overlaps the rows below)",
    "submit -> the step started (encode, enqueue both ops, the worker gathers the step, start "
    "script)",
    "the step on the worker: started -> both published (decode, compute both ops, encode, publish)",
    "published -> both results in the client's hand",
)


@dataclass(frozen=True)
class Batch:
    """One model and its batch: `batch` datums of `seq` input tokens each."""

    label: str
    model: str
    batch: int
    seq: int

    @property
    def shape(self) -> str:
        return f"{self.batch} × {self.seq}"

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


@dataclass(frozen=True)
class Size(Batch):
    steps: int  # steps per block
    budget_s: float  # no new round starts after this many seconds of rounds (2 rounds at least)


@dataclass
class Block:
    """One block of steps, and the CPU other processes took meanwhile."""

    times: list[float]  # seconds per step
    foreign: float  # cores' worth of CPU used by other processes (plus steal) during the block
    fb: list[float] = field(default_factory=list)  # bare steps: their forward + backward part


@dataclass
class Round:
    service: Block
    bare: Block

    @property
    def ratio(self) -> float:
        return statistics.median(self.service.times) / statistics.median(self.bare.times)

    @property
    def quiet(self) -> bool:
        return max(self.service.foreign, self.bare.foreign) < QUIET_CORES


@dataclass
class SizeResult:
    size: Size
    params: int
    lora_params: int
    threads: dict[str, int]
    rounds: list[Round] = field(default_factory=list)
    stages: Stages = field(default_factory=lambda: Stages(names=STAGE_NAMES))
    quiet_stages: Stages = field(default_factory=lambda: Stages(names=STAGE_NAMES))
    first_loss: tuple[float, float] = (0.0, 0.0)  # (service, bare), same weights at step 0
    snapshots: int = 0  # measured service steps whose optim_step wrote a snapshot
    codec_ms: dict[str, float] = field(default_factory=dict)  # see serialisation_ms
    engine_ms: dict[str, float] = field(default_factory=dict)  # see engine_function_ms
    side_ms: dict[str, float] = field(default_factory=dict)  # see SideCpu
    load: list[float] = field(default_factory=list)  # 1-min load average at start and end

    def times(self, side: str, quiet: bool = False) -> list[float]:
        """Every step time of one side ("service" or "bare"), of the quiet rounds or all."""
        return [t for r in self.rounds if r.quiet or not quiet for t in getattr(r, side).times]

    @property
    def ratio(self) -> float:
        """Median service step over median bare step, every round: the headline number."""
        return statistics.median(self.times("service")) / statistics.median(self.times("bare"))

    @property
    def ratio_p10(self) -> float:
        """The same at the 10th percentiles: load from other processes only ever adds time,
        so the fast end of each distribution is the least disturbed."""
        return Latency(self.times("service")).pct(10) / Latency(self.times("bare")).pct(10)

    def quiet_rounds(self) -> list[Round]:
        return [r for r in self.rounds if r.quiet]

    def ratio_quiet(self) -> float | None:
        """The headline ratio over the rounds in which other processes stayed quiet."""
        service, bare = self.times("service", quiet=True), self.times("bare", quiet=True)
        return statistics.median(service) / statistics.median(bare) if service else None

    def foreign(self, side: str) -> float:
        """Mean CPU (cores) other processes took during this side's blocks."""
        return statistics.mean(getattr(r, side).foreign for r in self.rounds)


@dataclass
class ServiceSample:
    """One service step as the client saw it."""

    wall: float  # time.time() before the first submit (lines up with Redis TIME)
    submit_s: float  # until both submit calls returned
    total_s: float  # until both results were in hand
    fb_id: str
    optim_id: str
    loss: float
    step: int  # the adapter's optimizer step after this one
    quiet: bool = False  # taken in a quiet round (set once the round is over)


def service_step(tc: TrainingClient, data: list[Datum]) -> ServiceSample:
    """One step of the natural Tinker loop: submit both ops, then wait on both."""
    wall, t0 = time.time(), time.perf_counter()
    fb = tc.forward_backward(data, "cross_entropy")
    optim = tc.optim_step(ADAM)
    t1 = time.perf_counter()
    out = fb.result(timeout=RESULT_TIMEOUT_S)
    stepped = optim.result(timeout=RESULT_TIMEOUT_S)
    t2 = time.perf_counter()
    step = int((stepped.metrics or {}).get("step:max", 0))
    return ServiceSample(wall, t1 - t0, t2 - t0, fb.request_id, optim.request_id, out.loss, step)


def stages_of(redis_url: str, keys: Keys, samples: list[ServiceSample]) -> Stages:
    """Split every service step at the worker's start/finish marks of its two ops."""
    times = job_times(redis_url, keys, [job for s in samples for job in (s.fb_id, s.optim_id)])
    stages = Stages(names=STAGE_NAMES)
    for s, fb, optim in zip(samples, times[::2], times[1::2], strict=True):
        if fb is None or optim is None:
            continue
        seen = s.wall + s.total_s
        started, published = min(fb[1], optim[1]), max(fb[2], optim[2])
        stages.rows.append((s.submit_s, started - s.wall, published - started, seen - published))
    return stages


def serialisation_ms(model: str, data: list[Datum], reps: int = 20) -> dict[str, float]:
    """Median ms of the (de)serialisation around one forward_backward, in this process."""
    context = BUILTIN_MODELS[model].config["max_position_embeddings"]
    limits = ModelLimits(vocab_size=VOCAB_SIZE, context_length=context)
    logprobs = [TensorData.from_numpy(np.zeros(d.model_input.length, np.float32)) for d in data]
    output = ForwardBackwardOutput(
        loss_fn_outputs=[{"logprobs": lp} for lp in logprobs], metrics={"loss:sum": 1.0}
    )

    def encode_batch() -> bytes:
        return codec.encode(forward_backward_input(data, "cross_entropy", None).model_dump())

    payload, result = encode_batch(), codec.encode(output.model_dump())
    calls = {
        "client: validate + encode the batch": encode_batch,
        "worker: decode + check the batch": lambda: check_batch(
            ForwardBackwardInput.model_validate(codec.decode(payload)), limits
        ),
        "worker: encode the result": lambda: codec.encode(output.model_dump()),
        "client: decode the result": lambda: ForwardBackwardOutput.model_validate(
            codec.decode(result)
        ),
    }
    return {name: median_ms(call, reps) for name, call in calls.items()}


def engine_function_ms(bare: BareLoop, data: list[Datum], reps: int) -> dict[str, float]:
    """Median ms of the engine's forward_backward and the bare forward + backward, alternating."""
    calls: dict[str, Callable[[], object]] = {
        "engine forward_backward()": partial(
            engine.forward_backward, bare.pool, [(bare.adapter, data)], engine.CPU
        ),
        "bare forward+backward": bare.forward_backward,
    }
    zero_grad = partial(bare.optimizer.zero_grad, set_to_none=True)
    times = turns(calls, reps, engine.CPU, after=zero_grad)
    return {name: statistics.median(ts) * 1000 for name, ts in times.items()}


@dataclass
class Sides:
    """The two loops on one batch, and the meters of the CPU around them."""

    bare: BareLoop
    tc: TrainingClient
    data: list[Datum]
    cpu: CpuMeter
    side: SideCpu

    def rounds(self, result: SizeResult, rounds: int) -> list[ServiceSample]:
        """Up to `rounds` rounds of a service block and a bare block (bare first in odd
        rounds), none started once the time budget is spent (after 2); the service samples."""
        samples: list[ServiceSample] = []
        began, steps = time.perf_counter(), result.size.steps
        for r in range(rounds):
            if r >= 2 and time.perf_counter() - began > result.size.budget_s:
                print(f"    time budget spent: stopping after {r} rounds", flush=True)
                break
            block: list[ServiceSample] = []
            bare_times: list[tuple[float, float]] = []
            foreign: dict[str, float] = {}
            for part in ("service", "bare") if r % 2 == 0 else ("bare", "service"):
                mark = self.cpu.mark()
                if part == "bare":
                    bare_times = self.bare.timed(steps)
                else:
                    before = self.side.snapshot()
                    block = [service_step(self.tc, self.data) for _ in range(steps)]
                    self.side.add(before, steps)
                foreign[part] = self.cpu.foreign_since(mark)
            done = Round(
                Block([s.total_s for s in block], foreign["service"]),
                Block([t for t, _ in bare_times], foreign["bare"], [fb for _, fb in bare_times]),
            )
            for sample in block:
                sample.quiet = done.quiet
            result.rounds.append(done)
            samples.extend(block)
            print(f"    round {r + 1}/{rounds}: service / bare {done.ratio:.2f}", flush=True)
        return samples


def measure_size(args: argparse.Namespace, size: Size, run: Run, threads: int) -> SizeResult:
    """Warm up both, then alternate blocks; the service on a fresh key prefix."""
    print(f"[{size.label}] {size.model}, {size.shape} tokens ...", flush=True)
    rows, data_dir = token_rows(size.batch, size.seq), run.data_dir
    ensure_model(size.model, data_dir)
    data, bare = datums(rows), BareLoop(size.model, data_dir, rows)
    with run.deployment(f"train-{size.label}") as settings:
        used = {"bare": torch.get_num_threads(), **worker_threads(settings)}
        result = SizeResult(size, bare.params, bare.lora_params, used, load=[load1()])
        # Production defaults: batching on, so the worker runs a step's two ops as one batch.
        with (
            lora_worker(settings, size.model, data_dir / f"worker-{size.label}.log") as proc,
            service_client(settings) as service,
        ):
            tc = service.create_lora_training_client(size.model, rank=RANK, seed=0)
            warm = [service_step(tc, data) for _ in range(args.warmup)]
            result.first_loss = (warm[0].loss, bare.step()[0])
            bare.timed(args.warmup - 1)
            side = SideCpu(proc.pid, make_url(run.database_url).database or "", threads)
            sides = Sides(bare, tc, data, CpuMeter([os.getpid(), proc.pid]), side)
            samples = sides.rounds(result, args.rounds)
            keys = Keys(settings.key_prefix)
            result.side_ms = side.per_step_ms()
            result.stages = stages_of(args.redis_url, keys, samples)
            result.quiet_stages = stages_of(args.redis_url, keys, [s for s in samples if s.quiet])
            result.snapshots = sum(s.step % settings.snapshot_every_steps == 0 for s in samples)
            result.codec_ms = serialisation_ms(size.model, data)
            reps = min(20, max(3, round(2 / statistics.median(result.times("bare")))))
            result.engine_ms = engine_function_ms(bare, data, reps)
    result.load.append(load1())
    del bare
    gc.collect()
    if result.threads["bare"] != threads:
        print(f"warning: bare loop ran with {result.threads['bare']} threads", file=sys.stderr)
    return result


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser("bench.train_step", __doc__, knobs=KNOBS, services=True, data_dir=True)
    cli.add_batch(parser, "--tiny-batch", (8, 128))
    cli.add_batch(parser, "--big-batch", (2, 64))
    quick = {"rounds": 6, "warmup": 2, "tiny_steps": 5, "big_steps": 1}
    return cli.parse(parser, argv, quick={**quick, "tiny_budget": 8, "big_budget": 15})


def main(argv: Sequence[str] | None = None) -> int:
    """Each size in turn; hand back the report (stdout, the docs section, JSON if asked)."""
    args = parse_args(argv)
    (tiny, tiny_seq), (big, big_seq) = args.tiny_batch, args.big_batch
    sizes = [
        Size("tiny", "queue-tinker/tiny-llama", tiny, tiny_seq, args.tiny_steps, args.tiny_budget),
        Size("100m", "queue-tinker/llama-100m", big, big_seq, args.big_steps, args.big_budget),
    ]
    quiet_transformers()
    with service_run(args, TORCH, "qt-bench-train-") as run:
        threads = run.worker_threads()["worker compute thread"]
        torch.set_num_threads(threads)  # what the worker's compute thread uses
        results = [measure_size(args, size, run, threads) for size in sizes]
    emit(report(args, run, results), docs_of(args), args.json)
    return 0


RATIO_COLUMNS = (
    "model | params (LoRA) | batch (datums × tokens) | rounds × steps | bare ms/step p50 (p10–p90) "
    "| service ms/step p50 (p10–p90) | service / bare (medians) | at p10 | quiet rounds only (how "
    "many) | per round: median (min–max) | other processes, cores (service / bare blocks)"
)


def cells(row: str) -> list[str]:
    """The cells of a table row written as in Markdown: "a | b | c"."""
    return row.split(" | ")


def report(args: argparse.Namespace, run: Run, results: list[SizeResult]) -> Report:
    """The target at the largest size, the ratios, each size's stages, where the time goes."""
    largest = results[-1]
    facts = [
        f"Torch threads: {', '.join(f'{k} {v}' for k, v in largest.threads.items())}.",
        f"Rank {RANK}, {args.warmup} warm-up steps of each, up to {args.rounds} rounds; a round "
        f"is quiet when other processes took under {QUIET_CORES:g} cores in both its blocks.",
        f"The run took {run.total_s:.0f} s.",
    ]
    target = Target(
        f"service / bare ≤ {TARGET_RATIO:.2f} at `{largest.size.model}` (median step over "
        "median step, all rounds)",
        f"{largest.ratio:.3f} (quiet rounds only: {quiet_text(largest)})",
        largest.ratio <= TARGET_RATIO,
    )
    per_size = [
        {**asdict(r), "ratio": r.ratio, "ratio_p10": r.ratio_p10, "ratio_quiet": r.ratio_quiet()}
        for r in results
    ]
    body = [Table(cells(RATIO_COLUMNS), map(ratio_row, results)), *map(stages, results)]
    notes = "\n".join(map(overhead_note, results))
    return Report(SECTION, COMMAND, run.info, facts, [target], [*body, notes], {"sizes": per_size})


def spread(samples: list[float]) -> str:
    lat = Latency(samples)
    return f"{lat.p50:,.1f} ({lat.pct(10):,.1f}–{lat.p90:,.1f})"


def quiet_text(r: SizeResult) -> str:
    """The ratio over quiet rounds, with how many rounds were quiet."""
    ratio = r.ratio_quiet()
    value = "n/a" if ratio is None else f"{ratio:.2f}"
    return f"{value} ({len(r.quiet_rounds())} of {len(r.rounds)})"


def ratio_row(r: SizeResult) -> list[str]:
    """Both sides' step times, the ratio four ways, the machine's other load."""
    per_round = [x.ratio for x in r.rounds]
    return cells(
        f"`{r.size.model}` | {r.params:,} ({r.lora_params:,}) | {r.size.shape} "
        f"| {len(r.rounds)} × {r.size.steps} | {spread(r.times('bare'))} "
        f"| {spread(r.times('service'))} | **{r.ratio:.2f}** | {r.ratio_p10:.2f} | {quiet_text(r)} "
        f"| {statistics.median(per_round):.2f} ({min(per_round):.2f}–{max(per_round):.2f}) "
        f"| {r.foreign('service'):.2f} / {r.foreign('bare'):.2f}"
    )


def stages(r: SizeResult) -> Table:
    none = dict.fromkeys(STAGE_NAMES, 0.0)  # no service step has its job timestamps
    p50, p99 = r.stages.medians_ms() or none, r.stages.p99s_ms() or none
    q = r.quiet_stages.medians_ms()
    return Table(
        ("stage", "p50, all rounds", "p50, quiet rounds", "p99, all rounds"),
        [
            (n, f"{p50[n]:,.1f}", f"{q[n]:,.1f}" if n in q else "n/a", f"{p99[n]:,.1f}")
            for n in STAGE_NAMES
        ],
        caption=f"Where a service step goes, `{r.size.model}` ({r.size.shape}), in ms:",
    )


def ms(values: Sequence[float]) -> float:
    return statistics.median(values) * 1000


def overhead_note(r: SizeResult) -> str:
    """The service's extra over bare, split at the worker's op boundaries (quiet rounds if any)."""
    quiet = bool(r.quiet_rounds())
    rounds, rows = (r.quiet_rounds(), r.quiet_stages.rows) if quiet else (r.rounds, r.stages.rows)
    if not rows:
        return f"- `{r.size.model}`: no service step has its job timestamps."
    which = f"the {len(rounds)} quiet rounds" if quiet else "all rounds (none quiet)"
    bare = [(t, fb) for x in rounds for t, fb in zip(x.bare.times, x.bare.fb, strict=True)]
    service, bare_ms = ms(r.times("service", quiet)), ms([t for t, _ in bare])
    codec = ", ".join(f"{k} {v:.2f} ms" for k, v in r.codec_ms.items())
    engine = " vs ".join(f"{k} {v:,.1f} ms" for k, v in r.engine_ms.items())
    side = ", ".join(f"{k} {v:,.1f} ms" for k, v in r.side_ms.items())
    return (
        f"- `{r.size.model}`, {which}: service {service:,.1f} ms vs bare {bare_ms:,.1f} ms per "
        f"step ({service - bare_ms:+,.1f} ms). On the worker, the step (both ops, from the "
        f"forward_backward's start to both published) took {ms([x[2] for x in rows]):,.1f} ms "
        f"(bare forward + backward {ms([fb for _, fb in bare]):,.1f} ms, AdamW step + zero_grad "
        f"{ms([t - fb for t, fb in bare]):,.1f} ms); outside it (submit → start, published → "
        f"client) a step spent {ms([x[1] + x[3] for x in rows]):,.1f} ms. {r.snapshots} of the "
        f"{len(r.times('service'))} measured service steps wrote a snapshot. (De)serialisation "
        f"of one forward_backward, timed in-process with the same functions: {codec}. The "
        f"engine's forward_backward function run in-process on the bare model: {engine}. CPU "
        f"time per service step, by part: {side}."
    )


if __name__ == "__main__":
    sys.exit(main())
