"""What bench.train_throughput measures, as data, and how it is shown: the `## Training
throughput: many models on one worker` section of docs/benchmarks.md and the table on stdout."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from bench.harness.report import json_document, machine_line, reproduce
from bench.train_step_report import QUIET_CORES

SECTION = "## Training throughput: many models on one worker"
COMMAND = ".venv/bin/python -m bench.train_throughput"
# The targets: with this many concurrent models, batched over one at a time.
TARGET_MODELS = 8
TARGET_CPU = 2.0
TARGET_GPU = 3.0

BATCHED, SERIAL, PROCESSES = "batched", "one at a time", "process per model"
MODES: tuple[str, ...] = (BATCHED, SERIAL, PROCESSES)


@dataclass(frozen=True)
class Size:
    """One base model, the batch every step trains on (`batch` datums of `seq` tokens) and the
    model counts to measure."""

    label: str
    model: str
    batch: int
    seq: int
    counts: tuple[int, ...]
    warmup: int  # steps every model finishes before the window opens
    seconds: float  # least measured seconds per cell
    max_processes: int  # most worker processes the per-model mode starts (memory)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


@dataclass
class Cell:
    """One mode at one model count: what each model's training loop did in the window."""

    mode: str
    models: int
    tokens_per_step: int
    step_rates: list[float]  # steps per second of each model over the window
    window_s: float
    steps: int  # steps finished in the window, all models together
    foreign: float  # cores' worth of CPU other processes (plus steal) used in the window
    threads: int  # torch threads of each worker process
    ops_per_pass: float | None = None  # forward_backward ops per compute pass (one worker)
    cut_short: bool = False  # the window closed at the time limit, not at its steps

    @property
    def tokens_per_s(self) -> float:
        return sum(self.step_rates) * self.tokens_per_step

    @property
    def fairness(self) -> float:
        """Slowest model's step rate over the fastest's (1: every model got the same)."""
        return min(self.step_rates) / max(self.step_rates) if max(self.step_rates) else 0.0


@dataclass
class SizeResult:
    size: Size
    params: int
    lora_params: int
    bare_tokens_s: float | None = None  # the bare PEFT loop, one model, in-process
    cells: list[Cell] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # cells that failed, and why

    def cell(self, mode: str, models: int) -> Cell | None:
        return next((c for c in self.cells if c.mode == mode and c.models == models), None)

    def ratio(
        self, mode: str, other: str, models: int, other_models: int | None = None
    ) -> float | None:
        """tokens/s of `mode` at `models` over `other` at `other_models` (default the same)."""
        a = self.cell(mode, models)
        b = self.cell(other, models if other_models is None else other_models)
        if a is None or b is None or not b.tokens_per_s:
            return None
        return a.tokens_per_s / b.tokens_per_s


