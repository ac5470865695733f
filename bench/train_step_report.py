"""What bench.train_step measures, as data, and how it is shown: the `## Training step: service
vs bare PEFT` section of docs/benchmarks.md and the tables on stdout."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.harness.data import RANK
from bench.harness.report import json_document, machine_line, reproduce
from bench.harness.stats import Latency, Stages

SECTION = "## Training step: service vs bare PEFT"
COMMAND = ".venv/bin/python -m bench.train_step"
TARGET_RATIO = 1.10
# A round is quiet when other processes took less than this many cores' worth of CPU during
# each of its two blocks.
QUIET_CORES = 0.25

STAGE_NAMES: tuple[str, ...] = (
    "both submit calls return (overlaps the rows below)",
    "submit -> the step started (encode, enqueue both ops, the worker gathers the step, start "
    "script)",
    "the step on the worker: started -> both published (decode, compute both ops, encode, publish)",
    "published -> both results in the client's hand",
)


@dataclass(frozen=True)
class Size:
    """One model and its batch: `batch` datums of `seq` input tokens each."""

    label: str
    model: str
    batch: int
    seq: int
    steps: int  # steps per block
    budget_s: float  # no new round starts after this many seconds of rounds (2 rounds at least)


@dataclass
class Block:
    """One block of steps, and the CPU other processes took meanwhile."""

    times: list[float]  # seconds per step
    foreign: float  # cores' worth of CPU used by other processes (plus steal) during the block
    fb: list[float] = field(default_factory=list)  # bare steps: their forward + backward part

    @property
    def median(self) -> float:
        return statistics.median(self.times)


@dataclass
class Round:
    service: Block
    bare: Block

    @property
    def ratio(self) -> float:
        return self.service.median / self.bare.median

    @property
    def quiet(self) -> bool:
        return max(self.service.foreign, self.bare.foreign) < QUIET_CORES


@dataclass
class SizeResult:
    """Everything measured for one size."""

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

    @property
    def service(self) -> list[float]:
        return [t for r in self.rounds for t in r.service.times]

    @property
    def bare(self) -> list[float]:
        return [t for r in self.rounds for t in r.bare.times]

    @property
    def ratio(self) -> float:
        """Median service step over median bare step, every round: the headline number."""
        return statistics.median(self.service) / statistics.median(self.bare)

    @property
    def ratio_p10(self) -> float:
        """The same at the 10th percentiles: load from other processes only ever adds time,
        so the fast end of each distribution is the least disturbed."""
        return Latency(self.service).pct(10) / Latency(self.bare).pct(10)

    def quiet_rounds(self) -> list[Round]:
        return [r for r in self.rounds if r.quiet]

    def ratio_quiet(self) -> float | None:
        """The headline ratio over the rounds in which other processes stayed quiet."""
        quiet = self.quiet_rounds()
        if not quiet:
            return None
        return statistics.median(t for r in quiet for t in r.service.times) / statistics.median(
            t for r in quiet for t in r.bare.times
        )

    def foreign(self, side: str) -> float:
        """Mean CPU (cores) other processes took during this side's blocks."""
        return statistics.mean(getattr(r, side).foreign for r in self.rounds)


# --- output ------------------------------------------------------------------------------------
def spread(samples: list[float]) -> str:
    lat = Latency(samples)
    return f"{lat.p50:,.1f} ({lat.pct(10):,.1f}–{lat.p90:,.1f})"


def rounds_range(r: SizeResult) -> str:
    """Median (min–max) of the per-round ratios."""
    ratios = [x.ratio for x in r.rounds]
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})"


def shape(size: Size) -> str:
    return f"{size.batch} × {size.seq}"


def quiet_text(r: SizeResult) -> str:
    """The ratio over quiet rounds, with how many rounds were quiet."""
    ratio = r.ratio_quiet()
    value = "n/a" if ratio is None else f"{ratio:.2f}"
    return f"{value} ({len(r.quiet_rounds())} of {len(r.rounds)})"


def foreign_text(r: SizeResult) -> str:
    return f"{r.foreign('service'):.2f} / {r.foreign('bare'):.2f}"


