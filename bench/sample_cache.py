"""Long samples under a KV-cache budget against none, a fresh process a case; the method is
`## Sampling under a KV-cache budget: long samples` of docs/benchmarks.md."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import PretrainedConfig

from bench.harness import cli
from bench.harness.isolated import print_result, run_isolated
from bench.harness.machine import commit, cpu_model, engine_machine
from bench.harness.meters import peak_rss_bytes
from bench.harness.models import Shape, build_model
from bench.harness.report import Report, Table, docs_of, emit
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


def greedy(prompt: list[int], new_tokens: int) -> GenerationRequest:
    """A request for exactly `new_tokens` greedy tokens (no stop), base model."""
    params = SamplingParams(max_tokens=new_tokens, stop=[], temperature=0.0)
    return GenerationRequest(prompt, 1, params, new_tokens, prompt_logprobs=False, adapter=None)


def decoder() -> torch.nn.Module:
    """The model of this benchmark and bench.prefix_cache, its random weights seeded."""
    return build_model(SHAPE, "cpu", torch.float32)


def cpu_loop(**options: Any) -> DecodeLoop:
    """The worker's decode loop on the CPU, no adapters, no detokenizer."""
    return DecodeLoop(torch.device("cpu"), [], lambda _: "", max_rows=None, **options)


def cpu_machine() -> dict[str, str]:
    """The machine of an in-process CPU run: the CPU, its cores, the engine's versions."""
    info = engine_machine("cpu")
    versions = {k: v for k, v in info.items() if k not in ("device", "date")}
    cpu = {"CPU": cpu_model(), "cores": str(os.cpu_count())}
    return {**cpu, **versions, "commit": commit(), "date": info["date"]}


def measure(samples: int, new_tokens: int, budget: int | None) -> Case:
    """One case in this process: the model, then every sample through one decode loop."""
    model, loop = decoder(), cpu_loop(max_cache_tokens=budget)
    for i in range(samples):
        loop.add(i, greedy([(7 * i + j) % SHAPE.vocab for j in range(PROMPT_TOKENS)], new_tokens))
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
    digests = [hashlib.sha256(json.dumps(t).encode()).hexdigest()[:16] for t in tokens]
    rss, kv = peak_rss_bytes() / MIB, kv_bytes_per_token(config, 4)
    return Case(samples, new_tokens, budget, seconds, rss, most_cache, most_rows, kv, digests)


def run_all(samples: int, new_tokens: int) -> list[Case]:
    """Each share's case in a fresh process."""
    needed = peak_cache_tokens([(PROMPT_TOKENS, new_tokens)] * samples)
    cases = []
    for budget in (None if share is None else int(needed * share) for share in SHARES):
        budgeted = [] if budget is None else ["--budget", str(budget)]
        found = run_isolated("bench.sample_cache", ["--case", f"{samples}x{new_tokens}", *budgeted])
        if found is None:
            raise RuntimeError(f"the case {samples} x {new_tokens}, budget {budget}, failed")
        cases.append(case := Case(**found))
        print(f"budget {budget}: {case.seconds:.1f} s, {case.peak_rss_mib:.0f} MiB", flush=True)
    return cases


def report(cases: Sequence[Case], info: dict[str, str]) -> Report:
    """Each budget's measured cache, RSS and time, and its samples against the unbudgeted."""
    first, kv = cases[0], cases[0].kv_bytes
    facts = [
        f"fp32; {first.samples} samples of {PROMPT_TOKENS} prompt + {first.new_tokens:,} new "
        f"tokens on a Llama decoder of random weights ({SHAPE.layers} layers, hidden "
        f"{SHAPE.hidden}, {SHAPE.kv_heads} KV heads: {kv // 1024} KiB of cache a token)."
    ]
    columns = ("budget (cache tokens)", "peak cache", "rows at once", "peak RSS", "time")
    rows = [
        ("none" if case.budget is None else f"{case.budget:,}",
         f"{case.peak_cache_tokens:,} tokens ({case.peak_cache_tokens * kv / MIB:.0f} MiB)",
         case.most_rows, f"{case.peak_rss_mib:,.0f} MiB", f"{case.seconds:.1f} s",
         f"{sum(a == b for a, b in zip(case.digests, first.digests, strict=True))} of "
         f"{case.samples}")
        for case in cases
    ]  # fmt: skip
    body = [Table((*columns, "samples as without a budget"), rows)]
    return Report(SECTION, COMMAND, info, facts, (), body, {"cases": [asdict(c) for c in cases]})


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.parser("bench.sample_cache", __doc__, quick="a small case")
    parser.add_argument("--case", help="SAMPLESxTOKENS: measure one case in this process")
    parser.add_argument("--budget", type=int, default=None)
    args = cli.parse(parser, argv)
    if args.case:
        samples, new_tokens = (int(part) for part in args.case.split("x"))
        print_result(measure(samples, new_tokens, args.budget))
        return 0
    cases = run_all(*(QUICK if args.quick else FULL))
    emit(report(cases, cpu_machine()), docs_of(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
