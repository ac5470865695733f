"""Padding in cross-adapter passes, and what packing saves: several adapters' forward_backward
ops with supervised-fine-tuning-like lengths (log-normal, 16 to 1,024 tokens) in one shared
pass of the built-in 100M model, one datum a row (right-padded) against packed rows.

    .venv/bin/python -m bench.packing                # the 100M model; writes its docs section
    .venv/bin/python -m bench.packing --model queue-tinker/tiny-llama
    .venv/bin/python -m bench.packing --quick        # the tiny model, docs left alone
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from bench.harness import cli, engine
from bench.harness.data import datums
from bench.harness.machine import cpu_model
from bench.harness.models import add_adapters, frozen_base, lora_pool
from bench.harness.report import publish, table
from queue_tinker.types.requests.training import LoraConfig
from queue_tinker.workers.model.adapters import AdapterPool

SECTION = "## Padding and packing in cross-adapter passes"
COMMAND = ".venv/bin/python -m bench.packing"
PLANS = {
    "padded": engine.PassPlan(pack_above_padding=None),
    "packed": engine.PassPlan(pack_above_padding=0.0),
}


def sft_lengths(count: int, longest: int, rng: np.random.Generator) -> list[int]:
    """Log-normal lengths (median ~150 tokens), clipped to [16, longest]."""
    return [int(x) for x in np.clip(rng.lognormal(5.0, 0.8, count), 16, longest)]


def timed_pass(
    pool: AdapterPool,
    batches: Sequence[engine.Batch],
    plan: engine.PassPlan,
    repeats: int,
) -> float:
    """Median seconds of the shared forward_backward pass."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.forward_backward(pool, batches, engine.CPU, plan)
        times.append(time.perf_counter() - start)
        engine.clear_grads(adapter for adapter, _ in batches)
    return statistics.median(times)


def render(
    args: argparse.Namespace,
    model: str,
    context: int,
    lengths: list[int],
    shapes: dict[str, tuple[int, int]],
    seconds: dict[str, float],
) -> str:
    tokens = sum(lengths)
    lines = [
        SECTION,
        "",
        f"Measured on {cpu_model()}, torch {torch.__version__}; `{COMMAND} --model {model}`. "
        f"{args.adapters} "
        f"adapters × {args.data} datums of log-normal lengths (median ~150, 16 to {context - 1} "
        f"tokens; {tokens:,} real tokens) in one shared forward_backward pass of `{model}`, "
        f"median of {args.repeats}. One datum a row, the pass is "
        f"{engine.padding_share(lengths):.0%} padding; the engine packs once that passes 50% "
        "(`PassPlan.pack_above_padding`).",
        "",
        *table(
            ("layout", "rows × width", "padded tokens", "pass time", "real tokens/s"),
            (
                (
                    name,
                    f"{r} × {w}",
                    f"{r * w:,}",
                    f"{seconds[name]:.2f} s",
                    f"{tokens / seconds[name]:,.0f}",
                )
                for name, (r, w) in shapes.items()
            ),
        ),
        "",
        f"Packed over padded: **{seconds['padded'] / seconds['packed']:.2f}×** tokens/s.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_quick(parser, "the tiny model")
    parser.add_argument("--model", default="queue-tinker/llama-100m")
    cli.add_knobs(
        parser,
        {
            "--adapters": (4, "adapters, an op each"),
            "--data": (8, "datums per op"),
            "--repeats": (3, "timed passes of each layout"),
        },
    )
    cli.add_report(parser, json=False)
    args = cli.parse(parser, argv, quick={"model": "queue-tinker/tiny-llama"})
    model = args.model
    with tempfile.TemporaryDirectory() as scratch:
        base = frozen_base(model, "cpu", Path(scratch))  # as a worker loads it
        context = int(base.config.max_position_embeddings)
        pool = lora_pool(base, model, adapters=args.adapters)
        adapters = add_adapters(pool, LoraConfig(rank=16), seeds=range(args.adapters))
        rng = np.random.default_rng(0)
        batches = [
            (
                adapter,
                datums(
                    (rng.integers(0, 256, n + 1) for n in sft_lengths(args.data, context - 1, rng)),
                    weights=False,
                ),
            )
            for adapter in adapters
        ]
        lengths = [d.model_input.length for _, data in batches for d in data]
        shapes = {name: engine.batch_shape(batches, plan) for name, plan in PLANS.items()}
        seconds = {
            name: timed_pass(pool, batches, plan, args.repeats) for name, plan in PLANS.items()
        }
    text = render(args, model, context, lengths, shapes, seconds)
    print(text, end="")
    publish(args.docs, args.no_docs, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
