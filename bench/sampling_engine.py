"""The sampling engine through the service: continuous batching, shared prompts and fair turns,
each against a baseline measured in the same run.

One real LoRA worker process (production defaults), the local Redis and a scratch Postgres;
every request has a seed, temperature 1 and `stop=[]`, so it generates exactly `max_tokens`.

- staggered: 48 requests (prompts of 8-48 random byte tokens) arriving as a Poisson stream over
  1.5 s: their median latency (submit to result) against one such request alone (median of a
  few), and the stream's tokens/s against transformers' `generate()` on the same 48 at once;
- simultaneous: 32 requests sent at once against `generate()` on the same 32 (tokens/s);
- long samples: the first `long_rows` of them with `long_tokens` new tokens each, against
  `generate()` on the same (tokens/s): what a cache written in place saves as samples grow
  (at most the context left after the 48-token prompts: 192 on the tiny model's 256);
- shared prompt: one request with `num_samples=16` against 16 requests of that prompt sent at
  once (tokens/s);
- fair turns: one tenant's training step (forward_backward + optim_step, one datum) latency,
  p50 / p90, while another tenant's request samples `fair_rows` x `fair_tokens` on the same
  worker, against the step alone; and that sample's time against the sample alone.

Writes the `## Sampling engine` section of docs/benchmarks.md (`--no-docs` leaves it alone).

    .venv/bin/python -m bench.sampling_engine                 # tiny model, a few minutes
    .venv/bin/python -m bench.sampling_engine --models queue-tinker/tiny-llama \\
        queue-tinker/llama-100m
    .venv/bin/python -m bench.sampling_engine --quick         # smoke run, docs left alone
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.harness import cli
from bench.harness.baselines import generate, left_padded
from bench.harness.data import datums, random_prompts, sampling_params
from bench.harness.meters import synchronize
from bench.harness.models import ensure_model, frozen_base
from bench.harness.report import publish
from bench.harness.run import TORCH, service_run
from bench.harness.services import deployment, service_client
from bench.harness.workers import lora_worker, use_torch_threads
from bench.sampling_engine_report import Result, Size, median, render, table
from queue_tinker.client import SamplingClient, ServiceClient, TrainingClient
from queue_tinker.types import AdamParams, Datum, ModelInput, SamplingParams

TIMEOUT_S = 900.0
SIZES = {
    "queue-tinker/tiny-llama": Size(
        "queue-tinker/tiny-llama", 64, 512, 128, 3, long_prompt=160, long_tokens=192
    ),
    "queue-tinker/llama-100m": Size(
        "queue-tinker/llama-100m", 32, 64, 32, 2, long_prompt=960, long_rows=16, long_tokens=384
    ),
}


# --- generate() in this process -----------------------------------------------------------------
def generate_tok_s(model: Any, batch: list[list[int]], tokens: int) -> float:
    """transformers' generate() on the prompts at once, left-padded: generated tokens/s."""
    device = next(model.parameters()).device
    ids, mask = left_padded(batch, device)
    synchronize(device)
    began = time.perf_counter()
    generate(model, ids, mask, tokens)
    synchronize(device)
    return len(batch) * tokens / (time.perf_counter() - began)


# --- the service -------------------------------------------------------------------------------
async def timed_sample(
    sampler: SamplingClient,
    prompt: list[int],
    n: int,
    sampling: SamplingParams,
    delay_s: float = 0.0,
) -> float:
    """Wait `delay_s`, then one request; seconds from submit to result (checked)."""
    await asyncio.sleep(delay_s)
    began = time.perf_counter()
    future = await sampler.sample_async(ModelInput.from_ints(prompt), n, sampling)
    response = await future
    assert all(len(s.tokens) == sampling.max_tokens for s in response.sequences)
    return time.perf_counter() - began


