"""Training step: time per forward_backward + optim_step through the service vs a bare PEFT loop.

For each model size (queue-tinker/tiny-llama, ~107K params, and queue-tinker/llama-100m,
~101M params), in one run, on the same machine, model and data:

- service: a real worker process (`python -m queue_tinker.cli worker --engine lora --device
  cpu`, production defaults) and a `ServiceClient`; one step is the natural Tinker loop
  `fb = tc.forward_backward(batch, "cross_entropy"); os = tc.optim_step(AdamParams(1e-4));
  fb.result(); os.result()` (the optim_step is submitted before waiting on forward_backward;
  the worker runs the two as one batch);
- bare: `load_base_model` + `peft.get_peft_model` (the worker's LoRA config) + `torch.optim.AdamW`
  in this process; one step is forward, target logprobs, loss = -sum(w * logp), backward,
  AdamW step, zero_grad. This is the limit the service is held against.

The two never compute at the same time: after a warm-up of each, the run alternates blocks of
N service steps and N bare steps (the order flips every round), and the bare loop uses as many
torch threads as the worker (checked in a child process started with the worker's
environment). Reported: median per-step time of each, p10-p90, the ratio service / bare and
its range over the per-round medians, and where the service's step goes (client clock plus the
Redis-clock `queued_at` / `started_at` / `finished_at` the worker writes into each job hash).

Other jobs share the machine, so every block also records how much CPU the rest of the machine
used meanwhile (/proc/stat minus this process and the worker); rounds where that stayed low are
"quiet" and get their own ratio. To say where the overhead goes, the run also times the
(de)serialisation and the engine's forward_backward function in-process, and counts the CPU
each part of the service (worker compute threads, its other threads, client, Redis, Postgres)
used per service step.

    .venv/bin/python -m bench.train_step            # full run (a few minutes), writes the docs
    .venv/bin/python -m bench.train_step --quick    # smoke run (about a minute), docs left alone
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from sqlalchemy.engine import make_url

from bench.harness import cli, engine
from bench.harness.baselines import ADAM, BareLoop
from bench.harness.data import RANK, datums, token_rows
from bench.harness.meters import CpuMeter, SideCpu, load1, median_ms
from bench.harness.models import ensure_model
from bench.harness.report import publish, save
from bench.harness.run import TORCH, Run, service_run
from bench.harness.services import (
    deployment,
    job_times,
    service_client,
)
from bench.harness.stats import Stages
from bench.harness.workers import lora_worker, quiet_transformers, worker_threads
from bench.train_step_report import (
    STAGE_NAMES,
    TARGET_RATIO,
    Block,
    Round,
    Size,
    SizeResult,
    print_table,
    quiet_text,
    render,
    results_json,
    shape,
)
from queue_tinker.builtin_models import BUILTIN_MODELS, VOCAB_SIZE
from queue_tinker.client import TrainingClient
from queue_tinker.client.training import forward_backward_input
from queue_tinker.queue.keys import Keys
from queue_tinker.types import codec
from queue_tinker.types.requests.loss_inputs import ModelLimits, check_batch
from queue_tinker.types.requests.training import ForwardBackwardInput, ForwardBackwardOutput
from queue_tinker.types.tensors import Datum, TensorData

RESULT_TIMEOUT_S = 600.0


@dataclass
class ServiceSample:
    """One service step as the client saw it."""

    wall: float  # time.time() before the first submit (lines up with Redis TIME)
    submit_s: float  # until both submit calls returned
    total_s: float  # until both results were in hand
    fb_id: str
    optim_id: str
    loss: float
    step: int  # the adapter's optimizer step after this one
    quiet: bool = False  # taken in a quiet round (set once the round is over)


# --- the service -------------------------------------------------------------------------------
def service_step(tc: TrainingClient, data: list[Datum]) -> ServiceSample:
    """One step of the natural Tinker loop: submit both ops, then wait on both."""
    wall = time.time()
    t0 = time.perf_counter()
    fb = tc.forward_backward(data, "cross_entropy")
    optim = tc.optim_step(ADAM)
    t1 = time.perf_counter()
    out = fb.result(timeout=RESULT_TIMEOUT_S)
    stepped = optim.result(timeout=RESULT_TIMEOUT_S)
    t2 = time.perf_counter()
    step = int((stepped.metrics or {}).get("step:max", 0))
    return ServiceSample(wall, t1 - t0, t2 - t0, fb.request_id, optim.request_id, out.loss, step)


def service_block(tc: TrainingClient, data: list[Datum], steps: int) -> list[ServiceSample]:
    return [service_step(tc, data) for _ in range(steps)]


def stages_of(redis_url: str, keys: Keys, samples: list[ServiceSample]) -> Stages:
    """Split every service step at the worker's start/finish marks of its two ops."""
    ids = [job for s in samples for job in (s.fb_id, s.optim_id)]
    times = job_times(redis_url, keys, ids)
    stages = Stages(names=STAGE_NAMES)
    for i, s in enumerate(samples):
        fb, optim = times[2 * i], times[2 * i + 1]
        if fb is None or optim is None:
            continue
        seen = s.wall + s.total_s
        started, published = min(fb[1], optim[1]), max(fb[2], optim[2])
        stages.rows.append((s.submit_s, started - s.wall, published - started, seen - published))
    return stages


