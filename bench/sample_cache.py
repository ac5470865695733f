"""Long samples under a KV-cache budget: peak RSS, time and the cache the decode loop held, with
no budget and with budgets of a half and a quarter of what the samples need at once.

Sixteen samples of 1,024 new tokens each (RL rollouts, scaled to this CPU) on a Llama decoder
of random weights whose KV cache is the large part of what sampling holds (8 layers, 8 KV heads
of 64: 32 KiB a token in fp32). Each case runs in a fresh process (peak RSS is the process's
ru_maxrss) through the worker's decode loop (`workers/sampling/decode_loop.py` DecodeLoop, its
`max_cache_tokens` as QT_SAMPLE_CACHE_TOKENS sets it); the cache is measured after every step.
Samples are greedy, so each case's tokens can be compared with the case without a budget
(batched in other groups, a row's float rounding differs; a near-tie may then flip a token).

    .venv/bin/python -m bench.sample_cache            # writes its docs section
    .venv/bin/python -m bench.sample_cache --quick    # 4 samples x 128 tokens, docs left alone
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from bench.harness import cli
from bench.harness.isolated import print_result, run_isolated
from bench.harness.machine import engine_machine
from bench.harness.meters import peak_rss_bytes
from bench.harness.models import Shape, build_model
from bench.harness.report import measured_on, publish
from queue_tinker.types.requests.sampling import SampleResponse, SamplingParams
from queue_tinker.workers.model.memory import kv_bytes_per_token
from queue_tinker.workers.sampling.cache_budget import peak_cache_tokens
from queue_tinker.workers.sampling.decode_loop import DecodeLoop, GenerationRequest
from queue_tinker.workers.sampling.kv_cache import GrowingLayer

SECTION = "## Sampling under a KV-cache budget: long samples"
COMMAND = ".venv/bin/python -m bench.sample_cache"
SHAPE = Shape(layers=8, hidden=512, heads=8, kv_heads=8, intermediate=1024, vocab=32000)
PROMPT_TOKENS = 32
FULL = (16, 1024)  # samples, new tokens each
QUICK = (4, 128)
SHARES = (None, 0.5, 0.25)  # no budget, then a share of what every sample at once needs
MIB = 1024**2


@dataclass
class Case:
    samples: int
    new_tokens: int
    budget: int | None  # max_cache_tokens
    seconds: float
    peak_rss_mib: float
    peak_cache_tokens: int  # rows x columns, measured after each step
    most_rows: int
    kv_bytes: int  # of one cache token
    digests: list[str]  # of each sample's tokens


def requests(samples: int, new_tokens: int) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            prompt=[(7 * i + j) % SHAPE.vocab for j in range(PROMPT_TOKENS)],
            num_samples=1,
            params=SamplingParams(max_tokens=new_tokens, stop=[], temperature=0.0),
            max_tokens=new_tokens,
            prompt_logprobs=False,
            adapter=None,
        )
        for i in range(samples)
    ]


def measure(samples: int, new_tokens: int, budget: int | None) -> Case:
    """One case in this process: the model, then every sample through one decode loop."""
    torch.manual_seed(0)
    model = build_model(SHAPE, "cpu", torch.float32)
    loop = DecodeLoop(torch.device("cpu"), [], lambda _: "", max_rows=None, max_cache_tokens=budget)
    for index, request in enumerate(requests(samples, new_tokens)):
        loop.add(index, request)
    done: dict[Hashable, SampleResponse] = {}
    most_cache = most_rows = 0
    began = time.perf_counter()
    while loop.busy:
        done.update(loop.step(model))
        if loop.running is not None:
            layer = loop.running.cache.layers[0]
            assert isinstance(layer, GrowingLayer) and layer.keys is not None
            most_cache = max(most_cache, int(layer.keys.shape[0] * layer.keys.shape[2]))
        most_rows = max(most_rows, loop.step_rows)
    seconds = time.perf_counter() - began
    config = model.config
    assert isinstance(config, PretrainedConfig)
    tokens = [done[i].sequences[0].tokens for i in range(samples)]
    return Case(
        samples=samples,
        new_tokens=new_tokens,
        budget=budget,
        seconds=seconds,
        peak_rss_mib=peak_rss_bytes() / MIB,
        peak_cache_tokens=most_cache,
        most_rows=most_rows,
        kv_bytes=kv_bytes_per_token(config, 4),
        digests=[hashlib.sha256(json.dumps(t).encode()).hexdigest()[:16] for t in tokens],
    )


def run_case(samples: int, new_tokens: int, budget: int | None) -> Case:
    """The case in a fresh process."""
    args = ["--case", f"{samples}x{new_tokens}"]
    found = run_isolated(
        "bench.sample_cache", args + ([] if budget is None else ["--budget", str(budget)])
    )
    if found is None:
        raise RuntimeError(f"the case {samples} x {new_tokens}, budget {budget}, failed")
    case = Case(**found)
    print(
        f"budget {budget or 'none':>6}: {case.seconds:6.1f} s, peak RSS {case.peak_rss_mib:6.0f}"
        f" MiB, cache {case.peak_cache_tokens:,} tokens, {case.most_rows} rows at most",
        flush=True,
    )
    return case


def run_all(samples: int, new_tokens: int) -> list[Case]:
    needed = peak_cache_tokens([(PROMPT_TOKENS, new_tokens)] * samples)
    cases = [
        run_case(samples, new_tokens, None if share is None else int(needed * share))
        for share in SHARES
    ]
    return cases


def same(case: Case, reference: Case) -> int:
    """How many of the case's samples have the reference's tokens."""
    return sum(a == b for a, b in zip(case.digests, reference.digests, strict=True))


def render(cases: Sequence[Case], info: dict[str, str]) -> str:
    first = cases[0]
    kv = first.kv_bytes
    lines = [
        SECTION,
        "",
        measured_on(info)
        + f"transformers {info['transformers']}, {info['date']}, fp32; `{COMMAND}`. "
        f"{first.samples} samples of {PROMPT_TOKENS} prompt + {first.new_tokens:,} new tokens "
        f"(no stop: each runs to its max_tokens) on a Llama decoder of random weights "
        f"({SHAPE.layers} layers, hidden {SHAPE.hidden}, {SHAPE.kv_heads} KV heads: "
        f"{kv // 1024} KiB of cache a token), all queued at once, through the worker's decode "
        "loop; one fresh process a case. The cache is the decode loop's, measured after every "
        "step (rows x positions); the budget is `QT_SAMPLE_CACHE_TOKENS`. Greedy samples, "
        "compared with those of the case without a budget.",
        "",
        "| budget (cache tokens) | peak cache | rows at once | peak RSS | time | samples as "
        "without a budget |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for case in cases:
        budget = "none" if case.budget is None else f"{case.budget:,}"
        lines.append(
            f"| {budget} | {case.peak_cache_tokens:,} tokens "
            f"({case.peak_cache_tokens * kv / MIB:.0f} MiB) | {case.most_rows} | "
            f"{case.peak_rss_mib:,.0f} MiB | {case.seconds:.1f} s | "
            f"{same(case, first)} of {case.samples} |"
        )
    lines += [
        "",
        "A budget trades time for memory: fewer samples decode at once, so each step does less "
        "work for more steps. On a GPU the unset budget is 30% of the free memory after the "
        "base model is loaded, so it binds only where the samples would not have fit.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_quick(parser, "a small case")
    parser.add_argument("--case", help="SAMPLESxTOKENS: measure one case in this process")
    parser.add_argument("--budget", type=int, default=None)
    cli.add_report(parser, json=False)
    args = cli.parse(parser, argv)
    if args.case:
        samples, new_tokens = (int(part) for part in args.case.split("x"))
        print_result(measure(samples, new_tokens, args.budget))
        return 0
    cases = run_all(*(QUICK if args.quick else FULL))
    publish(args.docs, args.no_docs, render(cases, engine_machine("cpu")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
