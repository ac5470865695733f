"""The sampler's prefix cache and chunked prefill through the decode loop, each against the same
loop without them: `## Sampling: prefix cache and chunked prefill` of docs/benchmarks.md."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass

import torch

from bench.harness import cli
from bench.harness.report import Report, Table, docs_of, emit
from bench.sample_cache import SHAPE, cpu_loop, cpu_machine, decoder, greedy
from queue_tinker.types.requests.sampling import SampleResponse

SECTION = "## Sampling: prefix cache and chunked prefill"
COMMAND = ".venv/bin/python -m bench.prefix_cache"
ROUNDS = 3
CHUNK_BUDGET = 256


@dataclass(frozen=True)
class Sizes:
    context: int  # tokens every prompt shares
    question: int  # tokens of each prompt's own
    requests: int
    new_tokens: int
    long_prompt: int  # the prompt arriving while a row decodes


FULL = Sizes(context=1024, question=16, requests=8, new_tokens=8, long_prompt=2048)
QUICK = Sizes(context=128, question=8, requests=3, new_tokens=4, long_prompt=512)


@dataclass
class Run:
    seconds: float
    prefilled: int
    longest_gap_ms: float
    tokens: list[list[int]]


def shared_prefixes(model: torch.nn.Module, sizes: Sizes, cache: bool) -> Run:
    """Each request after the one before: a shared context, then its own question; without the
    cache it holds nothing (max_bytes 0, so every prompt is prefilled whole)."""
    decode = cpu_loop(prefill_tokens=None)
    if not cache:
        decode.prompts.max_bytes = 0
    context = [(11 * j) % SHAPE.vocab for j in range(sizes.context)]
    tokens: list[list[int]] = []
    began = time.perf_counter()
    for i in range(sizes.requests):
        question = [(7 * i + j + 1) % SHAPE.vocab for j in range(sizes.question)]
        decode.add(i, greedy(context + question, sizes.new_tokens))
        done: dict[Hashable, SampleResponse] = {}
        while decode.busy:
            done.update(decode.step(model))
        tokens.append(done[i].sequences[0].tokens)
    return Run(time.perf_counter() - began, decode.prefilled_tokens, 0.0, tokens)


def long_prompt_arrives(model: torch.nn.Module, sizes: Sizes, chunked: bool) -> Run:
    """A row decoding 64 tokens; after its 8th, a long prompt arrives."""
    decode = cpu_loop(prefill_tokens=CHUNK_BUDGET if chunked else None)
    decode.add("running", greedy([3, 1, 4, 1, 5, 9, 2, 6], 64))
    long = [(13 * j + 5) % SHAPE.vocab for j in range(sizes.long_prompt)]
    done: dict[Hashable, SampleResponse] = {}
    gaps: list[float] = []
    began = time.perf_counter()
    step = 0
    while decode.busy:
        if step == 8:
            decode.add("long", greedy(long, sizes.new_tokens))
        start = time.perf_counter()
        done.update(decode.step(model))
        if step > 0 and "running" not in done:
            gaps.append(time.perf_counter() - start)
        step += 1
    tokens = [done["running"].sequences[0].tokens, done["long"].sequences[0].tokens]
    seconds = time.perf_counter() - began
    return Run(seconds, decode.prefilled_tokens, max(gaps) * 1000, tokens)


def measure(sizes: Sizes) -> dict[str, Run]:
    """Every case `ROUNDS` times, the order alternating; each case's medians."""
    model = decoder()
    runs: dict[str, list[Run]] = {k: [] for k in ("cache", "no cache", "chunked", "whole")}
    for round_ in range(ROUNDS):
        for flag in (True, False) if round_ % 2 == 0 else (False, True):
            runs["cache" if flag else "no cache"].append(shared_prefixes(model, sizes, flag))
            runs["chunked" if flag else "whole"].append(long_prompt_arrives(model, sizes, flag))
    return {
        name: Run(
            statistics.median(r.seconds for r in found),
            found[0].prefilled,
            statistics.median(r.longest_gap_ms for r in found),
            found[0].tokens,
        )
        for name, found in runs.items()
    }


def report(results: dict[str, Run], sizes: Sizes, info: dict[str, str]) -> Report:
    """Each case against the same loop without the cache / the chunks."""
    cache, none = results["cache"], results["no cache"]
    chunked, whole = results["chunked"], results["whole"]
    prefix = Table(
        ("prefix cache", "prompt tokens prefilled", "time", "time ÷ without", "samples as without"),
        [("on", f"{cache.prefilled:,}", f"{cache.seconds:.2f} s",
          f"**{cache.seconds / none.seconds:.2f}×**", f"{same(cache, none)} of {sizes.requests}"),
         ("holding nothing", f"{none.prefilled:,}", f"{none.seconds:.2f} s", "1.00×", "–")],
        caption=f"Shared prefixes: {sizes.requests} requests of a {sizes.context:,}-token shared "
        f"context and a {sizes.question}-token question each, {sizes.new_tokens} greedy new "
        "tokens, each sent once the one before finished.",
    )  # fmt: skip
    chunks = Table(
        ("prefill", "longest gap", "gap ÷ whole", "total time", "samples as whole"),
        [(f"chunked ({CHUNK_BUDGET} tokens a step)", f"{chunked.longest_gap_ms:.0f} ms",
          f"**{chunked.longest_gap_ms / whole.longest_gap_ms:.2f}×**", f"{chunked.seconds:.2f} s",
          f"{same(chunked, whole)} of 2"),
         ("whole prompt in one step", f"{whole.longest_gap_ms:.0f} ms", "1.00×",
          f"{whole.seconds:.2f} s", "–")],
        caption=f"A {sizes.long_prompt:,}-token prompt arriving while a row decodes 64 tokens "
        "(after its 8th): the longest gap between the running row's tokens.",
    )  # fmt: skip
    facts = [
        f"fp32; a Llama decoder of random weights ({SHAPE.layers} layers, hidden "
        f"{SHAPE.hidden}, vocabulary {SHAPE.vocab:,}); medians of {ROUNDS} rounds, the cases "
        "alternating."
    ]
    raw = {"sizes": asdict(sizes), "runs": {name: asdict(run) for name, run in results.items()}}
    return Report(SECTION, COMMAND, info, facts, (), [prefix, chunks], raw)


def same(run: Run, reference: Run) -> int:
    """How many of the run's samples have the reference's tokens."""
    return sum(a == b for a, b in zip(run.tokens, reference.tokens, strict=True))


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.parser("bench.prefix_cache", __doc__, quick="a small case")
    args = cli.parse(parser, argv)
    sizes = QUICK if args.quick else FULL
    emit(report(measure(sizes), sizes, cpu_machine()), docs_of(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