def serialisation_ms(model: str, data: list[Datum], reps: int = 20) -> dict[str, float]:
    """Median ms of the (de)serialisation around one forward_backward, timed in this process
    with the functions the client and the engine call: the client validating and encoding
    the batch, the worker decoding and checking it, the result's way back."""
    limits = ModelLimits(
        vocab_size=VOCAB_SIZE,
        context_length=BUILTIN_MODELS[model].config["max_position_embeddings"],
    )
    payload = codec.encode(forward_backward_input(data, "cross_entropy", None).model_dump())
    output = ForwardBackwardOutput(
        loss_fn_outputs=[
            {"logprobs": TensorData.from_numpy(np.zeros(d.model_input.length, np.float32))}
            for d in data
        ],
        metrics={"loss:sum": 1.0},
    )
    result = codec.encode(output.model_dump())

    def decode_batch() -> None:
        check_batch(ForwardBackwardInput.model_validate(codec.decode(payload)), limits)

    return {
        "client: validate + encode the batch": median_ms(
            lambda: codec.encode(forward_backward_input(data, "cross_entropy", None).model_dump()),
            reps,
        ),
        "worker: decode + check the batch": median_ms(decode_batch, reps),
        "worker: encode the result": median_ms(lambda: codec.encode(output.model_dump()), reps),
        "client: decode the result": median_ms(
            lambda: ForwardBackwardOutput.model_validate(codec.decode(result)), reps
        ),
    }


def engine_function_ms(bare: BareLoop, data: list[Datum], reps: int) -> dict[str, float]:
    """The engine's forward_backward as a worker runs the op (a shared pass: padded batch,
    per-datum target logprobs and losses, outputs) against the bare forward + backward,
    alternating, on the bare loop's model in this process; median ms of each. Gradients are
    cleared after each call, so the bare loop's state is left as it was."""
    times: dict[str, list[float]] = {"engine forward_backward()": [], "bare forward+backward": []}
    cpu = torch.device("cpu")
    for _ in range(reps):
        for name in times:
            t0 = time.perf_counter()
            if name.startswith("engine"):
                engine.forward_backward(bare.pool, [(bare.adapter, data)], cpu)
            else:
                bare.forward_backward()
            times[name].append(time.perf_counter() - t0)
            bare.optimizer.zero_grad(set_to_none=True)
    return {name: statistics.median(ts) * 1000 for name, ts in times.items()}


# --- one size ----------------------------------------------------------------------------------
@dataclass
class Meters:
    cpu: CpuMeter
    side: SideCpu


def one_round(
    r: int, meters: Meters, bare: BareLoop, tc: TrainingClient, data: list[Datum], steps: int
) -> tuple[Round, list[ServiceSample]]:
    """A service block and a bare block (bare first in odd rounds); the round and the service
    samples."""
    samples: list[ServiceSample] = []
    bare_times: list[tuple[float, float]] = []
    foreign: dict[str, float] = {}
    for part in ("service", "bare") if r % 2 == 0 else ("bare", "service"):
        mark = meters.cpu.mark()
        if part == "bare":
            bare_times = bare.timed(steps)
        else:
            before = meters.side.snapshot()
            samples = service_block(tc, data, steps)
            meters.side.add(before, steps)
        foreign[part] = meters.cpu.foreign_since(mark)
    result = Round(
        Block([s.total_s for s in samples], foreign["service"]),
        Block([t for t, _ in bare_times], foreign["bare"], [fb for _, fb in bare_times]),
    )
    for sample in samples:
        sample.quiet = result.quiet
    return result, samples


def run_rounds(
    result: SizeResult,
    meters: Meters,
    bare: BareLoop,
    tc: TrainingClient,
    data: list[Datum],
    rounds: int,
) -> list[ServiceSample]:
    """Up to `rounds` rounds, none started once the size's time budget is spent (2 at least)."""
    samples: list[ServiceSample] = []
    began = time.perf_counter()
    for r in range(rounds):
        if r >= 2 and time.perf_counter() - began > result.size.budget_s:
            print(
                f"    time budget of {result.size.budget_s:.0f} s spent: stopping after {r} rounds",
                flush=True,
            )
            break
        done, block = one_round(r, meters, bare, tc, data, result.size.steps)
        result.rounds.append(done)
        samples.extend(block)
        print(
            f"    round {r + 1}/{rounds}: service {done.service.median * 1000:,.1f} ms, "
            f"bare {done.bare.median * 1000:,.1f} ms (median of {result.size.steps}); "
            f"other processes {done.service.foreign:.2f} / {done.bare.foreign:.2f} cores",
            flush=True,
        )
    return samples


