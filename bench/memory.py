"""Memory at long context: peak worker RSS and step time of one LoRA forward_backward, on a
model with Llama-3.1's vocabulary (128,256) and 128k positions, random weights (no download),
each case in a fresh process (peak RSS is the process's ru_maxrss): the engine's former path
(`whole`: the whole logits) against its own (`chunked`: logprobs a chunk of positions at a
time, decoder layers checkpointed; `--checkpointing off` without). The paths in full: the
`## Memory at long context` section of docs/benchmarks.md.

Peak RSS does not depend on what else the machine runs; step time does, so checkpointing's
price is its own run (`--price`): on and off alternately, each three times, medians.

    .venv/bin/python -m bench.memory                 # every case; writes its docs section
    .venv/bin/python -m bench.memory --price         # checkpointing's step-time price only
    .venv/bin/python -m bench.memory --quick         # 1 x 512 and 1 x 2k only, docs left alone
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from bench.harness import cli, engine
from bench.harness.data import datums, token_rows
from bench.harness.isolated import print_result, run_isolated
from bench.harness.machine import commit, cpu_model, engine_machine
from bench.harness.meters import peak_rss_bytes
from bench.harness.models import BASE_NAME, Shape, add_adapters, build_model, lora_pool
from bench.harness.report import Report, Table, Target, docs_of, emit
from queue_tinker.types.requests.training import LoraConfig

SECTION = "## Memory at long context: one forward_backward, whole logits vs chunked"
PRICE_SECTION = "## Activation checkpointing: its price in step time"
PRICE_CASES = ((1, 2048), (1, 4096))
PRICE_ROUNDS = 3
PRICE_TARGET = 1.4  # checkpointing may make a step at most this much slower
COMMAND = ".venv/bin/python -m bench.memory"
PRICE_COMMAND = COMMAND + " --price"
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
Times = dict[tuple[int, int], dict[bool, list[float]]]  # per case, checkpointing on/off: step s


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
    args = ["--case", f"{rows}x{seq}", "--path", path, "--checkpointing"]
    found = run_isolated("bench.memory", [*args, "on" if checkpointing else "off"])
    if found is None:
        return None
    m = Measurement(**found)
    case = f"{rows} x {seq:>5} {path:>7} checkpointing={checkpointing!s:5}"
    print(f"{case} {m.step_s:7.1f} s  peak RSS {m.peak_rss_gib:5.2f} GiB", flush=True)
    return m


def run_all(cases: Sequence[tuple[int, int]]) -> list[Measurement]:
    results = []
    for rows, seq in cases:
        variants = [("chunked", True)]
        if rows * seq <= NO_CHECKPOINT_MAX_TOKENS:
            variants.append(("chunked", False))
        if rows * seq <= WHOLE_MAX_TOKENS:
            variants.insert(0, ("whole", False))
        for path, checkpointing in variants:
            if (m := run_case(rows, seq, path, checkpointing)) is not None:
                results.append(m)
    return results


def model_facts() -> str:
    return (
        f"fp32. Llama-3.1's vocabulary ({SHAPE.vocab:,}), hidden {SHAPE.hidden}, "
        f"{SHAPE.layers} layers, MLP {SHAPE.intermediate}, random weights; a rank-{RANK} LoRA on "
        "every linear layer including the unembedding."
    )


def report(results: Sequence[Measurement], info: dict[str, str]) -> Report:
    """A row a case: each path's peak RSS and step time, or "not run"."""
    by_case: dict[tuple[int, int], dict[tuple[str, bool], Measurement]] = {}
    for m in results:
        by_case.setdefault((m.rows, m.seq), {})[(m.path, m.checkpointing)] = m
    paths = (("whole", False), ("chunked", True), ("chunked", False))
    rows = [
        (f"{rows} x {seq:,}", *(cell(found.get(path)) for path in paths))
        for (rows, seq), found in by_case.items()
    ]
    columns = ("rows x tokens", "whole logits: peak RSS, step",
               "chunked + checkpointing: peak RSS, step",
               "chunked, no checkpointing: peak RSS, step")  # fmt: skip
    facts = [
        model_facts(),
        f"Not run: the whole-logits path past {WHOLE_MAX_TOKENS:,} tokens, the path without "
        f"checkpointing past {NO_CHECKPOINT_MAX_TOKENS:,}.",
    ]
    raw = {"cases": [asdict(m) for m in results]}
    return Report(SECTION, COMMAND, info, facts, (), [Table(columns, rows)], raw)


def cell(m: Measurement | None) -> str:
    return "not run" if m is None else f"{m.peak_rss_gib:.2f} GiB, {m.step_s:.1f} s"


def run_price(cases: Sequence[tuple[int, int]], rounds: int) -> Times:
    """Step times with checkpointing on and off, alternating, `rounds` of each per case."""
    times: Times = {}
    for rows, seq in cases:
        for _ in range(rounds):
            for checkpointing in (True, False):
                if (m := run_case(rows, seq, "chunked", checkpointing)) is not None:
                    times.setdefault((rows, seq), {}).setdefault(checkpointing, []).append(m.step_s)
    return times


def report_price(times: Times, info: dict[str, str]) -> Report:
    """Step times off and on, and their ratio, a row a case; the worst ratio is the target's."""
    medians = {
        case: (statistics.median(by[False]), statistics.median(by[True]))
        for case, by in times.items()
        if True in by and False in by
    }
    rows = [
        (f"{rows} x {seq:,}", f"{off:.1f} s", f"{on:.1f} s", f"**{on / off:.2f}x**")
        for (rows, seq), (off, on) in medians.items()
    ]
    worst = max((on / off for off, on in medians.values()), default=None)
    target = Target(
        f"checkpointing's price ≤ {PRICE_TARGET:g}x at every size",
        "–" if worst is None else f"at most {worst:.2f}x",
        None if worst is None else worst <= PRICE_TARGET,
    )
    columns = ("rows x tokens", "step, checkpointing off", "step, checkpointing on", "price")
    facts = [model_facts(), f"On and off alternately, {PRICE_ROUNDS} runs of each, medians."]
    raw = {
        "times_s": {f"{r}x{s}": {str(k): v for k, v in by.items()} for (r, s), by in times.items()}
    }
    return Report(PRICE_SECTION, PRICE_COMMAND, info, facts, [target], [Table(columns, rows)], raw)


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.parser("bench.memory", __doc__, quick="two small cases")
    parser.add_argument("--case", help="ROWSxTOKENS: measure one case in this process")
    parser.add_argument("--path", choices=("whole", "chunked"), default="chunked")
    parser.add_argument("--checkpointing", choices=("on", "off"), default="on")
    parser.add_argument(
        "--price",
        action="store_true",
        help="checkpointing's step-time price only (its own docs section)",
    )
    args = cli.parse(parser, argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.case:
        rows, seq = (int(x) for x in args.case.split("x"))
        print_result(measure(rows, seq, args.path, args.checkpointing == "on"))
        return 0
    info = {"CPU": cpu_model(), "cores": str(os.cpu_count()), **engine_machine("cpu")}
    info["commit"] = commit()
    if args.price:
        times = run_price(PRICE_CASES, PRICE_ROUNDS)
        emit(report_price(times, info), docs_of(args), args.json)
        return 0 if times else 1
    results = run_all(QUICK_CASES if args.quick else CASES)
    emit(report(results, info), docs_of(args), args.json)
    return 0 if results else 1


if __name__ == "__main__":
    raise SystemExit(main())
