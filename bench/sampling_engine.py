"""The sampling engine through the service, each measurement against a same-run baseline; the
method is `## Sampling engine: ...` of docs/benchmarks.md (`... on a GPU` on CUDA)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.decode_step import Prompts
from bench.harness import cli
from bench.harness.baselines import generate, left_padded
from bench.harness.data import datums, random_prompts, sampling_params
from bench.harness.meters import timed
from bench.harness.models import ensure_model, frozen_base
from bench.harness.report import Report, Table, docs_of, emit
from bench.harness.run import TORCH, service_run
from bench.harness.services import deployment, service_client
from bench.harness.workers import lora_worker, use_torch_threads
from queue_tinker.client import SamplingClient, ServiceClient, TrainingClient
from queue_tinker.types import AdamParams, Datum, ModelInput, SamplingParams

SECTION = "## Sampling engine: continuous batching, shared prompts, fair turns"
GPU_SECTION = "## Sampling engine on a GPU"
COMMAND = ".venv/bin/python -m bench.sampling_engine"
TIMEOUT_S = 900.0


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


TINY, BIG = "queue-tinker/tiny-llama", "queue-tinker/llama-100m"
SIZES = {
    TINY: Size(TINY, 64, 512, 128, 3, long_prompt=160, long_tokens=192),
    BIG: Size(BIG, 32, 64, 32, 2, long_prompt=960, long_rows=16, long_tokens=384),
}


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def p90(values: list[float]) -> float:
    return float(np.percentile(values, 90)) if values else float("nan")


def generate_tok_s(model: Any, batch: Prompts, tokens: int) -> float:
    """transformers' generate() on the prompts at once, left-padded: generated tokens/s."""
    device = next(model.parameters()).device
    ids, mask = left_padded(batch, device)
    return len(batch) * tokens / timed(lambda: generate(model, ids, mask, tokens), device)


async def timed_sample(
    sampler: SamplingClient, prompt: list[int], n: int, sampling: SamplingParams, delay_s: float = 0
) -> float:
    """Wait `delay_s`, then one request; seconds from submit to result (checked)."""
    await asyncio.sleep(delay_s)
    began = time.perf_counter()
    response = await (await sampler.sample_async(ModelInput.from_ints(prompt), n, sampling))
    assert all(len(s.tokens) == sampling.max_tokens for s in response.sequences)
    return time.perf_counter() - began


def sent(
    sampler: SamplingClient, batch: Prompts, n: int, tokens: int, seed: int, delays: Sequence[float]
) -> tuple[list[float], float]:
    """Request i sent after `delays[i]` seconds: each one's latency, and the generated tokens/s
    from the first submit to the last result."""

    async def go() -> tuple[list[float], float]:
        began = time.perf_counter()
        each = (
            timed_sample(sampler, p, n, sampling_params(seed + i, tokens), delays[i])
            for i, p in enumerate(batch)
        )
        latencies = await asyncio.wait_for(asyncio.gather(*each), TIMEOUT_S)
        return list(latencies), len(batch) * n * tokens / (time.perf_counter() - began)

    return asyncio.run(go())


def at_once(sampler: SamplingClient, batch: Prompts, n: int, tokens: int, seed: int) -> float:
    """The requests sent together: generated tokens/s, first submit to last result."""
    return sent(sampler, batch, n, tokens, seed, [0.0] * len(batch))[1]


def train_steps(tc: TrainingClient, batch: list[Datum], count: int) -> list[float]:
    """`count` training steps one after another (forward_backward then optim_step, sent
    together): each step's seconds from submit to the optim_step's result."""
    seconds = []
    for _ in range(count):
        began = time.perf_counter()
        fwd = tc.forward_backward(batch, "cross_entropy")
        opt = tc.optim_step(AdamParams(learning_rate=1e-4))
        fwd.result(TIMEOUT_S)
        opt.result(TIMEOUT_S)
        seconds.append(time.perf_counter() - began)
    return seconds


def fair_turns(service: ServiceClient, trainer: ServiceClient, size: Size, result: Result) -> None:
    """The trainer's steps alone, the long sample alone, then both at once."""
    tc = trainer.create_lora_training_client(size.model, rank=8, seed=0)
    batch = datums([np.random.default_rng(7).integers(0, 256, 65)], weights=False)
    train_steps(tc, batch, 3)  # warm-up: created, resident, kernels loaded
    result.step_alone_s = train_steps(tc, batch, 15)
    sampler = service.create_sampling_client(base_model=size.model)
    prompt = random_prompts(1, 9)[0][:16]
    long = sampling_params(5, size.fair_tokens)
    result.sample_alone_s = asyncio.run(timed_sample(sampler, prompt, size.fair_rows, long))
    began = time.perf_counter()
    future = sampler.sample(ModelInput.from_ints(prompt), size.fair_rows, long)
    while not future.done():
        step = train_steps(tc, batch, 1)[0]
        if not future.done():  # a step that ended after the sample is not "under" it
            result.step_under_s.append(step)
    future.result(TIMEOUT_S)
    result.sample_shared_s = time.perf_counter() - began