def print_table(results: list[SizeResult]) -> None:
    """Per-step medians and ratio per size, then the service step's stages."""
    print(
        f"\n{'model':<26}{'batch':>9}{'bare ms p50 (p10-p90)':>28}"
        f"{'service ms p50 (p10-p90)':>30}{'ratio':>7}{'p10':>6}{'quiet':>16}"
        f"{'per round':>20}{'other cores s/b':>17}"
    )
    for r in results:
        print(
            f"{r.size.model:<26}{shape(r.size):>9}{spread(r.bare):>28}{spread(r.service):>30}"
            f"{r.ratio:>7.2f}{r.ratio_p10:>6.2f}{quiet_text(r):>16}{rounds_range(r):>20}"
            f"{foreign_text(r):>17}"
        )
    for r in results:
        print(
            f"\nservice step, {r.size.model} (median ms): "
            f"threads {r.threads}, first loss service {r.first_loss[0]:.4f} / "
            f"bare {r.first_loss[1]:.4f}"
        )
        for name, value in r.stages.medians_ms().items():
            print(f"  {name:<110}{value:>8.1f}")
        print("  " + ", ".join(f"{k} {v:.2f}" for k, v in r.codec_ms.items()))
        print("  " + ", ".join(f"{k} {v:.2f}" for k, v in r.engine_ms.items()))
        print(
            "  CPU ms per service step: " + ", ".join(f"{k} {v:.1f}" for k, v in r.side_ms.items())
        )
        for quiet in (False, True):
            parts = split(r, quiet) or {}
            print(
                f"  {'quiet' if quiet else 'all'}: "
                + ", ".join(f"{k} {v:,.1f}" for k, v in parts.items())
            )


INTRO = (
    "Time per training step (`forward_backward` + `optim_step`) through the service, against "
    "a bare in-process PEFT loop on the same model, LoRA config (rank {rank}, alpha 32, "
    "dropout 0, every attention, MLP and unembedding linear) and data, measured in the same "
    "run. Service: a real worker process (`python -m queue_tinker.cli worker --engine lora "
    "--device cpu`, production defaults: cross-adapter batching on, so the worker gathers a "
    "step's two ops and runs them as one batch), the local Redis and a scratch Postgres "
    "database; a "
    'step is the natural Tinker loop `fb = tc.forward_backward(batch, "cross_entropy"); '
    "os = tc.optim_step(AdamParams(learning_rate=1e-4)); fb.result(); os.result()`. Bare: "
    "`load_base_model` + `peft.get_peft_model` + `torch.optim.AdamW` (same hyperparameters) in "
    "the benchmark process; a step is forward, target logprobs, loss = -Σ w·logp, backward, "
    "AdamW step, zero_grad. After {warmup} warm-up steps of each, rounds alternate a block of "
    "N service steps with a block of N bare steps (the order flips every round; up to {rounds} "
    "rounds, fewer once a time budget is spent), so the two never compute at the same time, "
    "and the bare loop uses as many torch threads as the worker. Blocks are short (one step at "
    "100M) because load from other jobs on this machine comes in bursts of seconds: a round's "
    "ratio compares steps taken moments apart."
)
NOISE = (
    "Other jobs shared this 2-core machine during the run, and a 2-thread torch step slows "
    "down many times over when another process takes one of the cores (each parallel region "
    "waits for its slowest thread). So the benchmark measures, for every block, how much CPU "
    "the rest of the machine used meanwhile (all cores' busy time from /proc/stat, steal "
    "included, minus the benchmark's and the worker's own; last column, in cores). A round is "
    "*quiet* when that stayed under {quiet:g} cores during both of its blocks; the quiet-rounds "
    "ratio is the least disturbed comparison, the all-rounds ratio is the headline. Compare "
    "numbers from the same run only."
)
HOW_TO_READ = [
    "How to read it: service minus bare is what the service adds to a step; the notes above "
    "split it two ways.",
    "",
    "1. Outside the worker's step (submit → started, published → client): the client "
    "validating and msgpack-encoding the batch, two enqueue scripts, the worker's wake-up on "
    "its op stream, its wait for the rest of the step (the optim_step, sent once the "
    "forward_backward's submit returned) and the start script, the publish scripts and the "
    "pub/sub messages back. A few milliseconds per step whatever the model size.",
    "2. The step on the worker: decoding and checking the batch (timed separately: well under "
    "a millisecond at these shapes), the hop onto the worker's compute thread, the engine's "
    "general per-datum path (padding from token lists, per-datum logprob slices, losses and "
    "outputs) where the bare loop does one vectorised cross-entropy (the engine function "
    "timed in-process against the bare forward + backward isolates that part), the "
    "gradient-norm pass of optim_step (`clip_grad_norm_`, run even without clipping because "
    "the step reports `grad_norm`), and every `snapshot_every_steps` (20) optimizer steps a "
    "snapshot of the adapter and its AdamW moments to storage, which shows in the p90/p99 "
    "rather than in the median. On this 2-core machine the step also competes with the "
    "service's own work beside it: the worker's event loop, Redis, Postgres and the client "
    '("CPU time per service step, by part" above) run on the same two cores as the 2-thread '
    "compute, and a 2-thread torch step feels every millisecond taken from one of its cores.",
    "",
    "These are CPU numbers. The fixed part (1) dominates the tiny model's ratio; at 100M "
    "parameters the compute dominates and the ratio is close to 1. On a GPU a step's compute "
    "shrinks by one to two orders of magnitude while (1) and the Python of (2) do not, so the "
    "ratio there will sit closer to the tiny row than to the 100M row: judge the service by "
    "its added milliseconds per step, not only by the ratio.",
]