def measure_size(
    args: argparse.Namespace, size: Size, database_url: str, data_dir: Path, threads: int
) -> SizeResult:
    """Warm up both, then alternate blocks; the service on a fresh key prefix."""
    rows = token_rows(size.batch, size.seq)
    data = datums(rows)
    bare = BareLoop(size.model, data_dir, rows)
    with deployment(args.redis_url, database_url, f"train-{size.label}", data_dir) as settings:
        result = SizeResult(
            size,
            bare.params,
            bare.lora_params,
            {"bare": torch.get_num_threads(), **worker_threads(settings)},
            load=[load1()],
        )
        began = time.perf_counter()
        # Production defaults: batching on, so the worker runs a step's two ops as one batch.
        with lora_worker(settings, size.model, data_dir / f"worker-{size.label}.log") as proc:
            print(f"    worker ready in {time.perf_counter() - began:.0f} s", flush=True)
            with service_client(settings) as service:
                tc = service.create_lora_training_client(size.model, rank=RANK, seed=0)
                warm = service_block(tc, data, args.warmup)
                result.first_loss = (warm[0].loss, bare.step()[0])
                bare.timed(args.warmup - 1)
                meters = Meters(
                    CpuMeter([os.getpid(), proc.pid]),
                    SideCpu(proc.pid, make_url(database_url).database or "", threads),
                )
                samples = run_rounds(result, meters, bare, tc, data, args.rounds)
                keys = Keys(settings.key_prefix)
                result.side_ms = meters.side.per_step_ms()
                result.stages = stages_of(args.redis_url, keys, samples)
                result.quiet_stages = stages_of(
                    args.redis_url, keys, [s for s in samples if s.quiet]
                )
                result.snapshots = sum(s.step % settings.snapshot_every_steps == 0 for s in samples)
                result.codec_ms = serialisation_ms(size.model, data)
                reps = min(20, max(3, round(2 / statistics.median(result.bare))))
                result.engine_ms = engine_function_ms(bare, data, reps)
    result.load.append(load1())
    del bare
    gc.collect()
    if result.threads["bare"] != threads:
        print(f"warning: bare loop ran with {result.threads['bare']} threads", file=sys.stderr)
    return result


# --- main --------------------------------------------------------------------------------------
def sizes(args: argparse.Namespace) -> list[Size]:
    return [
        Size(
            "tiny",
            "queue-tinker/tiny-llama",
            args.tiny_batch[0],
            args.tiny_batch[1],
            args.tiny_steps,
            args.tiny_budget,
        ),
        Size(
            "100m",
            "queue-tinker/llama-100m",
            args.big_batch[0],
            args.big_batch[1],
            args.big_steps,
            args.big_budget,
        ),
    ]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser("bench.train_step", __doc__)
    cli.add_services(parser)
    cli.add_knobs(
        parser,
        {
            "--rounds": (40, "most service/bare block pairs per size"),
            "--warmup": (3, "steps of each before measuring"),
            "--tiny-steps": (5, "steps per block, tiny"),
            "--big-steps": (1, "steps per block, 100M"),
            "--tiny-budget": (45.0, "seconds of tiny rounds after which no new round starts"),
            "--big-budget": (200.0, "seconds of 100M rounds after which no new round starts"),
        },
    )
    cli.add_batch(parser, "--tiny-batch", (8, 128))
    cli.add_batch(parser, "--big-batch", (2, 64))
    cli.add_data_dir(parser)
    cli.add_report(parser)
    cli.add_quick(parser)
    quick = {"rounds": 6, "warmup": 2, "tiny_steps": 5, "big_steps": 1}
    return cli.parse(parser, argv, quick={**quick, "tiny_budget": 8, "big_budget": 15})


def measure_sizes(args: argparse.Namespace, run: Run) -> list[SizeResult]:
    threads = run.worker_threads()["worker compute thread"]
    torch.set_num_threads(threads)  # what the worker's compute thread uses
    results = []
    for size in sizes(args):
        began = time.perf_counter()
        ensure_model(size.model, run.data_dir)
        print(
            f"[{size.label}] {size.model}: {shape(size)} tokens, {args.rounds} rounds × "
            f"{size.steps} steps each way, {threads} torch threads "
            f"(model ready in {time.perf_counter() - began:.0f} s) ...",
            flush=True,
        )
        results.append(measure_size(args, size, run.database_url, run.data_dir, threads))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_transformers()
    with service_run(args, TORCH, "qt-bench-train-") as run:
        results = measure_sizes(args, run)
    total_s = run.total_s
    print_table(results)
    print(
        f"\ntarget service/bare <= {TARGET_RATIO:.2f} at {results[-1].size.model}: "
        f"{results[-1].ratio:.3f} (quiet rounds: {quiet_text(results[-1])})\n"
        f"total {total_s:.0f} s"
    )
    save(args.json, results_json(run.info, results))
    publish(args.docs, args.no_docs, render(args, run.info, results, total_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