def measure(args: argparse.Namespace, size: Size, database_url: str, data_dir: Path) -> Result:
    ensure_model(size.model, data_dir)
    local = frozen_base(size.model, args.device, data_dir)
    result = Result(size, sum(p.numel() for p in local.parameters()))
    # The worker's QT_DECODE_STEP when --decode-step names one (else its default).
    env = {"QT_DECODE_STEP": args.decode_step} if args.decode_step else {}
    with deployment(args.redis_url, database_url, "sampling-engine", data_dir) as settings:
        log = data_dir / f"worker-{settings.key_prefix}.log"
        with (
            lora_worker(settings, size.model, log, env=env, device=args.device),
            service_client(settings.model_copy(update={"tenant": "trainer"})) as trainer,
            service_client(settings.model_copy(update={"tenant": "sampler"})) as service,
        ):
            sampler = service.create_sampling_client(base_model=size.model)
            warm = random_prompts(size.simultaneous, 2)[:4]
            at_once(sampler, warm, 1, 4, 0)  # warm-up: the worker's loop is made
            generate_tok_s(local, warm, 4)
            if args.device != "cpu":  # a GPU warms up per shape (kernels, allocator)
                run_round(sampler, local, Result(size), 0)
            for r in range(size.rounds):
                run_round(sampler, local, result, r)
            fair_turns(service, trainer, size, result)
    return result


