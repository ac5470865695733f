"""Memory at long context: peak worker RSS and step time of one LoRA forward_backward, on a
model with Llama-3.1's vocabulary (128,256) and 128k positions, random weights (no download).

Two paths over the same data, each case in a fresh process (peak RSS is the process's
ru_maxrss, so the model and torch's own pages count as they do in a worker):

- `whole`: the engine's former path: the model's whole logits (rows, positions, vocab), the
  scored rows copied to fp32, cross-entropy, backward through all of it, every layer's
  activations kept.
- `chunked`: the engine's path (a forward_backward op's shared pass with a `PassPlan`, through
  bench/harness/engine.py): logprobs through the unembedding a chunk of positions at a time,
  recomputed in backward, and decoder layers checkpointed (`--checkpointing off` measures the
  chunked logprobs alone: the price of checkpointing is the step time between the two).

    .venv/bin/python -m bench.memory                 # every case; writes its docs section
    .venv/bin/python -m bench.memory --price         # checkpointing's step-time price only
    .venv/bin/python -m bench.memory --quick         # 1 x 512 and 1 x 2k only, docs left alone

Peak RSS does not depend on what else the machine runs; step time does, so checkpointing's
price is its own run (`--price`): on and off alternately, each three times, medians.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bench.harness import cli, engine
from bench.harness.data import datums, token_rows
from bench.harness.isolated import print_result, run_isolated
from bench.harness.machine import engine_machine
from bench.harness.meters import peak_rss_bytes
from bench.harness.models import BASE_NAME, Shape, add_adapters, build_model, lora_pool
from bench.harness.report import measured_on, publish
from queue_tinker.types.requests.training import LoraConfig

SECTION = "## Memory at long context: one forward_backward, whole logits vs chunked"
PRICE_SECTION = "## Activation checkpointing: its price in step time"
PRICE_CASES = ((1, 2048), (1, 4096))
PRICE_ROUNDS = 3
COMMAND = ".venv/bin/python -m bench.memory"
# The issue's shape: Llama-3.1's vocabulary, a small decoder (the vocabulary is what grows).
SHAPE = Shape(layers=4, hidden=512, heads=8, kv_heads=8, intermediate=1536, vocab=128256)
RANK = 32
CASES = ((1, 2048), (1, 4096), (1, 8192), (1, 32767), (8, 4096))
QUICK_CASES = ((1, 512), (1, 2048))
# The whole-logits path needs ~1.8 GiB per 1,000 tokens here: 15 GiB at 8k, beyond a 24 GiB
# machine at 16k. It runs up to this; past it the table says why not.
WHOLE_MAX_TOKENS = 4096
# The path without checkpointing runs up to this (past it, only the engine's path).
NO_CHECKPOINT_MAX_TOKENS = 8192
GIB = 1024**3


@dataclass
class Measurement:
    rows: int
    seq: int
    path: str
    checkpointing: bool
    step_s: float
    peak_rss_gib: float
    loss: float


def measure(rows: int, seq: int, path: str, checkpointing: bool) -> Measurement:
    """One case, in this process: model, a rank-32 adapter on every linear, one step."""
    model = build_model(SHAPE, "cpu", torch.float32)
    pool = lora_pool(model, BASE_NAME, adapters=1)
    [adapter] = add_adapters(pool, LoraConfig(rank=RANK, train_unembed=True), seeds=[0])
    data = datums(token_rows(rows, seq, vocab=SHAPE.vocab))
    plan = engine.PassPlan(activation_checkpointing="on" if checkpointing else "off")
    start = time.perf_counter()
    if path == "whole":
        loss = engine.whole_logits_forward_backward(pool, adapter, data)
    else:
        [out] = engine.forward_backward(pool, [(adapter, data)], engine.CPU, plan)
        loss = out.metrics["loss:sum"]
    step_s = time.perf_counter() - start
    peak = peak_rss_bytes() / GIB
    return Measurement(rows, seq, path, checkpointing, step_s, peak, loss)


def run_case(rows: int, seq: int, path: str, checkpointing: bool) -> Measurement | None:
    """The case in a fresh process; None if it failed (out of memory)."""
    args = ["--case", f"{rows}x{seq}", "--path", path]
    found = run_isolated(
        "bench.memory", [*args, "--checkpointing", "on" if checkpointing else "off"]
    )
    if found is None:
        return None
    result = Measurement(**found)
    print(
        f"{rows} x {seq:>5} {path:>7} checkpointing={checkpointing!s:5} "
        f"{result.step_s:7.1f} s  peak RSS {result.peak_rss_gib:5.2f} GiB",
        flush=True,
    )
    return result


def run_all(cases: Sequence[tuple[int, int]]) -> list[Measurement]:
    results = []
    for rows, seq in cases:
        variants = [("chunked", True)]
        if rows * seq <= NO_CHECKPOINT_MAX_TOKENS:
            variants.append(("chunked", False))
        if rows * seq <= WHOLE_MAX_TOKENS:
            variants.insert(0, ("whole", False))
        for path, checkpointing in variants:
            measured = run_case(rows, seq, path, checkpointing)
            if measured is not None:
                results.append(measured)
    return results


def render(results: Sequence[Measurement], info: dict[str, str]) -> str:
    by_case: dict[tuple[int, int], dict[tuple[str, bool], Measurement]] = {}
    for m in results:
        by_case.setdefault((m.rows, m.seq), {})[(m.path, m.checkpointing)] = m
    lines = [
        SECTION,
        "",
        measured_on(info)
        + f"transformers {info['transformers']}, {info['date']}, fp32; `{COMMAND}`. "
        "A Llama decoder with Llama-3.1's vocabulary "
        f"({SHAPE.vocab:,}; hidden {SHAPE.hidden}, {SHAPE.layers} layers, MLP "
        f"{SHAPE.intermediate}), random weights, a rank-{RANK} LoRA on every linear layer "
        "including the unembedding; one forward_backward (cross-entropy) per fresh process. "
        "Peak RSS is the whole worker-like process (model, adapter, torch). Not run: the whole-"
        f"logits path past {WHOLE_MAX_TOKENS:,} tokens (~1.8 GiB per 1,000 tokens: 15 GiB at "
        "8k, more than this machine at 16k), and the path without checkpointing past "
        f"{NO_CHECKPOINT_MAX_TOKENS:,} (its rows show what checkpointing saves).",
        "",
        "| rows x tokens | whole logits: peak RSS, step | chunked + checkpointing: peak RSS, "
        "step | chunked, no checkpointing: peak RSS, step |",
        "| --- | --- | --- | --- |",
    ]
    for (rows, seq), found in by_case.items():
        cells = []
        for key in (("whole", False), ("chunked", True), ("chunked", False)):
            measured = found.get(key)
            cells.append(
                f"{measured.peak_rss_gib:.2f} GiB, {measured.step_s:.1f} s"
                if measured
                else "not run"
            )
        lines.append(f"| {rows} x {seq:,} | {' | '.join(cells)} |")
    lines += [
        "",
        "Step times here are one step each, in whatever load the machine had: compare "
        f"them within a row at most. Checkpointing's price in step time is measured by "
        f"`{COMMAND} --price` (next section).",
    ]
    return "\n".join(lines) + "\n"


def run_price(
    cases: Sequence[tuple[int, int]], rounds: int
) -> dict[tuple[int, int], dict[bool, list[float]]]:
    """Step times with checkpointing on and off, alternating, `rounds` of each per case."""
    times: dict[tuple[int, int], dict[bool, list[float]]] = {}
    for rows, seq in cases:
        for _ in range(rounds):
            for checkpointing in (True, False):
                measured = run_case(rows, seq, "chunked", checkpointing)
                if measured is not None:
                    times.setdefault((rows, seq), {}).setdefault(checkpointing, []).append(
                        measured.step_s
                    )
    return times


def render_price(
    times: dict[tuple[int, int], dict[bool, list[float]]], info: dict[str, str]
) -> str:
    lines = [
        PRICE_SECTION,
        "",
        measured_on(info)
        + f"{info['date']}; `{COMMAND} --price`. The model and adapter of the section above; one "
        "forward_backward per fresh process, checkpointing on and off alternately, "
        f"{PRICE_ROUNDS} of each, medians. Target: at most 1.4x.",
        "",
        "| rows x tokens | step, checkpointing off | step, checkpointing on | price |",
        "| --- | --- | --- | --- |",
    ]
    for (rows, seq), by in times.items():
        if True in by and False in by:
            on, off = statistics.median(by[True]), statistics.median(by[False])
            lines.append(f"| {rows} x {seq:,} | {off:.1f} s | {on:.1f} s | **{on / off:.2f}x** |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_quick(parser, "two small cases")
    parser.add_argument("--case", help="ROWSxTOKENS: measure one case in this process")
    parser.add_argument("--path", choices=("whole", "chunked"), default="chunked")
    parser.add_argument("--checkpointing", choices=("on", "off"), default="on")
    parser.add_argument(
        "--price",
        action="store_true",
        help="checkpointing's step-time price only (its own docs section)",
    )
    cli.add_report(parser, json=False)
    args = cli.parse(parser, argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.case:
        rows, seq = (int(x) for x in args.case.split("x"))
        print_result(measure(rows, seq, args.path, args.checkpointing == "on"))
        return 0
    if args.price:
        times = run_price(PRICE_CASES, PRICE_ROUNDS)
        text = render_price(times, engine_machine("cpu"))
        print(text)
        publish(args.docs, args.no_docs, text)
        return 0 if times else 1
    results = run_all(QUICK_CASES if args.quick else CASES)
    publish(args.docs, args.no_docs, render(results, engine_machine("cpu")))
    return 0 if results else 1


if __name__ == "__main__":
    raise SystemExit(main())