def stage_lines(r: SizeResult) -> list[str]:
    lines = [
        f"Where a service step goes, `{r.size.model}` ({shape(r.size)}), in ms (client "
        "clock plus the Redis-clock `started_at` / `finished_at` the worker writes into "
        "each job hash; the rows after the first add up to the step):",
        "",
        "| stage | p50, all rounds | p50, quiet rounds | p99, all rounds |",
        "| --- | --- | --- | --- |",
    ]
    p50, quiet, p99 = r.stages.medians_ms(), r.quiet_stages.medians_ms(), r.stages.p99s_ms()
    for name in STAGE_NAMES:
        q = f"{quiet[name]:,.1f}" if name in quiet else "n/a"
        lines.append(f"| {name} | {p50.get(name, 0):,.1f} | {q} | {p99.get(name, 0):,.1f} |")
    return [*lines, ""]


def ms(values: Sequence[float]) -> float:
    return statistics.median(values) * 1000


def split(r: SizeResult, quiet: bool) -> dict[str, float] | None:
    """Median milliseconds of the parts the service step and the bare step share, over the
    quiet rounds or all of them (None when there are none)."""
    rounds = r.quiet_rounds() if quiet else r.rounds
    rows = (r.quiet_stages if quiet else r.stages).rows
    if not rounds or not rows:
        return None
    bare = [(t, fb) for x in rounds for t, fb in zip(x.bare.times, x.bare.fb, strict=True)]
    return {
        "service": ms([t for x in rounds for t in x.service.times]),
        "bare": ms([t for t, _ in bare]),
        "service on the worker": ms([row[2] for row in rows]),
        "bare fb": ms([fb for _, fb in bare]),
        "bare optim": ms([t - fb for t, fb in bare]),
        "queue": ms([row[1] + row[3] for row in rows]),
    }


