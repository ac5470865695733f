"""Padding in cross-adapter passes, and what packing saves: several adapters' forward_backward
ops of log-normal lengths in one shared pass, one datum a row (right-padded) against packed rows
(the `## Padding and packing` section of docs/benchmarks.md).

    .venv/bin/python -m bench.packing                # the 100M model; writes its docs section
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import numpy as np

from bench.harness import cli, engine
from bench.harness.data import datums
from bench.harness.machine import cpu_machine
from bench.harness.meters import turns
from bench.harness.models import add_adapters, frozen_base, lora_pool
from bench.harness.report import Report, Table, docs_of, emit
from queue_tinker.types.requests.training import LoraConfig
from queue_tinker.workers.model.adapters import AdapterPool

SECTION = "## Padding and packing in cross-adapter passes"
COMMAND = ".venv/bin/python -m bench.packing"
PLANS = {
    "padded": engine.PassPlan(pack_above_padding=None),
    "packed": engine.PassPlan(pack_above_padding=0.0),
}
KNOBS = {
    "--adapters": (4, "adapters, an op each"),
    "--data": (8, "datums per op"),
    "--repeats": (3, "timed passes of each layout"),
}


def timed_pass(
    pool: AdapterPool, batches: Sequence[engine.Batch], plan: engine.PassPlan, repeats: int
) -> float:
    """Median seconds of the shared forward_backward pass."""
    one_pass = partial(engine.forward_backward, pool, batches, engine.CPU, plan)
    clear = partial(engine.clear_grads, [adapter for adapter, _ in batches])
    return statistics.median(turns({"pass": one_pass}, repeats, engine.CPU, after=clear)["pass"])


def report(
    args: argparse.Namespace,
    info: dict[str, str],
    context: int,
    batches: Sequence[engine.Batch],
    shapes: dict[str, tuple[int, int]],
    seconds: dict[str, float],
) -> Report:
    """A row a layout: its shape, padded tokens, pass time and real tokens/s; packed over padded."""
    lengths = [d.model_input.length for _, data in batches for d in data]
    tokens = sum(lengths)
    table = Table(
        ("layout", "rows × width", "padded tokens", "pass time", "real tokens/s"),
        [(name, f"{r} × {w}", f"{r * w:,}", f"{seconds[name]:.2f} s",
          f"{tokens / seconds[name]:,.0f}")
         for name, (r, w) in shapes.items()],
    )  # fmt: skip
    gain = f"Packed over padded: **{seconds['padded'] / seconds['packed']:.2f}×** tokens/s."
    facts = [
        f"{args.adapters} adapters × {args.data} datums of log-normal lengths (median ~150, 16 "
        f"to {context - 1} tokens; {tokens:,} real tokens) in one shared forward_backward pass "
        f"of `{args.model}`, median of {args.repeats}. One datum a row, the pass is "
        f"{engine.padding_share(lengths):.0%} padding; the engine packs once that passes 50% "
        "(`PassPlan.pack_above_padding`)."
    ]
    raw = {"lengths": lengths, "shapes": shapes, "seconds": seconds}
    return Report(SECTION, f"{COMMAND} --model {args.model}", info, facts, (), [table, gain], raw)


def main(argv: Sequence[str] | None = None) -> int:
    """Both layouts of the same ops on the model; hand back the report."""
    parser = cli.parser("bench.packing", __doc__, knobs=KNOBS, quick="the tiny model")
    parser.add_argument("--model", default="queue-tinker/llama-100m")
    args = cli.parse(parser, argv, quick={"model": "queue-tinker/tiny-llama"})
    info = cpu_machine()
    with tempfile.TemporaryDirectory() as scratch:
        base = frozen_base(args.model, "cpu", Path(scratch))  # as a worker loads it
        context = int(base.config.max_position_embeddings)
        pool = lora_pool(base, args.model, adapters=args.adapters)
        rng = np.random.default_rng(0)
        batches: list[engine.Batch] = []
        for adapter in add_adapters(pool, LoraConfig(rank=16), seeds=range(args.adapters)):
            # supervised-fine-tuning-like lengths: log-normal (median ~150), 16 to the context
            lengths = np.clip(rng.lognormal(5.0, 0.8, args.data), 16, context - 1).astype(int)
            rows = [rng.integers(0, 256, n + 1) for n in lengths]
            batches.append((adapter, datums(rows, weights=False)))
        shapes = {name: engine.batch_shape(batches, plan) for name, plan in PLANS.items()}
        seconds = {
            name: timed_pass(pool, batches, plan, args.repeats) for name, plan in PLANS.items()
        }
    emit(report(args, info, context, batches, shapes, seconds), docs_of(args), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
