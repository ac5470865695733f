"""A mixture of experts against a dense model of the same active size: one LoRA training step of
`queue-tinker/tiny-moe` and of `queue-tinker/tiny-llama` on the same tokens, each in a process of
its own, on the CPU (the `## Mixture of experts` section of docs/benchmarks.md says how).

    .venv/bin/python -m bench.moe            # writes its docs section
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.harness import cli, engine
from bench.harness.data import datums, token_rows
from bench.harness.isolated import print_result, run_isolated
from bench.harness.machine import cpu_machine
from bench.harness.meters import load1, peak_rss_bytes
from bench.harness.models import add_adapters, frozen_base, lora_pool
from bench.harness.report import Report, Table, docs_of, emit
from queue_tinker.types.requests.training import AdamParams, LoraConfig

SECTION = "## Mixture of experts: a LoRA step against a dense model of the same active size"
COMMAND = ".venv/bin/python -m bench.moe"
MODELS = {"dense": "queue-tinker/tiny-llama", "moe": "queue-tinker/tiny-moe"}
RANK = 16
MIB = 1 << 20
KNOBS = {
    "--rows": (8, "rows of the batch"),
    "--width": (128, "tokens a row"),
    "--steps": (10, "timed steps after a warm-up"),
    "--rounds": (3, "processes of each model, alternating"),
}


@dataclass
class Measurement:
    case: str
    params: int
    active: int  # used by one token: the experts it is not routed to left out
    lora: int
    step_ms: float  # median of the timed steps
    peak_rss_mib: float
    loss: float


def active_params(model: torch.nn.Module) -> int:
    """Parameters one token uses: stacked experts (3-D) count for the share it runs."""
    config = getattr(model, "config", None)
    share = int(getattr(config, "num_experts_per_tok", 1)) / int(getattr(config, "num_experts", 1))
    return round(sum(p.numel() * (share if p.ndim == 3 else 1) for p in model.parameters()))


def measure(case: str, rows: int, width: int, steps: int) -> Measurement:
    """The case, in this process, as a worker loads it: one warm-up step, `steps` timed ones."""
    torch.set_num_threads(1)  # tiny models: thread hand-offs cost more than the math
    with tempfile.TemporaryDirectory() as scratch:
        base = frozen_base(MODELS[case], "cpu", Path(scratch))
    params, active = sum(p.numel() for p in base.parameters()), active_params(base)
    pool = lora_pool(base, MODELS[case], adapters=1)
    [adapter] = add_adapters(pool, LoraConfig(rank=RANK), seeds=[0])
    data = datums(token_rows(rows, width + 1))
    adam = AdamParams(learning_rate=1e-3)
    times, loss = [], 0.0
    for step in range(steps + 1):
        start = time.perf_counter()
        [out] = engine.forward_backward(pool, [(adapter, data)], engine.CPU)
        engine.optim_step(adapter, adam)
        if step:  # the first is a warm-up
            times.append(time.perf_counter() - start)
        loss = out.metrics["loss:sum"]
    lora = sum(p.numel() for p in adapter.params.values())
    step_ms = statistics.median(times) * 1e3
    return Measurement(case, params, active, lora, step_ms, peak_rss_bytes() / MIB, loss)


def report(
    results: dict[str, Measurement], info: dict[str, str], args: argparse.Namespace, load: float
) -> Report:
    """A row a model, and the MoE's step time, LoRA size and memory over the dense model's."""
    dense, moe = results["dense"], results["moe"]
    tokens = args.rows * args.width
    table = Table(
        ("model", "parameters (active a token)", "LoRA parameters", "step", "tokens/s",
         "peak RSS"),
        [(f"`{MODELS[m.case]}`", f"{m.params:,} ({m.active:,})", f"{m.lora:,}",
          f"{m.step_ms:.0f} ms", f"{tokens / m.step_ms * 1e3:,.0f}", f"{m.peak_rss_mib:.0f} MiB")
         for m in (dense, moe)],
    )  # fmt: skip
    ratio = (
        f"MoE over dense: **{moe.step_ms / dense.step_ms:.2f}×** the step time, "
        f"{moe.lora / dense.lora:.2f}× the LoRA parameters, "
        f"{moe.peak_rss_mib - dense.peak_rss_mib:+.0f} MiB peak RSS."
    )
    facts = [
        f"fp32, one intra-op thread, load {load:.1f} at the start. A rank-{RANK} adapter, "
        f"{args.rows} x {args.width} tokens, median of {args.steps} steps after a warm-up; "
        f"{args.rounds} alternating rounds, the fastest round's median."
    ]
    raw = {case: asdict(m) for case, m in results.items()}
    return Report(SECTION, COMMAND, info, facts, (), [table, ratio], raw)


def main(argv: Sequence[str] | None = None) -> int:
    """Alternate the two models' processes; hand back the report of each one's fastest round."""
    parser = cli.parser("bench.moe", __doc__, knobs=KNOBS, quick="2 x 32 tokens, 2 steps")
    parser.add_argument("--case", choices=list(MODELS), help="measure one model, here")
    args = cli.parse(parser, argv, quick={"rows": 2, "width": 32, "steps": 2, "rounds": 1})
    if args.case:  # the isolated side
        print_result(measure(args.case, args.rows, args.width, args.steps))
        return 0
    info = cpu_machine()
    load = load1()
    results: dict[str, Measurement] = {}
    knobs = ["--rows", str(args.rows), "--width", str(args.width), "--steps", str(args.steps)]
    for _ in range(args.rounds):
        for case in MODELS:
            found = run_isolated("bench.moe", ["--case", case, *knobs])
            if found is None:
                return 1
            measured = Measurement(**found)
            print(f"{case}: {measured.step_ms:.0f} ms a step", flush=True)
            results[case] = min(results.get(case, measured), measured, key=lambda m: m.step_ms)
    emit(report(results, info, args, load), docs_of(args), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
