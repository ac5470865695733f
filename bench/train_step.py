"""Training step: time per forward_backward + optim_step through the service vs a bare PEFT loop.

For each model size (queue-tinker/tiny-llama, ~107K params, and queue-tinker/llama-100m,
~101M params), in one run, on the same machine, model and data:

- service: a real worker process (`python -m queue_tinker.cli worker --engine lora --device
  cpu`) and a `ServiceClient`; one step is the natural Tinker loop
  `fb = tc.forward_backward(batch, "cross_entropy"); os = tc.optim_step(AdamParams(1e-4));
  fb.result(); os.result()` (the optim_step is submitted before waiting on forward_backward);
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
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a file: `python bench/train_step.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import torch.nn.functional as F
from peft import get_peft_model
from sqlalchemy.engine import make_url
from transformers.utils import logging as transformers_logging

from bench.harness.meters import CpuMeter, SideCpu, load1, median_ms
from bench.harness.services import (
    DEFAULT_POSTGRES,
    DEFAULT_REDIS,
    close_client,
    fresh_prefix,
    machine,
    make_settings,
    scratch_database,
)
from bench.harness.stats import Stages
from bench.harness.workers import job_times, lora_worker, worker_threads
from bench.queue_overhead_report import DOCS, write_docs
from bench.train_step_report import (
    RANK,
    SECTION,
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
from queue_tinker.client import ServiceClient, TrainingClient
from queue_tinker.client.training import make_batch
from queue_tinker.queue.keys import Keys
from queue_tinker.types import codec
from queue_tinker.types.enums import LossFn
from queue_tinker.types.loss_inputs import ModelLimits, check_batch, resolve_loss_config
from queue_tinker.types.tensors import Datum, ModelInput, TensorData
from queue_tinker.types.training import (
    AdamParams,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    LoraConfig,
)
from queue_tinker.workers.model.adapters import linear_names, peft_config
from queue_tinker.workers.model.base_model import ensure_builtin_model, load_base_model
from queue_tinker.workers.training.optimizers import forward_backward

ADAM = AdamParams(learning_rate=1e-4)  # beta1 0.9, beta2 0.95, eps 1e-12, no weight decay
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


# --- the data ----------------------------------------------------------------------------------
def token_rows(size: Size, seed: int = 0) -> np.ndarray:
    """(batch, seq + 1) byte tokens: row i's inputs are [:-1], its targets [1:]."""
    return np.random.default_rng(seed).integers(0, 256, (size.batch, size.seq + 1))


def make_data(rows: np.ndarray) -> list[Datum]:
    """The batch as Tinker datums (equal lengths: the worker's padded batch has no padding)."""
    return [
        Datum(
            model_input=ModelInput.from_ints(row[:-1]),
            loss_fn_inputs={
                "target_tokens": TensorData.from_numpy(row[1:].astype(np.int64)),
                "weights": TensorData.from_numpy(np.ones(len(row) - 1, dtype=np.float32)),
            },
        )
        for row in rows
    ]


# --- the bare loop -----------------------------------------------------------------------------
class BareLoop:
    """The worker's model and LoRA config, trained by hand in this process."""

    def __init__(self, model: str, models_dir: Path, rows: np.ndarray) -> None:
        base = load_base_model(model, "cpu", models_dir)
        base.eval()  # as the engine does (dropout is 0 anyway)
        # As the engine does: keeps PEFT from renaming the base in its config.
        base.name_or_path = model  # type: ignore[assignment]
        config = peft_config(linear_names(base), LoraConfig(rank=RANK), model)
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning)
            self.model = get_peft_model(base, config)
        self.params = sum(p.numel() for p in base.parameters() if not p.requires_grad)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.lora_params = sum(p.numel() for p in trainable)
        self.optimizer = torch.optim.AdamW(
            trainable,
            lr=ADAM.learning_rate,
            betas=(ADAM.beta1, ADAM.beta2),
            eps=ADAM.eps,
            weight_decay=ADAM.weight_decay,
        )
        tokens = torch.from_numpy(rows)
        self.ids = tokens[:, :-1].contiguous()
        self.mask = torch.ones_like(self.ids)
        self.targets = tokens[:, 1:].reshape(-1)
        self.weights = torch.ones(self.targets.numel())

    def forward_backward(self) -> float:
        """Forward, target logprobs, loss = -sum(w * logp), backward; the loss."""
        logits = self.model(input_ids=self.ids, attention_mask=self.mask, use_cache=False).logits
        logp = -F.cross_entropy(logits.flatten(0, 1).float(), self.targets, reduction="none")
        loss = -(self.weights * logp).sum()
        loss.backward()
        return float(loss.detach())

    def step(self) -> tuple[float, float]:
        """One training step; (loss, seconds into the step when backward had returned)."""
        t0 = time.perf_counter()
        loss = self.forward_backward()
        backward_done = time.perf_counter() - t0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, backward_done

    def timed(self, steps: int) -> list[tuple[float, float]]:
        """(step seconds, forward+backward seconds) of each of `steps` steps."""
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            _, backward_done = self.step()
            times.append((time.perf_counter() - t0, backward_done))
        return times


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
        stages.rows.append(
            (
                s.submit_s,
                fb[1] - s.wall,
                fb[2] - fb[1],
                optim[1] - fb[2],
                optim[2] - optim[1],
                seen - optim[2],
            )
        )
    return stages


