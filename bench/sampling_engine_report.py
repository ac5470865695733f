"""What bench.sampling_engine measures, as data, and how it is shown: the `## Sampling engine`
section of docs/benchmarks.md (`## Sampling engine on a GPU` for a CUDA run) and its table."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import numpy as np

from bench.harness.report import machine_line, reproduce

SECTION = "## Sampling engine: continuous batching, shared prompts, fair turns"
GPU_SECTION = "## Sampling engine on a GPU"
COMMAND = ".venv/bin/python -m bench.sampling_engine"


@dataclass(frozen=True)
class Size:
    model: str
    tokens: int  # max_tokens of the staggered, simultaneous and shared-prompt requests
    fair_rows: int  # num_samples of the long sample in the fair-turns case
    fair_tokens: int
    rounds: int  # of each timed call (median taken)
    long_prompt: int = 192  # tokens of the long-prompt case (within the model's context)
    long_rows: int = 32  # requests of the long-samples case
    long_tokens: int = 512  # their max_tokens (+ 48 prompt tokens within the model's context)
    staggered: int = 48
    simultaneous: int = 32
    shared: int = 16


@dataclass
class Result:
    size: Size
    params: int = 0
    alone_s: list[float] = field(default_factory=list)  # one staggered-size request alone
    staggered_latency_s: list[float] = field(default_factory=list)  # per request, last round
    staggered_median_s: list[float] = field(default_factory=list)  # per round
    staggered_tok_s: list[float] = field(default_factory=list)
    generate_staggered_tok_s: list[float] = field(default_factory=list)
    simultaneous_tok_s: list[float] = field(default_factory=list)
    generate_simultaneous_tok_s: list[float] = field(default_factory=list)
    shared_tok_s: list[float] = field(default_factory=list)
    separate_tok_s: list[float] = field(default_factory=list)
    long_shared_tok_s: list[float] = field(default_factory=list)  # num_samples of a long prompt
    long_distinct_tok_s: list[float] = field(default_factory=list)  # as many long prompts
    long_samples_tok_s: list[float] = field(default_factory=list)
    generate_long_samples_tok_s: list[float] = field(default_factory=list)
    step_alone_s: list[float] = field(default_factory=list)
    step_under_s: list[float] = field(default_factory=list)
    sample_alone_s: float = 0.0
    sample_shared_s: float = 0.0


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def p90(values: list[float]) -> float:
    return float(np.percentile(values, 90)) if values else float("nan")


Row = tuple[str, str, str, float, str]  # what, service, baseline, ratio, target


def tokens_row(what: str, service: list[float], baseline: list[float], target: str) -> Row:
    """Two tokens/s figures of the same run, medians over rounds, and their ratio."""
    ours, theirs = median(service), median(baseline)
    return (what, f"{ours:,.0f} tok/s", f"{theirs:,.0f} tok/s", ours / theirs, target)


def rows(r: Result) -> list[Row]:
    """(what, service, baseline, ratio, target) per measurement."""
    s = r.size
    alone, stag = median(r.alone_s), median(r.staggered_median_s)
    return [
        (
            f"staggered: {s.staggered} requests, Poisson over 1.5 s, {s.tokens} tokens each — "
            "median latency (lower is better)",
            f"{stag * 1000:,.0f} ms",
            f"one alone: {alone * 1000:,.0f} ms",
            stag / alone,
            "≤ 2×",
        ),
        tokens_row(
            "staggered: the stream's tokens/s vs generate() on the same requests at once",
            r.staggered_tok_s,
            r.generate_staggered_tok_s,
            "stated",
        ),
        tokens_row(
            f"{s.simultaneous} requests at once, {s.tokens} tokens each, vs generate()",
            r.simultaneous_tok_s,
            r.generate_simultaneous_tok_s,
            "≥ 1.2×",
        ),
        tokens_row(
            f"{s.long_rows} requests at once, {s.long_tokens} tokens each (long samples), vs "
            "generate()",
            r.long_samples_tok_s,
            r.generate_long_samples_tok_s,
            "stated",
        ),
        tokens_row(
            f"num_samples={s.shared} of one prompt vs {s.shared} requests of it",
            r.shared_tok_s,
            r.separate_tok_s,
            "≥ 1.5×",
        ),
        tokens_row(
            f"num_samples={s.shared} of one {s.long_prompt}-token prompt vs {s.shared} requests "
            f"of distinct {s.long_prompt}-token prompts (what sharing the prefill saves)",
            r.long_shared_tok_s,
            r.long_distinct_tok_s,
            "stated",
        ),
        (
            f"training step p90 while another tenant samples {s.fair_rows} × {s.fair_tokens} "
            "(lower is better)",
            f"{p90(r.step_under_s) * 1000:,.0f} ms "
            f"(p50 {median(r.step_under_s) * 1000:,.0f}, {len(r.step_under_s)} steps)",
            f"alone: {p90(r.step_alone_s) * 1000:,.0f} ms (p50 "
            f"{median(r.step_alone_s) * 1000:,.0f})",
            p90(r.step_under_s) / p90(r.step_alone_s),
            "≤ 3×",
        ),
        (
            f"that {s.fair_rows} × {s.fair_tokens} sample's time, sharing the worker with the "
            "trainer (lower is better)",
            f"{r.sample_shared_s:,.1f} s",
            f"alone: {r.sample_alone_s:,.1f} s",
            r.sample_shared_s / r.sample_alone_s,
            "stated",
        ),
    ]


def table(results: list[Result]) -> list[str]:
    lines = [
        "| model (params) | measurement | service | same-run baseline | ratio | target |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        for what, service, baseline, ratio, target in rows(r):
            lines.append(
                f"| `{r.size.model}` ({r.params / 1e6:,.1f}M) | {what} | {service} "
                f"| {baseline} | **{ratio:.2f}×** | {target} |"
            )
    return [*lines, ""]


INTRO = (
    "The worker's decode loop (continuous batching: requests join and leave between steps; a "
    "prompt prefilled once for its `num_samples` rows; training ops of other models run "
    "between quanta of decode steps) measured through the service. One real LoRA worker "
    "process (`queue-tinker worker --engine lora --device cpu`, production defaults), the "
    "local Redis and a scratch Postgres; requests have a seed, temperature 1 and `stop=[]` "
    "(every request generates exactly `max_tokens`). Staggered: the requests arrive as a "
    "Poisson stream over 1.5 s (prompts of 8–48 random byte tokens), latency from submit to "
    "result; one alone is a request with the stream's median prompt length. generate(): "
    "transformers' `model.generate(do_sample=True, min_new_tokens=max_new_tokens)` on the same "
    "prompts at once, left-padded, in the benchmark process. Fair turns: one tenant runs "
    "training steps (forward_backward + optim_step on one 64-token datum, rank 8, sent "
    "together, timed from submit to the optim_step's result) one after another, first alone, "
    "then while another tenant's single request samples the long batch. Ratios compare "
    "figures of the same run (medians over rounds). CPU numbers from a shared 2-core "
    "machine: other processes compete for the cores, so compare within a run only."
)


READING = (
    "How to read it. Every figure is a CPU figure, where a decode step's cost grows with its "
    "rows (at 100M nearly in proportion, so 48 requests sharing the 2 cores take about 48 "
    "times one request's compute, and their median latency cannot come near one alone's; the "
    "≤ 2× latency target assumes a device on which a step of 48 rows costs about what a step "
    "of one does). The shared-prompt baseline sends 16 requests of the same prompt, which the "
    "loop also prefills once when they arrive together, so what differs is the queue's "
    "per-request cost; a prompt of 8–48 tokens is a small part of 64 generated tokens. The "
    "long-prompt row shows what the sharing saves: one long prompt's samples against as many "
    "distinct prompts of that length, each prefilled. The long-samples row is where the cache "
    "written in place shows: generate()'s cache (and the loop's before it) copies every "
    "layer's keys and values at every step, a cost that grows with the square of the length, "
    "while the loop writes one column (workers/sampling/kv_cache.py); on the tiny model the "
    "cache is "
    "too small for that to matter. The fair-turns rows are the scheduling: "
    "the trainer's steps run between quanta of the long sample instead of after it. The tiny "
    "model's rows are per-request overhead, not compute: generate() makes the 32 requests' "
    "2,048 tokens in about a tenth of a second, so the queue's fixed cost per request "
    "(enqueue script, pick-up, publish, the result's way back) is a large share of the "
    "service's time. Two torch threads per process oversubscribe the cores when other jobs "
    "run, so the runs use one thread per process."
)


GPU_INTRO = (
    "The same benchmark as the section above, with the worker and generate() on one CUDA GPU "
    "(`--device cuda`: the base model in bf16, adapters in fp32), the embedded Redis and "
    "Postgres on the same machine, after one untimed round (a GPU warms up per shape: kernels, "
    "allocator). On a GPU a decode step of 48 rows costs about what one of a single row does, "
    "which is the device the latency target assumes."
)


def render(
    info: dict[str, str],
    results: list[Result],
    total_s: float,
    threads: int,
    device: str,
    decode_step: str | None = None,
) -> str:
    gpu = device != "cpu"
    return "\n".join(
        [
            GPU_SECTION if gpu else SECTION,
            "",
            GPU_INTRO if gpu else INTRO,
            "",
            "Reproduce:",
            "",
            *reproduce(
                f"{COMMAND} --threads {threads} --device {device} "
                + (f"--decode-step {decode_step} " if decode_step else "")
                + "--models "
                + " ".join(r.size.model for r in results)
            ),
            "",
            machine_line(info)
            + f"; torch threads {threads} in every process (OMP_NUM_THREADS={threads} for the "
            f"worker). The run took {total_s:.0f} s.",
            "",
            *table(results),
            *([] if gpu else [READING, ""]),
        ]
    )
