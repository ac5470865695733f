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
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a file: `python bench/packing.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from bench.memory import cpu_model
from bench.queue_overhead_report import DOCS, write_docs
from queue_tinker.types.enums import LossFn
from queue_tinker.types.tensors import Datum, ModelInput, TensorData
from queue_tinker.types.training import LoraConfig
from queue_tinker.workers.executor.lora import load_frozen_base
from queue_tinker.workers.model.adapters import AdapterPool
from queue_tinker.workers.training.model_pass import PassPlan
from queue_tinker.workers.training.optimizers import rows_for
from queue_tinker.workers.training.packing import padding_fraction
from queue_tinker.workers.training.shared_pass import PassOp, shared_pass

SECTION = "## Padding and packing in cross-adapter passes"
COMMAND = ".venv/bin/python -m bench.packing"
CPU = torch.device("cpu")


def sft_lengths(count: int, longest: int, rng: np.random.Generator) -> list[int]:
    """Log-normal lengths (median ~150 tokens), clipped to [16, longest]."""
    return [int(x) for x in np.clip(rng.lognormal(5.0, 0.8, count), 16, longest)]


def datum(length: int, rng: np.random.Generator) -> Datum:
    ids = rng.integers(0, 256, length + 1)
    return Datum(
        model_input=ModelInput.from_ints(ids[:-1].tolist()),
        loss_fn_inputs={"target_tokens": TensorData.from_numpy(ids[1:].astype(np.int64))},
    )


def timed_pass(pool: AdapterPool, ops: Sequence[PassOp], plan: PassPlan, repeats: int) -> float:
    """Median seconds of the shared forward_backward pass."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = shared_pass(pool, ops, CPU, plan)
        times.append(time.perf_counter() - start)
        assert not any(isinstance(out, Exception) for out in outs)
        for op in ops:
            for p in op.adapter.params.values():
                p.grad = None
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default="queue-tinker/llama-100m")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--data", type=int, default=8, help="datums per op")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    model = "queue-tinker/tiny-llama" if args.quick else args.model
    with tempfile.TemporaryDirectory() as scratch:
        base = load_frozen_base(model, "cpu", Path(scratch), "auto")  # as a worker loads it
        context = int(base.config.max_position_embeddings)
        pool = AdapterPool(base, model, max_resident=args.adapters)
        rng = np.random.default_rng(0)
        ops = []
        for i in range(args.adapters):
            adapter = pool.add(f"m{i}", "bench", LoraConfig(rank=16), seed=i)
            data = [datum(n, rng) for n in sft_lengths(args.data, context - 1, rng)]
            ops.append(
                PassOp(
                    adapter=adapter,
                    data=data,
                    loss_fn=LossFn.CROSS_ENTROPY,
                    config={},
                    backward=True,
                )
            )
        lengths = [d.model_input.length for op in ops for d in op.data]
        plans = {
            "padded": PassPlan(pack_above_padding=None),
            "packed": PassPlan(pack_above_padding=0.0),
        }
        rows = {
            name: rows_for(
                [d for op in ops for d in op.data], CPU, plan, groups=[len(op.data) for op in ops]
            ).ids.shape
            for name, plan in plans.items()
        }
        seconds = {name: timed_pass(pool, ops, plan, args.repeats) for name, plan in plans.items()}
    tokens = sum(lengths)
    lines = [
        SECTION,
        "",
        f"Measured on {cpu_model()}, torch {torch.__version__}; `{COMMAND} --model {model}`. "
        f"{args.adapters} "
        f"adapters × {args.data} datums of log-normal lengths (median ~150, 16 to {context - 1} "
        f"tokens; {tokens:,} real tokens) in one shared forward_backward pass of `{model}`, "
        f"median of {args.repeats}. One datum a row, the pass is "
        f"{padding_fraction(lengths):.0%} padding; the engine packs once that passes 50% "
        "(`PassPlan.pack_above_padding`).",
        "",
        "| layout | rows × width | padded tokens | pass time | real tokens/s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in plans:
        r, w = rows[name]
        lines.append(
            f"| {name} | {r} × {w} | {r * w:,} | {seconds[name]:.2f} s | "
            f"{tokens / seconds[name]:,.0f} |"
        )
    lines += ["", f"Packed over padded: **{seconds['padded'] / seconds['packed']:.2f}×** tokens/s."]
    print("\n".join(lines))
    if not args.quick:
        write_docs(DOCS, "\n".join(lines) + "\n", SECTION)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