def staggered(
    sampler: SamplingClient, batch: list[list[int]], tokens: int, seed: int
) -> tuple[list[float], float]:
    """The requests as a Poisson stream over 1.5 s: each one's latency, and the stream's
    generated tokens/s (first submit to last result)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.5 / len(batch), len(batch)))

    async def go() -> tuple[list[float], float]:
        began = time.perf_counter()
        latencies = await asyncio.wait_for(
            asyncio.gather(
                *(
                    timed_sample(
                        sampler, p, 1, sampling_params(seed + i, tokens), float(arrivals[i])
                    )
                    for i, p in enumerate(batch)
                )
            ),
            TIMEOUT_S,
        )
        return list(latencies), len(batch) * tokens / (time.perf_counter() - began)

    return asyncio.run(go())


def at_once(
    sampler: SamplingClient, batch: list[list[int]], n: int, tokens: int, seed: int
) -> float:
    """The requests sent together: generated tokens/s, first submit to last result."""

    async def go() -> float:
        began = time.perf_counter()
        await asyncio.wait_for(
            asyncio.gather(
                *(
                    timed_sample(sampler, p, n, sampling_params(seed + i, tokens))
                    for i, p in enumerate(batch)
                )
            ),
            TIMEOUT_S,
        )
        return len(batch) * n * tokens / (time.perf_counter() - began)

    return asyncio.run(go())


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
    stream, together = random_prompts(size.staggered, 1), random_prompts(size.simultaneous, 2)
    shared_prompt = random_prompts(1, 3)[0]
    with deployment(args.redis_url, database_url, "sampling-engine", data_dir) as settings:
        log = data_dir / f"worker-{settings.key_prefix}.log"
        with (
            lora_worker(settings, size.model, log, env=decode_env(args), device=args.device),
            service_client(settings.model_copy(update={"tenant": "trainer"})) as trainer,
            service_client(settings.model_copy(update={"tenant": "sampler"})) as service,
        ):
            sampler = service.create_sampling_client(base_model=size.model)
            at_once(sampler, together[:4], 1, 4, 0)  # warm-up: the worker's loop is made
            generate_tok_s(local, together[:4], 4)
            if args.device != "cpu":  # a GPU warms up per shape (kernels, allocator)
                warm = Result(size)
                run_round(sampler, local, size, warm, stream, together, shared_prompt, 0)
            for r in range(size.rounds):
                run_round(sampler, local, size, result, stream, together, shared_prompt, r)
            fair_turns(service, trainer, size, result)
    return result


def run_round(
    sampler: SamplingClient,
    local: torch.nn.Module,
    size: Size,
    result: Result,
    stream: list[list[int]],
    together: list[list[int]],
    shared_prompt: list[int],
    r: int,
) -> None:
    median_prompt = sorted(stream, key=len)[len(stream) // 2]
    result.alone_s.append(
        asyncio.run(timed_sample(sampler, median_prompt, 1, sampling_params(100 + r, size.tokens)))
    )
    latencies, tok_s = staggered(sampler, stream, size.tokens, 1000 * (r + 1))
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
    result.separate_tok_s.append(
        at_once(sampler, [shared_prompt] * size.shared, 1, size.tokens, 3000)
    )
    # What sharing the prefill saves: one long prompt's samples vs as many long prompts.
    long = np.random.default_rng(4 + r).integers(0, 256, (size.shared, size.long_prompt)).tolist()
    result.long_shared_tok_s.append(at_once(sampler, long[:1], size.shared, size.tokens, 4000))
    result.long_distinct_tok_s.append(at_once(sampler, long, 1, size.tokens, 4000))
    print(
        f"  round {r + 1}: alone {result.alone_s[-1] * 1000:,.0f} ms, staggered median "
        f"{result.staggered_median_s[-1] * 1000:,.0f} ms ({tok_s:,.0f} tok/s vs generate "
        f"{result.generate_staggered_tok_s[-1]:,.0f}); 32 at once "
        f"{result.simultaneous_tok_s[-1]:,.0f} vs generate "
        f"{result.generate_simultaneous_tok_s[-1]:,.0f} tok/s; long samples "
        f"{result.long_samples_tok_s[-1]:,.0f} vs generate "
        f"{result.generate_long_samples_tok_s[-1]:,.0f} tok/s; num_samples=16 "
        f"{result.shared_tok_s[-1]:,.0f} vs 16 requests {result.separate_tok_s[-1]:,.0f}",
        flush=True,
    )


def decode_env(args: argparse.Namespace) -> dict[str, str]:
    """The worker's QT_DECODE_STEP when --decode-step names one (else its default)."""
    return {"QT_DECODE_STEP": args.decode_step} if args.decode_step else {}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.parser("bench.sampling_engine", __doc__)
    parser.add_argument(
        "--decode-step",
        choices=["auto", "padded", "slots", "graphs"],
        default=None,
        help="the worker's QT_DECODE_STEP (default: its own default)",
    )
    cli.add_services(parser)
    cli.add_models(parser, SIZES, default=["queue-tinker/tiny-llama"])
    cli.add_torch(parser)
    cli.add_report(parser, json=False)
    cli.add_quick(parser)
    return cli.parse(parser, argv)


def sizes(args: argparse.Namespace) -> list[Size]:
    chosen = [SIZES[m] for m in args.models]
    if args.quick:
        chosen = [
            Size(s.model, 8, 32, 16, 1, 32, 4, 32, staggered=8, simultaneous=8, shared=4)
            for s in chosen
        ]
    return chosen


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_torch_threads(args.threads)
    results = []
    with service_run(args, TORCH, "qt-bench-sampling-engine-") as run:
        for size in sizes(args):
            print(f"{size.model}:", flush=True)
            results.append(measure(args, size, run.database_url, run.data_dir))
    print("\n" + "\n".join(table(results)))
    info = {**run.info, "worker QT_DECODE_STEP": args.decode_step or "default"}
    section = render(info, results, run.total_s, args.threads, args.device, args.decode_step)
    publish(args.docs, args.no_docs, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