def overhead_note(r: SizeResult) -> str:
    """The service's median extra over bare, split at the worker's op boundaries (over the
    quiet rounds when there are any)."""
    quiet = bool(r.quiet_rounds())
    m = split(r, quiet)
    if m is None:
        return f"- `{r.size.model}`: no service step has its job timestamps."
    which = f"the {len(r.quiet_rounds())} quiet rounds" if quiet else "all rounds (none quiet)"
    codec = ", ".join(f"{k} {v:.2f} ms" for k, v in r.codec_ms.items())
    engine = " vs ".join(f"{k} {v:,.1f} ms" for k, v in r.engine_ms.items())
    side = ", ".join(f"{k} {v:,.1f} ms" for k, v in r.side_ms.items())
    return (
        f"- `{r.size.model}`, {which}: service {m['service']:,.1f} ms vs bare "
        f"{m['bare']:,.1f} ms per step ({m['service'] - m['bare']:+,.1f} ms). On the "
        f"worker, the step (both ops, from the forward_backward's start to both published) "
        f"took {m['service on the worker']:,.1f} ms (bare forward + backward "
        f"{m['bare fb']:,.1f} ms, AdamW step + zero_grad {m['bare optim']:,.1f} ms); outside "
        f"it (submit → start, published → client) a step spent {m['queue']:,.1f} ms. "
        f"{r.snapshots} of the {len(r.service)} measured service steps wrote a snapshot. "
        f"(De)serialisation of one forward_backward, timed in-process with the same "
        f"functions: {codec}. The engine's forward_backward function run in-process on the "
        f"bare model: {engine}. CPU time per service step, by part: {side}."
    )


def result_rows(results: list[SizeResult]) -> list[str]:
    lines = [
        "| model | params (LoRA) | batch (datums × tokens) | rounds × steps "
        "| bare ms/step p50 (p10–p90) | service ms/step p50 (p10–p90) "
        "| service / bare (medians) | at p10 | quiet rounds only (how many) "
        "| per round: median (min–max) | other processes, cores (service / bare blocks) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| `{r.size.model}` | {r.params:,} ({r.lora_params:,}) | {shape(r.size)} "
            f"| {len(r.rounds)} × {r.size.steps} | {spread(r.bare)} | {spread(r.service)} "
            f"| **{r.ratio:.2f}** | {r.ratio_p10:.2f} | {quiet_text(r)} | {rounds_range(r)} "
            f"| {foreign_text(r)} |"
        )
    return [*lines, ""]


def render(
    args: argparse.Namespace, info: dict[str, str], results: list[SizeResult], total_s: float
) -> str:
    """The docs section, in Markdown."""
    largest = results[-1]
    ok = largest.ratio <= TARGET_RATIO
    threads = ", ".join(f"{k} {v}" for k, v in largest.threads.items())
    lines = [
        SECTION,
        "",
        INTRO.format(rank=RANK, warmup=args.warmup, rounds=args.rounds),
        "",
        "Reproduce (`--quick` is a smoke run that leaves this file alone):",
        "",
        *reproduce(COMMAND),
        "",
        machine_line(info) + f"; torch threads: {threads}. The run took {total_s:.0f} s.",
        "",
        NOISE.format(quiet=QUIET_CORES),
        "",
        f"Target: service / bare ≤ {TARGET_RATIO:.2f} at `{largest.size.model}` (median "
        f"step over median step, all rounds): **{largest.ratio:.3f}, "
        f"{'met' if ok else 'not met'}** (quiet rounds only: {quiet_text(largest)}).",
        "",
        *result_rows(results),
    ]
    for r in results:
        lines += stage_lines(r)
    lines += [
        "Medians per step, split where the two steps can be compared:",
        "",
        *(overhead_note(r) for r in results),
    ]
    return "\n".join([*lines, "", *HOW_TO_READ, ""])


def results_json(info: dict[str, str], results: list[SizeResult]) -> str:
    return json_document(info, sizes=[size_json(r) for r in results])


def size_json(r: SizeResult) -> dict[str, Any]:
    """Every number measured for one size."""
    return {
        "size": asdict(r.size),
        "params": r.params,
        "lora_params": r.lora_params,
        "threads": r.threads,
        "ratio": r.ratio,
        "ratio_quiet": r.ratio_quiet(),
        "rounds": [asdict(x) for x in r.rounds],
        "bare_s": r.bare,
        "service_s": r.service,
        "first_loss": r.first_loss,
        "stages_p50_ms": r.stages.medians_ms(),
        "snapshots": r.snapshots,
        "load": r.load,
        "codec_ms": r.codec_ms,
        "engine_ms": r.engine_ms,
        "side_cpu_ms": r.side_ms,
    }