# --- output ------------------------------------------------------------------------------------
def times(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def tok(cell: Cell | None) -> str:
    """tokens/s; marked * for a window cut short at the time limit, † for a disturbed one."""
    if cell is None:
        return "–"
    return (
        f"{cell.tokens_per_s:,.0f}"
        + ("*" if cell.cut_short else "")
        + ("†" if cell.foreign >= QUIET_CORES else "")
    )


def verdict(r: SizeResult) -> str:
    speedup = r.ratio(BATCHED, SERIAL, TARGET_MODELS)
    if speedup is None:
        return f"`{r.size.model}`: not measured at {TARGET_MODELS} models"
    met = "met" if speedup >= TARGET_CPU else "not met"
    return f"`{r.size.model}`, {r.size.batch} × {r.size.seq}: {speedup:.2f}× (**{met}**)"


def table_lines(r: SizeResult) -> list[str]:
    lines = [
        f"`{r.size.model}` ({r.params:,} parameters, {r.lora_params:,} in one rank-32 "
        f"LoRA), steps of {r.size.batch} × {r.size.seq} tokens, tokens per second of "
        "training summed over all models:",
        "",
        "| models | batched | one at a time | process per model | batched ÷ one at a time "
        "| batched ÷ process per model | batched ÷ batched with 1 model "
        "| forward_backward ops per pass (batched) | slowest ÷ fastest model (batched) "
        "| window s (batched / one at a time / processes) "
        "| other processes, cores (same order) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n in r.size.counts:
        cells = [r.cell(mode, n) for mode in MODES]
        batched = cells[0]
        passes = (
            "–"
            if batched is None or batched.ops_per_pass is None
            else f"{batched.ops_per_pass:.1f}"
        )
        fair = "–" if batched is None else f"{batched.fairness:.2f}"
        window = " / ".join("–" if c is None else f"{c.window_s:.0f}" for c in cells)
        foreign = " / ".join("–" if c is None else f"{c.foreign:.2f}" for c in cells)
        lines.append(
            f"| {n} | {tok(cells[0])} | {tok(cells[1])} | {tok(cells[2])} "
            f"| **{times(r.ratio(BATCHED, SERIAL, n))}** | {times(r.ratio(BATCHED, PROCESSES, n))} "
            f"| {times(r.ratio(BATCHED, BATCHED, n, 1))} | {passes} | {fair} | {window} "
            f"| {foreign} |"
        )
    bare = "not measured" if r.bare_tokens_s is None else f"{r.bare_tokens_s:,.0f} tokens/s"
    lines += [
        "",
        f"The bare PEFT loop (bench.train_step's: one model, in the benchmark "
        f"process, no queue, same threads as a worker): {bare}.",
    ]
    if r.failures:
        lines += ["", "**Failed cells** (no number for them above): " + "; ".join(r.failures) + "."]
    if any(c.foreign >= QUIET_CORES for c in r.cells):
        lines += [
            "",
            f"† Other processes took {QUIET_CORES:g} cores or more during the "
            "window (last column): a 2-thread torch step slows down many times over "
            "when another process takes one of the cores, so that figure is disturbed.",
        ]
    if any(c.cut_short for c in r.cells):
        lines += [
            "",
            "\\* The window was closed at the cell's time limit (`--max-cell-s`) "
            "before every model had finished its steps in it.",
        ]
    return [*lines, ""]


def print_table(results: list[SizeResult]) -> None:
    for r in results:
        print(f"\n{r.size.model}, {r.size.batch} × {r.size.seq} tokens per step; tokens/s")
        print(
            f"{'models':>7}{'batched':>11}{'one-at-a-time':>15}{'processes':>11}"
            f"{'b÷1-at-a-time':>15}{'b÷procs':>9}{'ops/pass':>10}{'fair':>6}"
        )
        for n in r.size.counts:
            cells = [r.cell(mode, n) for mode in MODES]
            passes = cells[0].ops_per_pass if cells[0] is not None else None
            print(
                f"{n:>7}{tok(cells[0]):>11}{tok(cells[1]):>15}{tok(cells[2]):>11}"
                f"{times(r.ratio(BATCHED, SERIAL, n)):>15}"
                f"{times(r.ratio(BATCHED, PROCESSES, n)):>9}"
                f"{'–' if passes is None else f'{passes:.1f}':>10}"
                f"{'–' if cells[0] is None else f'{cells[0].fairness:.2f}':>6}"
            )
        if r.bare_tokens_s is not None:
            print(f"bare PEFT loop, one model: {r.bare_tokens_s:,.0f} tokens/s")
        for failure in r.failures:
            print(f"FAILED {failure}")
    print("\ntarget: " + "; ".join(verdict(r) for r in results))


INTRO = (
    "Aggregate training throughput when many users train at once: N models (each its own "
    "`TrainingClient`, rank-{rank} LoRA on the same base model) each run the Tinker loop "
    '`fb = await tc.forward_backward_async(batch, "cross_entropy"); opt = await '
    "tc.optim_step_async(adam); await fb; await opt` without pause, all N concurrently from one "
    "asyncio loop in the benchmark process, against real worker processes (`python -m "
    "queue_tinker.cli worker --engine lora --device cpu`), the local Redis and a scratch "
    "Postgres database. Every step trains on a fixed batch, datums × tokens in each table's "
    "title: 1 × 32 is a small step (a single short RL rollout), whose CPU time is mostly the "
    "per-op costs batching shares; 4 × 64 is a bigger step, closer to compute-bound on a CPU. "
    "Three ways to serve them:"
)
MODE_TEXT = [
    f"- **{BATCHED}**: one worker process, cross-adapter batching on "
    "(`QT_CROSS_ADAPTER_BATCH=1`): forward_backward ops of different models that wait at the "
    "same time run as one forward/backward pass.",
    f"- **{SERIAL}**: one worker process, batching off (`QT_CROSS_ADAPTER_BATCH=0`): the "
    "worker runs the models' ops one after another.",
    f"- **{PROCESSES}**: N worker processes, one per model, each its own deployment (own key "
    "prefix, so each serves exactly one model): what N users running their own trainer "
    "processes on the same machine get. The processes share the machine's cores; each "
    "computes with max(1, cores ÷ N) torch threads, its best case (more threads than cores "
    "between them only adds contention).",
]
METHOD = (
    "Each cell gets fresh workers. After every model has finished {warmup} warm-up steps, the "
    "window opens; it closes once it has lasted {seconds} and every model has finished at least "
    "{min_steps} steps in it. A model's rate is its steps in the window over the time between "
    "its first and last step there (so a window edge cutting a step in two counts for "
    "nothing), and the aggregate is the sum over models × tokens per step. *Ops per pass* is "
    "how many forward_backward ops the worker ran in one compute pass, from the Redis-clock "
    "`started_at` / `finished_at` of every op in the window (ops in one pass overlap; ops run "
    "one at a time never do). *Slowest ÷ fastest model* is 1 when every model got the same "
    "share."
)


def render(
    info: dict[str, str],
    results: list[SizeResult],
    method: dict[str, str],
    batching: str,
    total_s: float,
) -> str:
    """The docs section, in Markdown."""
    lines = [
        SECTION,
        "",
        INTRO.format(rank=method["rank"]),
        "",
        *MODE_TEXT,
        "",
        METHOD.format(**method),
        "",
        "Reproduce (`--quick` is a smoke run that leaves this file alone; `--models` picks "
        "the sizes, `--counts` the model counts):",
        "",
        *reproduce(COMMAND),
        "",
        machine_line(info) + f". The run took {total_s:.0f} s. {batching}",
        "",
        f"Target: with {TARGET_MODELS} models, batched ≥ {TARGET_CPU:g}× one at a time on "
        "the same CPU worker: " + "; ".join(verdict(r) for r in results) + f". The GPU "
        f"target (≥ {TARGET_GPU:g}×) needs a CUDA worker and is not measured by this run.",
        "",
    ]
    for r in results:
        lines += table_lines(r)
    lines += [
        "How to read it. One at a time, a worker's throughput can grow with N only by hiding "
        "the queue's own milliseconds (client, Redis, publish) behind the next model's "
        "compute. Batched, one pass carries every waiting model's datums, so the costs of a "
        "pass that do not grow with its batch (Python in the model's forward, the engine's "
        "per-op work, small matrix products that leave cores idle) are paid once per pass "
        "instead of once per model, against the cost of routing each row through its own "
        "adapter. The smaller a step's compute, the larger the share that batching saves. One "
        "process per model splits the cores between N copies of the base model and pays every "
        "per-op cost N times. These are CPU numbers from the machine above; compare figures "
        "from the same run only (the last column says how busy the rest of the machine was). "
        "On a GPU one small step leaves most of the device idle, which is where batching "
        "across models should pay most.",
        "",
    ]
    return "\n".join(lines)


def results_json(info: dict[str, str], results: list[SizeResult]) -> str:
    return json_document(
        info,
        sizes=[
            {
                "size": asdict(r.size),
                "params": r.params,
                "lora_params": r.lora_params,
                "bare_tokens_per_s": r.bare_tokens_s,
                "failures": r.failures,
                "cells": [
                    {
                        **asdict(c),
                        "tokens_per_s": c.tokens_per_s,
                        "median_step_rate": statistics.median(c.step_rates),
                    }
                    for c in r.cells
                ],
            }
            for r in results
        ],
    )
