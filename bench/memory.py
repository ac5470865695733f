"""Memory at long context: peak RSS and step time of one LoRA forward_backward, whole logits
against the engine's chunked path, and (`--price`) checkpointing's step-time price: the
`## Memory at long context` and `## Activation checkpointing` sections of docs/benchmarks.md.

    .venv/bin/python -m bench.memory                 # every case; writes its docs section
    .venv/bin/python -m bench.memory --price         # checkpointing's step-time price only
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from bench.harness import cli, engine
from bench.harness.data import datums, token_rows
from bench.harness.isolated import print_result, run_isolated
from bench.harness.machine import cpu_machine
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
# The most tokens the whole-logits path (~1.8 GiB per 1,000) and the one without checkpointing run
WHOLE_MAX_TOKENS = 4096
NO_CHECKPOINT_MAX_TOKENS = 8192
# The table's columns, in the order a case runs them: its label, the most tokens it runs.
PATHS = {
    ("whole", False): ("whole logits", WHOLE_MAX_TOKENS),
    ("chunked", True): ("chunked + checkpointing", None),
    ("chunked", False): ("chunked, no checkpointing", NO_CHECKPOINT_MAX_TOKENS),
}
MODEL_FACTS = (
    f"fp32. Llama-3.1's vocabulary ({SHAPE.vocab:,}), hidden {SHAPE.hidden}, "
    f"{SHAPE.layers} layers, MLP {SHAPE.intermediate}, random weights; a rank-{RANK} LoRA on "
    "every linear layer including the unembedding."
)
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
    return Measurement(rows, seq, path, checkpointing, step_s, peak_rss_bytes() / GIB, loss)


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
    """Every path a case's size allows, in the table's order; those that did not fail."""
    found = [
        run_case(rows, seq, path, checkpointing)
        for rows, seq in cases
        for (path, checkpointing), (_, most) in PATHS.items()
        if most is None or rows * seq <= most
    ]
    return [m for m in found if m is not None]


def report(results: Sequence[Measurement], info: dict[str, str]) -> Report:
    """A row a case: each path's peak RSS and step time, or "not run"."""

    def cell(m: Measurement | None) -> str:
        return "not run" if m is None else f"{m.peak_rss_gib:.2f} GiB, {m.step_s:.1f} s"

    by_case: dict[tuple[int, int], dict[tuple[str, bool], Measurement]] = {}
    for m in results:
        by_case.setdefault((m.rows, m.seq), {})[(m.path, m.checkpointing)] = m
    rows = [
        (f"{rows} x {seq:,}", *(cell(found.get(path)) for path in PATHS))
        for (rows, seq), found in by_case.items()
    ]
    columns = ("rows x tokens", *(f"{label}: peak RSS, step" for label, _ in PATHS.values()))
    facts = [
        MODEL_FACTS,
        f"Not run: the whole-logits path past {WHOLE_MAX_TOKENS:,} tokens, the path without "
        f"checkpointing past {NO_CHECKPOINT_MAX_TOKENS:,}.",
    ]
    raw = {"cases": [asdict(m) for m in results]}
    return Report(SECTION, COMMAND, info, facts, (), [Table(columns, rows)], raw)


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
    facts = [MODEL_FACTS, f"On and off alternately, {PRICE_ROUNDS} runs of each, medians."]
    raw = {
        "times_s": {f"{r}x{s}": {str(k): v for k, v in by.items()} for (r, s), by in times.items()}
    }
    return Report(PRICE_SECTION, PRICE_COMMAND, info, facts, [target], [Table(columns, rows)], raw)


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.parser("bench.memory", __doc__, quick="two small cases")
    parser.add_argument("--case", help="ROWSxTOKENS: measure one case in this process")
    parser.add_argument("--path", choices=("whole", "chunked"), default="chunked")
    parser.add_argument("--checkpointing", choices=("on", "off"), default="on")
    parser.add_argument("--price", action="store_true", help="checkpointing's price only")
    args = cli.parse(parser, argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.case:
        rows, seq = (int(x) for x in args.case.split("x"))
        print_result(measure(rows, seq, args.path, args.checkpointing == "on"))
        return 0
    info = cpu_machine()
    if args.price:
        times = run_price(PRICE_CASES, PRICE_ROUNDS)
        emit(report_price(times, info), docs_of(args), args.json)
        return 0 if times else 1
    results = run_all(QUICK_CASES if args.quick else CASES)
    emit(report(results, info), docs_of(args), args.json)
    return 0 if results else 1


if __name__ == "__main__":
    raise SystemExit(main())