def serialisation_ms(model: str, data: list[Datum], reps: int = 20) -> dict[str, float]:
    """Median ms of the (de)serialisation around one forward_backward, timed in this process
    with the functions the client and the engine call: the client validating and encoding
    the batch, the worker decoding and checking it, the result's way back."""
    limits = ModelLimits(
        vocab_size=VOCAB_SIZE,
        context_length=BUILTIN_MODELS[model].config["max_position_embeddings"],
    )
    payload = codec.encode(make_batch(data, "cross_entropy", None).model_dump())
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
            lambda: codec.encode(make_batch(data, "cross_entropy", None).model_dump()), reps
        ),
        "worker: decode + check the batch": median_ms(decode_batch, reps),
        "worker: encode the result": median_ms(lambda: codec.encode(output.model_dump()), reps),
        "client: decode the result": median_ms(
            lambda: ForwardBackwardOutput.model_validate(codec.decode(result)), reps
        ),
    }


def engine_function_ms(bare: BareLoop, data: list[Datum], reps: int) -> dict[str, float]:
    """The engine's own forward_backward function (workers/training/optimizers.py: padded
    batch, per-datum target logprobs and losses, outputs) against the bare forward + backward,
    alternating, on the bare loop's model in this process; median ms of each. Gradients are
    cleared after each call, so the bare loop's state is left as it was."""
    times: dict[str, list[float]] = {"engine forward_backward()": [], "bare forward+backward": []}
    config = resolve_loss_config(LossFn.CROSS_ENTROPY, None)
    cpu = torch.device("cpu")
    for _ in range(reps):
        for name in times:
            t0 = time.perf_counter()
            if name.startswith("engine"):
                forward_backward(bare.model, data, LossFn.CROSS_ENTROPY, config, cpu, backward=True)
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
    rows = token_rows(size)
    data = make_data(rows)
    bare = BareLoop(size.model, data_dir / "models", rows)
    with fresh_prefix(args.redis_url, f"train-{size.label}") as prefix:
        settings = make_settings(args.redis_url, database_url, prefix, data_dir)
        result = SizeResult(
            size,
            bare.params,
            bare.lora_params,
            {"bare": torch.get_num_threads(), **worker_threads(settings)},
            load=[load1()],
        )
        began = time.perf_counter()
        # Batching off: its one model has nothing to batch with, and a batch would start and
        # finish the step's two ops together, hiding the stage split (train_throughput
        # measures batching).
        with lora_worker(
            settings,
            size.model,
            data_dir / f"worker-{size.label}.log",
            {"QT_CROSS_ADAPTER_BATCH": "0"},
        ) as proc:
            print(f"    worker ready in {time.perf_counter() - began:.0f} s", flush=True)
            service = ServiceClient(settings)
            try:
                tc = service.create_lora_training_client(size.model, rank=RANK, seed=0)
                warm = service_block(tc, data, args.warmup)
                result.first_loss = (warm[0].loss, bare.step()[0])
                bare.timed(args.warmup - 1)
                meters = Meters(
                    CpuMeter([os.getpid(), proc.pid]),
                    SideCpu(proc.pid, make_url(database_url).database or "", threads),
                )
                samples = run_rounds(result, meters, bare, tc, data, args.rounds)
                result.side_ms = meters.side.per_step_ms()
                result.stages = stages_of(args.redis_url, Keys(prefix), samples)
                result.quiet_stages = stages_of(
                    args.redis_url, Keys(prefix), [s for s in samples if s.quiet]
                )
                result.snapshots = sum(s.step % settings.snapshot_every_steps == 0 for s in samples)
                result.codec_ms = serialisation_ms(size.model, data)
                reps = min(20, max(3, round(2 / statistics.median(result.bare))))
                result.engine_ms = engine_function_ms(bare, data, reps)
            finally:
                close_client(service)
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
    parser = argparse.ArgumentParser(
        prog="bench.train_step",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--redis-url", default=os.environ.get("QT_BENCH_REDIS_URL", DEFAULT_REDIS))
    parser.add_argument(
        "--postgres-url",
        default=os.environ.get("QT_BENCH_DATABASE_URL", DEFAULT_POSTGRES),
        help="admin URL; a scratch database is created beside it",
    )
    parser.add_argument(
        "--rounds", type=int, default=40, help="most service/bare block pairs per size"
    )
    parser.add_argument("--warmup", type=int, default=3, help="steps of each before measuring")
    parser.add_argument("--tiny-steps", type=int, default=5, help="steps per block, tiny")
    parser.add_argument("--big-steps", type=int, default=1, help="steps per block, 100M")
    parser.add_argument(
        "--tiny-budget",
        type=float,
        default=45,
        help="seconds of tiny rounds after which no new round starts",
    )
    parser.add_argument(
        "--big-budget",
        type=float,
        default=200,
        help="seconds of 100M rounds after which no new round starts",
    )
    parser.add_argument(
        "--tiny-batch", type=int, nargs=2, default=[8, 128], metavar=("DATUMS", "TOKENS")
    )
    parser.add_argument(
        "--big-batch", type=int, nargs=2, default=[2, 64], metavar=("DATUMS", "TOKENS")
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="where the models are built and checkpoints go (default: a temp "
        "dir); reuse one to skip building the 100M model",
    )
    parser.add_argument("--docs", type=Path, default=DOCS)
    parser.add_argument("--no-docs", action="store_true", help="leave docs/benchmarks.md alone")
    parser.add_argument("--json", type=Path, default=None, help="also write raw results here")
    parser.add_argument("--quick", action="store_true", help="smoke run, docs left alone")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup, args.tiny_steps, args.big_steps = 6, 2, 5, 1
        args.tiny_budget, args.big_budget, args.no_docs = 8, 15, True
    return args


def run(args: argparse.Namespace, data_dir: Path) -> list[SizeResult]:
    with scratch_database(args.postgres_url) as database_url:
        probe = make_settings(args.redis_url, database_url, "qt-bench-probe", data_dir)
        threads = worker_threads(probe)["worker compute thread"]
        torch.set_num_threads(threads)  # what the worker's compute thread uses
        results = []
        for size in sizes(args):
            began = time.perf_counter()
            ensure_builtin_model(size.model, data_dir / "models")
            print(
                f"[{size.label}] {size.model}: {shape(size)} tokens, {args.rounds} rounds × "
                f"{size.steps} steps each way, {threads} torch threads "
                f"(model ready in {time.perf_counter() - began:.0f} s) ...",
                flush=True,
            )
            results.append(measure_size(args, size, database_url, data_dir, threads))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.perf_counter()
    transformers_logging.disable_progress_bar()
    info = machine(args.redis_url, args.postgres_url, packages=("torch", "transformers", "peft"))
    print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    if args.data_dir is not None:
        args.data_dir.mkdir(parents=True, exist_ok=True)
        results = run(args, args.data_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="qt-bench-train-") as tmp:
            results = run(args, Path(tmp))
    total_s = time.perf_counter() - began
    print_table(results)
    print(
        f"\ntarget service/bare <= {TARGET_RATIO:.2f} at {results[-1].size.model}: "
        f"{results[-1].ratio:.3f} (quiet rounds: {quiet_text(results[-1])})\n"
        f"total {total_s:.0f} s"
    )
    if args.json is not None:
        args.json.write_text(results_json(info, results))
    if not args.no_docs:
        write_docs(args.docs, render(args, info, results, total_s), heading=SECTION)
        print(f"wrote {args.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
