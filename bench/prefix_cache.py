"""The sampler's prefix cache and chunked prefill, through the worker's decode loop, each against
the same loop without them, in the same run.

- **Shared prefixes**: requests that share a long context and differ in a short question (an
  RL group's prompt with per-member instructions, a conversation's turns), each sent after the
  one before finished: total time and prompt tokens prefilled with the prefix cache, and with
  it holding nothing (max_bytes 0, so every prompt is prefilled whole).
- **A long prompt arriving while a row decodes**: the longest gap between the running row's
  tokens (a decode step plus whatever the step prefilled) with chunked prefill (a step's
  prefill budget of `CHUNK_BUDGET` tokens) and without (the whole prompt in one step).

Greedy samples, compared with the case without the cache / chunks. Each case runs `ROUNDS`
times, alternating; medians reported.

    .venv/bin/python -m bench.prefix_cache            # writes its docs section
    .venv/bin/python -m bench.prefix_cache --quick    # a small case, docs left alone
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from bench.harness import cli
from bench.harness.machine import commit, engine_machine
from bench.harness.models import Shape, build_model
from bench.harness.report import measured_on, publish
from queue_tinker.types.requests.sampling import SampleResponse, SamplingParams
from queue_tinker.workers.sampling.decode_loop import DecodeLoop, GenerationRequest

SECTION = "## Sampling: prefix cache and chunked prefill"
COMMAND = ".venv/bin/python -m bench.prefix_cache"
SHAPE = Shape(layers=8, hidden=512, heads=8, kv_heads=8, intermediate=1024, vocab=32000)
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


def greedy(prompt: list[int], new_tokens: int) -> GenerationRequest:
    return GenerationRequest(
        prompt=prompt,
        num_samples=1,
        params=SamplingParams(max_tokens=new_tokens, stop=[], temperature=0.0),
        max_tokens=new_tokens,
        prompt_logprobs=False,
        adapter=None,
    )


def loop(prefill_tokens: int | None = CHUNK_BUDGET) -> DecodeLoop:
    return DecodeLoop(
        torch.device("cpu"), [], lambda _: "", max_rows=None, prefill_tokens=prefill_tokens
    )


def shared_prefixes(model: torch.nn.Module, sizes: Sizes, cache: bool) -> Run:
    """Each request after the one before: a shared context, then its own question."""
    decode = loop(prefill_tokens=None)
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
    decode = loop(CHUNK_BUDGET if chunked else None)
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


def median_run(runs: Sequence[Run]) -> Run:
    return Run(
        statistics.median(r.seconds for r in runs),
        runs[0].prefilled,
        statistics.median(r.longest_gap_ms for r in runs),
        runs[0].tokens,
    )


def measure(sizes: Sizes) -> dict[str, Run]:
    torch.manual_seed(0)
    model = build_model(SHAPE, "cpu", torch.float32)
    runs: dict[str, list[Run]] = {k: [] for k in ("cache", "no cache", "chunked", "whole")}
    for round_ in range(ROUNDS):
        for flag in (True, False) if round_ % 2 == 0 else (False, True):
            runs["cache" if flag else "no cache"].append(shared_prefixes(model, sizes, flag))
            runs["chunked" if flag else "whole"].append(long_prompt_arrives(model, sizes, flag))
    return {name: median_run(found) for name, found in runs.items()}


def render(results: dict[str, Run], sizes: Sizes, info: dict[str, str]) -> str:
    cache, none = results["cache"], results["no cache"]
    chunked, whole = results["chunked"], results["whole"]
    same_prefix = sum(a == b for a, b in zip(cache.tokens, none.tokens, strict=True))
    same_chunk = sum(a == b for a, b in zip(chunked.tokens, whole.tokens, strict=True))
    lines = [
        SECTION,
        "",
        measured_on(info) + f"transformers {info['transformers']}, {info['date']}, commit "
        f"{commit()}, fp32; "
        f"`{COMMAND}`. A Llama decoder of random weights ({SHAPE.layers} layers, hidden "
        f"{SHAPE.hidden}, vocabulary {SHAPE.vocab:,}) through the worker's decode loop; "
        f"medians of {ROUNDS} rounds, the cases alternating; compare figures from the same "
        "run only.",
        "",
        f"Shared prefixes: {sizes.requests} requests of a {sizes.context:,}-token shared "
        f"context and a {sizes.question}-token question each, {sizes.new_tokens} greedy new "
        "tokens, each sent once the one before finished.",
        "",
        "| prefix cache | prompt tokens prefilled | time | time ÷ without | samples as without |",
        "| --- | --- | --- | --- | --- |",
        f"| on | {cache.prefilled:,} | {cache.seconds:.2f} s | "
        f"**{cache.seconds / none.seconds:.2f}×** | {same_prefix} of {sizes.requests} |",
        f"| holding nothing | {none.prefilled:,} | {none.seconds:.2f} s | 1.00× | – |",
        "",
        f"A {sizes.long_prompt:,}-token prompt arriving while a row decodes 64 tokens (after its "
        f"8th): the longest gap between the running row's tokens.",
        "",
        "| prefill | longest gap | gap ÷ whole | total time | samples as whole |",
        "| --- | --- | --- | --- | --- |",
        f"| chunked ({CHUNK_BUDGET} tokens a step) | {chunked.longest_gap_ms:.0f} ms | "
        f"**{chunked.longest_gap_ms / whole.longest_gap_ms:.2f}×** | {chunked.seconds:.2f} s | "
        f"{same_chunk} of 2 |",
        f"| whole prompt in one step | {whole.longest_gap_ms:.0f} ms | 1.00× | "
        f"{whole.seconds:.2f} s | – |",
        "",
        "With the cache each request after the first prefills only its question (whole blocks "
        "of 16 tokens of the shared context come from the cache). Chunks bound how long the "
        "running rows wait for a newcomer's prefill, at the cost of a few more model calls.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_quick(parser, "a small case")
    cli.add_report(parser, json=False)
    args = cli.parse(parser, argv)
    sizes = QUICK if args.quick else FULL
    results = measure(sizes)
    text = render(results, sizes, engine_machine("cpu"))
    print(text)
    publish(args.docs, args.no_docs, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