def run_round(sampler: SamplingClient, local: torch.nn.Module, result: Result, r: int) -> None:
    """Round `r` of every measurement but the fair turns (the same prompts every round)."""
    size = result.size
    stream, together = random_prompts(size.staggered, 1), random_prompts(size.simultaneous, 2)
    shared_prompt = random_prompts(1, 3)[0]
    median_prompt = sorted(stream, key=len)[len(stream) // 2]
    alone = sampling_params(100 + r, size.tokens)
    result.alone_s.append(asyncio.run(timed_sample(sampler, median_prompt, 1, alone)))
    # The stream: the requests as a Poisson stream over 1.5 s.
    seed = 1000 * (r + 1)
    rng = np.random.default_rng(seed)
    arrivals = [float(a) for a in np.cumsum(rng.exponential(1.5 / len(stream), len(stream)))]
    latencies, tok_s = sent(sampler, stream, 1, size.tokens, seed, arrivals)
    result.staggered_latency_s = latencies
    result.staggered_median_s.append(median(latencies))
    result.staggered_tok_s.append(tok_s)
    result.generate_staggered_tok_s.append(generate_tok_s(local, stream, size.tokens))
    result.simultaneous_tok_s.append(at_once(sampler, together, 1, size.tokens, 2000))
    result.generate_simultaneous_tok_s.append(generate_tok_s(local, together, size.tokens))
    long_batch = together[: size.long_rows]
    result.long_samples_tok_s.append(at_once(sampler, long_batch, 1, size.long_tokens, 5000))
    result.generate_long_samples_tok_s.append(generate_tok_s(local, long_batch, size.long_tokens))
    result.shared_tok_s.append(at_once(sampler, [shared_prompt], size.shared, size.tokens, 3000))
    separate = [shared_prompt] * size.shared
    result.separate_tok_s.append(at_once(sampler, separate, 1, size.tokens, 3000))
    # What sharing the prefill saves: one long prompt's samples vs as many long prompts.
    long = np.random.default_rng(4 + r).integers(0, 256, (size.shared, size.long_prompt)).tolist()
    result.long_shared_tok_s.append(at_once(sampler, long[:1], size.shared, size.tokens, 4000))
    result.long_distinct_tok_s.append(at_once(sampler, long, 1, size.tokens, 4000))
    print(
        f"  round {r + 1}: alone {result.alone_s[-1] * 1000:,.0f} ms, staggered median "
        f"{result.staggered_median_s[-1] * 1000:,.0f} ms, at once "
        f"{result.simultaneous_tok_s[-1]:,.0f} tok/s",
        flush=True,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.parser("bench.sampling_engine", __doc__, services=True)
    steps = ["auto", "padded", "slots", "graphs"]
    parser.add_argument("--decode-step", choices=steps, help="the worker's QT_DECODE_STEP")
    cli.add_models(parser, SIZES, default=["queue-tinker/tiny-llama"])
    cli.add_torch(parser)
    return cli.parse(parser, argv)


def sizes(args: argparse.Namespace) -> list[Size]:
    if args.quick:
        quick = {"staggered": 8, "simultaneous": 8, "shared": 4}
        return [Size(m, 8, 32, 16, 1, 32, 4, 32, **quick) for m in args.models]
    return [SIZES[m] for m in args.models]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_torch_threads(args.threads)
    results = []
    with service_run(args, TORCH, "qt-bench-sampling-engine-") as run:
        for size in sizes(args):
            print(f"{size.model}:", flush=True)
            results.append(measure(args, size, run.database_url, run.data_dir))
    info = {**run.info, "worker QT_DECODE_STEP": args.decode_step or "default"}
    result = report(info, results, run.total_s, args.threads, args.device, args.decode_step)
    emit(result, docs_of(args), args.json)
    return 0


Row = tuple[str, str, str, float, str]  # what, service, baseline, ratio, target


def tokens_row(what: str, service: list[float], baseline: list[float], target: str) -> Row:
    """Two tokens/s figures of the same run, medians over rounds, and their ratio."""
    ours, theirs = median(service), median(baseline)
    return (what, f"{ours:,.0f} tok/s", f"{theirs:,.0f} tok/s", ours / theirs, target)


def rows(r: Result) -> list[Row]:
    """(what, service, baseline, ratio, target) per measurement."""
    s = r.size
    alone, stag = median(r.alone_s), median(r.staggered_median_s)
    sample = f"{s.fair_rows} × {s.fair_tokens}"
    step_under, step_alone = r.step_under_s, r.step_alone_s
    return [
        (f"staggered: {s.staggered} requests, Poisson over 1.5 s, {s.tokens} tokens each — "
         "median latency (lower is better)",
         f"{stag * 1000:,.0f} ms", f"one alone: {alone * 1000:,.0f} ms", stag / alone, "≤ 2×"),
        tokens_row("staggered: the stream's tokens/s vs generate() on the same requests at once",
                   r.staggered_tok_s, r.generate_staggered_tok_s, "stated"),
        tokens_row(f"{s.simultaneous} requests at once, {s.tokens} tokens each, vs generate()",
                   r.simultaneous_tok_s, r.generate_simultaneous_tok_s, "≥ 1.2×"),
        tokens_row(f"{s.long_rows} requests at once, {s.long_tokens} tokens each (long samples), "
                   "vs generate()", r.long_samples_tok_s, r.generate_long_samples_tok_s, "stated"),
        tokens_row(f"num_samples={s.shared} of one prompt vs {s.shared} requests of it",
                   r.shared_tok_s, r.separate_tok_s, "≥ 1.5×"),
        tokens_row(f"num_samples={s.shared} of one {s.long_prompt}-token prompt vs {s.shared} "
                   f"requests of distinct {s.long_prompt}-token prompts (what sharing the prefill "
                   "saves)", r.long_shared_tok_s, r.long_distinct_tok_s, "stated"),
        (f"training step p90 while another tenant samples {sample} (lower is better)",
         f"{p90(step_under) * 1000:,.0f} ms "
         f"(p50 {median(step_under) * 1000:,.0f}, {len(step_under)} steps)",
         f"alone: {p90(step_alone) * 1000:,.0f} ms (p50 {median(step_alone) * 1000:,.0f})",
         p90(step_under) / p90(step_alone), "≤ 3×"),
        (f"that {sample} sample's time, sharing the worker with the trainer (lower is better)",
         f"{r.sample_shared_s:,.1f} s", f"alone: {r.sample_alone_s:,.1f} s",
         r.sample_shared_s / r.sample_alone_s, "stated"),
    ]  # fmt: skip


def table(results: list[Result]) -> Table:
    return Table(
        ("model (params)", "measurement", "service", "same-run baseline", "ratio", "target"),
        [(f"`{r.size.model}` ({r.params / 1e6:,.1f}M)", what, ours, theirs, f"**{x:.2f}×**", t)
         for r in results for what, ours, theirs, x, t in rows(r)],
    )  # fmt: skip


def report(
    info: dict[str, str],
    results: list[Result],
    total_s: float,
    threads: int,
    device: str,
    decode_step: str | None = None,
) -> Report:
    """Every measurement against its same-run baseline (`## Sampling engine on a GPU` for a
    CUDA run, so a GPU run leaves the CPU's section alone)."""
    step = f"--decode-step {decode_step} " if decode_step else ""
    models = " ".join(r.size.model for r in results)
    command = f"{COMMAND} --threads {threads} --device {device} {step}--models {models}"
    facts = [
        f"Torch threads {threads} in every process (OMP_NUM_THREADS={threads} for the worker).",
        f"The run took {total_s:.0f} s.",
    ]
    heading = SECTION if device == "cpu" else GPU_SECTION
    raw = {"results": [asdict(r) for r in results]}
    return Report(heading, command, info, facts, (), [table(results)], raw)


if __name__ == "__main__":
    sys.exit(main())
