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
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a file: `python bench/train_step.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import torch.nn.functional as F
from peft import get_peft_model
from sqlalchemy.engine import make_url
from transformers.utils import logging as transformers_logging

from bench.harness import (
    DEFAULT_POSTGRES,
    DEFAULT_REDIS,
    close_client,
    fresh_prefix,
    machine,
    make_settings,
    scratch_database,
)
from bench.lora_service import job_times, lora_worker, worker_threads
from bench.meters import CpuMeter, SideCpu, load1, median_ms
from bench.report import DOCS, write_docs
from bench.stats import Latency, Stages
from queue_tinker.builtin_models import BUILTIN_MODELS, VOCAB_SIZE
from queue_tinker.client import ServiceClient, TrainingClient
from queue_tinker.client.training import make_batch
from queue_tinker.queue import codec
from queue_tinker.queue.keys import Keys
from queue_tinker.types.enums import LossFn
from queue_tinker.types.loss_inputs import ModelLimits, check_batch, resolve_loss_config
from queue_tinker.types.tensors import Datum, ModelInput, TensorData
from queue_tinker.types.training import (
    AdamParams,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    LoraConfig,
)
from workers.adapters import linear_names, peft_config
from workers.base_model import ensure_builtin_model, load_base_model
from workers.forward import forward_backward

SECTION = "## Training step: service vs bare PEFT"
COMMAND = ".venv/bin/python -m bench.train_step"
TARGET_RATIO = 1.10
RANK = 32  # the service's default LoRA rank (Tinker's)
ADAM = AdamParams(learning_rate=1e-4)  # beta1 0.9, beta2 0.95, eps 1e-12, no weight decay
RESULT_TIMEOUT_S = 600.0
# A round is quiet when other processes took less than this many cores' worth of CPU during
# each of its two blocks.
QUIET_CORES = 0.25

STAGE_NAMES: tuple[str, ...] = (
    "both submit calls return (overlaps the rows below)",
    "submit -> forward_backward started (encode, enqueue, worker reads the op)",
    "forward_backward running on the worker (decode, compute, encode, publish)",
    "forward_backward finished -> optim_step started",
    "optim_step running on the worker (clip-norm, AdamW, snapshot)",
    "optim_step finished -> both results in the client's hand",
)


@dataclass(frozen=True)
class Size:
    """One model and its batch: `batch` datums of `seq` input tokens each."""

    label: str
    model: str
    batch: int
    seq: int
    steps: int  # steps per block
    budget_s: float  # no new round starts after this many seconds of rounds (2 rounds at least)


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


@dataclass
class Block:
    """One block of steps, and the CPU other processes took meanwhile."""

    times: list[float]  # seconds per step
    foreign: float  # cores' worth of CPU used by other processes (plus steal) during the block
    fb: list[float] = field(default_factory=list)  # bare steps: their forward + backward part

    @property
    def median(self) -> float:
        return statistics.median(self.times)


@dataclass
class Round:
    service: Block
    bare: Block

    @property
    def ratio(self) -> float:
        return self.service.median / self.bare.median

    @property
    def quiet(self) -> bool:
        return max(self.service.foreign, self.bare.foreign) < QUIET_CORES


@dataclass
class SizeResult:
    """Everything measured for one size."""

    size: Size
    params: int
    lora_params: int
    threads: dict[str, int]
    rounds: list[Round] = field(default_factory=list)
    stages: Stages = field(default_factory=lambda: Stages(names=STAGE_NAMES))
    quiet_stages: Stages = field(default_factory=lambda: Stages(names=STAGE_NAMES))
    first_loss: tuple[float, float] = (0.0, 0.0)  # (service, bare), same weights at step 0
    snapshots: int = 0  # measured service steps whose optim_step wrote a snapshot
    codec_ms: dict[str, float] = field(default_factory=dict)  # see serialisation_ms
    engine_ms: dict[str, float] = field(default_factory=dict)  # see engine_function_ms
    side_ms: dict[str, float] = field(default_factory=dict)  # see SideCpu
    load: list[float] = field(default_factory=list)  # 1-min load average at start and end

    @property
    def service(self) -> list[float]:
        return [t for r in self.rounds for t in r.service.times]

    @property
    def bare(self) -> list[float]:
        return [t for r in self.rounds for t in r.bare.times]

    @property
    def ratio(self) -> float:
        """Median service step over median bare step, every round: the headline number."""
        return statistics.median(self.service) / statistics.median(self.bare)

    @property
    def ratio_p10(self) -> float:
        """The same at the 10th percentiles: load from other processes only ever adds time,
        so the fast end of each distribution is the least disturbed."""
        return Latency(self.service).pct(10) / Latency(self.bare).pct(10)

    def quiet_rounds(self) -> list[Round]:
        return [r for r in self.rounds if r.quiet]

    def ratio_quiet(self) -> float | None:
        """The headline ratio over the rounds in which other processes stayed quiet."""
        quiet = self.quiet_rounds()
        if not quiet:
            return None
        return (statistics.median(t for r in quiet for t in r.service.times)
                / statistics.median(t for r in quiet for t in r.bare.times))

    def foreign(self, side: str) -> float:
        """Mean CPU (cores) other processes took during this side's blocks."""
        return statistics.mean(getattr(r, side).foreign for r in self.rounds)


# --- the data ----------------------------------------------------------------------------------
def token_rows(size: Size, seed: int = 0) -> np.ndarray:
    """(batch, seq + 1) byte tokens: row i's inputs are [:-1], its targets [1:]."""
    return np.random.default_rng(seed).integers(0, 256, (size.batch, size.seq + 1))


def make_data(rows: np.ndarray) -> list[Datum]:
    """The batch as Tinker datums (equal lengths: the worker's padded batch has no padding)."""
    return [Datum(model_input=ModelInput.from_ints(row[:-1]), loss_fn_inputs={
                "target_tokens": TensorData.from_numpy(row[1:].astype(np.int64)),
                "weights": TensorData.from_numpy(np.ones(len(row) - 1, dtype=np.float32))})
            for row in rows]


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
            trainable, lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2), eps=ADAM.eps,
            weight_decay=ADAM.weight_decay)
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
        stages.rows.append((s.submit_s, fb[1] - s.wall, fb[2] - fb[1], optim[1] - fb[2],
                            optim[2] - optim[1], seen - optim[2]))
    return stages


def serialisation_ms(model: str, data: list[Datum], reps: int = 20) -> dict[str, float]:
    """Median ms of the (de)serialisation around one forward_backward, timed in this process
    with the functions the client and the engine call: the client validating and encoding
    the batch, the worker decoding and checking it, the result's way back."""
    limits = ModelLimits(vocab_size=VOCAB_SIZE,
                         context_length=BUILTIN_MODELS[model].config["max_position_embeddings"])
    payload = codec.encode(make_batch(data, "cross_entropy", None).model_dump())
    output = ForwardBackwardOutput(loss_fn_outputs=[
        {"logprobs": TensorData.from_numpy(np.zeros(d.model_input.length, np.float32))}
        for d in data], metrics={"loss:sum": 1.0})
    result = codec.encode(output.model_dump())

    def decode_batch() -> None:
        check_batch(ForwardBackwardInput.model_validate(codec.decode(payload)), limits)

    return {
        "client: validate + encode the batch": median_ms(
            lambda: codec.encode(make_batch(data, "cross_entropy", None).model_dump()), reps),
        "worker: decode + check the batch": median_ms(decode_batch, reps),
        "worker: encode the result": median_ms(lambda: codec.encode(output.model_dump()), reps),
        "client: decode the result": median_ms(
            lambda: ForwardBackwardOutput.model_validate(codec.decode(result)), reps),
    }


def engine_function_ms(bare: BareLoop, data: list[Datum], reps: int) -> dict[str, float]:
    """The engine's own forward_backward function (workers/forward.py: padded batch, per-datum
    target logprobs and losses, outputs) against the bare forward + backward, alternating, on
    the bare loop's model in this process; median ms of each. Gradients are cleared after
    each call, so the bare loop's state is left as it was."""
    times: dict[str, list[float]] = {"engine forward_backward()": [], "bare forward+backward": []}
    config = resolve_loss_config(LossFn.CROSS_ENTROPY, None)
    cpu = torch.device("cpu")
    for _ in range(reps):
        for name in times:
            t0 = time.perf_counter()
            if name.startswith("engine"):
                forward_backward(bare.model, data, LossFn.CROSS_ENTROPY, config, cpu,
                                 backward=True)
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


def one_round(r: int, meters: Meters, bare: BareLoop, tc: TrainingClient, data: list[Datum],
              steps: int) -> tuple[Round, list[ServiceSample]]:
    """A service block and a bare block (bare first in odd rounds); the round and the service
    samples."""
    samples: list[ServiceSample] = []
    bare_times: list[tuple[float, float]] = []
    foreign: dict[str, float] = {}
    for part in (("service", "bare") if r % 2 == 0 else ("bare", "service")):
        mark = meters.cpu.mark()
        if part == "bare":
            bare_times = bare.timed(steps)
        else:
            before = meters.side.snapshot()
            samples = service_block(tc, data, steps)
            meters.side.add(before, steps)
        foreign[part] = meters.cpu.foreign_since(mark)
    result = Round(Block([s.total_s for s in samples], foreign["service"]),
                   Block([t for t, _ in bare_times], foreign["bare"],
                         [fb for _, fb in bare_times]))
    for sample in samples:
        sample.quiet = result.quiet
    return result, samples


def run_rounds(result: SizeResult, meters: Meters, bare: BareLoop, tc: TrainingClient,
               data: list[Datum], rounds: int) -> list[ServiceSample]:
    """Up to `rounds` rounds, none started once the size's time budget is spent (2 at least)."""
    samples: list[ServiceSample] = []
    began = time.perf_counter()
    for r in range(rounds):
        if r >= 2 and time.perf_counter() - began > result.size.budget_s:
            print(f"    time budget of {result.size.budget_s:.0f} s spent: stopping after "
                  f"{r} rounds", flush=True)
            break
        done, block = one_round(r, meters, bare, tc, data, result.size.steps)
        result.rounds.append(done)
        samples.extend(block)
        print(f"    round {r + 1}/{rounds}: service {done.service.median * 1000:,.1f} ms, "
              f"bare {done.bare.median * 1000:,.1f} ms (median of {result.size.steps}); "
              f"other processes {done.service.foreign:.2f} / {done.bare.foreign:.2f} cores",
              flush=True)
    return samples


def measure_size(args: argparse.Namespace, size: Size, database_url: str, data_dir: Path,
                 threads: int) -> SizeResult:
    """Warm up both, then alternate blocks; the service on a fresh key prefix."""
    rows = token_rows(size)
    data = make_data(rows)
    bare = BareLoop(size.model, data_dir / "models", rows)
    with fresh_prefix(args.redis_url, f"train-{size.label}") as prefix:
        settings = make_settings(args.redis_url, database_url, prefix, data_dir)
        result = SizeResult(size, bare.params, bare.lora_params,
                            {"bare": torch.get_num_threads(), **worker_threads(settings)},
                            load=[load1()])
        began = time.perf_counter()
        with lora_worker(settings, size.model, data_dir / f"worker-{size.label}.log") as proc:
            print(f"    worker ready in {time.perf_counter() - began:.0f} s", flush=True)
            service = ServiceClient(settings)
            try:
                tc = service.create_lora_training_client(size.model, rank=RANK, seed=0)
                warm = service_block(tc, data, args.warmup)
                result.first_loss = (warm[0].loss, bare.step()[0])
                bare.timed(args.warmup - 1)
                meters = Meters(CpuMeter([os.getpid(), proc.pid]),
                                SideCpu(proc.pid, make_url(database_url).database or "", threads))
                samples = run_rounds(result, meters, bare, tc, data, args.rounds)
                result.side_ms = meters.side.per_step_ms()
                result.stages = stages_of(args.redis_url, Keys(prefix), samples)
                result.quiet_stages = stages_of(args.redis_url, Keys(prefix),
                                                [s for s in samples if s.quiet])
                result.snapshots = sum(s.step % settings.snapshot_every_steps == 0
                                       for s in samples)
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


# --- output ------------------------------------------------------------------------------------
def spread(samples: list[float]) -> str:
    lat = Latency(samples)
    return f"{lat.p50:,.1f} ({lat.pct(10):,.1f}–{lat.p90:,.1f})"


def rounds_range(r: SizeResult) -> str:
    """Median (min–max) of the per-round ratios."""
    ratios = [x.ratio for x in r.rounds]
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})"


def shape(size: Size) -> str:
    return f"{size.batch} × {size.seq}"


def quiet_text(r: SizeResult) -> str:
    """The ratio over quiet rounds, with how many rounds were quiet."""
    ratio = r.ratio_quiet()
    value = "n/a" if ratio is None else f"{ratio:.2f}"
    return f"{value} ({len(r.quiet_rounds())} of {len(r.rounds)})"


def foreign_text(r: SizeResult) -> str:
    return f"{r.foreign('service'):.2f} / {r.foreign('bare'):.2f}"


def print_table(results: list[SizeResult]) -> None:
    """Per-step medians and ratio per size, then the service step's stages."""
    print(f"\n{'model':<26}{'batch':>9}{'bare ms p50 (p10-p90)':>28}"
          f"{'service ms p50 (p10-p90)':>30}{'ratio':>7}{'p10':>6}{'quiet':>16}"
          f"{'per round':>20}{'other cores s/b':>17}")
    for r in results:
        print(f"{r.size.model:<26}{shape(r.size):>9}{spread(r.bare):>28}{spread(r.service):>30}"
              f"{r.ratio:>7.2f}{r.ratio_p10:>6.2f}{quiet_text(r):>16}{rounds_range(r):>20}"
              f"{foreign_text(r):>17}")
    for r in results:
        print(f"\nservice step, {r.size.model} (median ms): "
              f"threads {r.threads}, first loss service {r.first_loss[0]:.4f} / "
              f"bare {r.first_loss[1]:.4f}")
        for name, value in r.stages.medians_ms().items():
            print(f"  {name:<76}{value:>10.1f}")
        print("  " + ", ".join(f"{k} {v:.2f}" for k, v in r.codec_ms.items()))
        print("  " + ", ".join(f"{k} {v:.2f}" for k, v in r.engine_ms.items()))
        print("  CPU ms per service step: "
              + ", ".join(f"{k} {v:.1f}" for k, v in r.side_ms.items()))
        for quiet in (False, True):
            parts = split(r, quiet) or {}
            print(f"  {'quiet' if quiet else 'all'}: "
                  + ", ".join(f"{k} {v:,.1f}" for k, v in parts.items()))


INTRO = (
    "Time per training step (`forward_backward` + `optim_step`) through the service, against "
    "a bare in-process PEFT loop on the same model, LoRA config (rank {rank}, alpha 32, "
    "dropout 0, every attention, MLP and unembedding linear) and data, measured in the same "
    "run. Service: a real worker process (`python -m queue_tinker.cli worker --engine lora "
    "--device cpu`, production defaults), the local Redis and a scratch Postgres database; a "
    "step is the natural Tinker loop `fb = tc.forward_backward(batch, \"cross_entropy\"); "
    "os = tc.optim_step(AdamParams(learning_rate=1e-4)); fb.result(); os.result()`. Bare: "
    "`load_base_model` + `peft.get_peft_model` + `torch.optim.AdamW` (same hyperparameters) in "
    "the benchmark process; a step is forward, target logprobs, loss = -Σ w·logp, backward, "
    "AdamW step, zero_grad. After {warmup} warm-up steps of each, rounds alternate a block of "
    "N service steps with a block of N bare steps (the order flips every round; up to {rounds} "
    "rounds, fewer once a time budget is spent), so the two never compute at the same time, "
    "and the bare loop uses as many torch threads as the worker. Blocks are short (one step at "
    "100M) because load from other jobs on this machine comes in bursts of seconds: a round's "
    "ratio compares steps taken moments apart.")
NOISE = (
    "Other jobs shared this 2-core machine during the run, and a 2-thread torch step slows "
    "down many times over when another process takes one of the cores (each parallel region "
    "waits for its slowest thread). So the benchmark measures, for every block, how much CPU "
    "the rest of the machine used meanwhile (all cores' busy time from /proc/stat, steal "
    "included, minus the benchmark's and the worker's own; last column, in cores). A round is "
    "*quiet* when that stayed under {quiet:g} cores during both of its blocks; the quiet-rounds "
    "ratio is the least disturbed comparison, the all-rounds ratio is the headline. Compare "
    "numbers from the same run only.")
HOW_TO_READ = [
    "How to read it: service minus bare is what the service adds to a step; the notes above "
    "split it three ways.",
    "",
    "1. Outside the worker's ops (submit → started, between the two ops, finished → client): "
    "the client validating and msgpack-encoding the batch, two enqueue scripts, the worker's "
    "wake-up on its op stream and the start script, the publish script and the pub/sub message "
    "back. A few milliseconds per step whatever the model size. The optim_step is submitted "
    "before the forward_backward finishes, so its own enqueue is hidden behind the compute.",
    "2. Inside forward_backward: decoding and checking the batch (timed separately: well under "
    "a millisecond at these shapes), the hop onto the worker's compute thread, and the "
    "engine's general per-datum path (padding from token lists, per-datum logprob slices, "
    "losses and outputs) where the bare loop does one vectorised cross-entropy; the engine "
    "function timed in-process against the bare forward + backward isolates that part. On "
    "this 2-core machine the op also competes with the service's own work beside it: the "
    "worker's event loop and Postgres write-behind threads, Redis, Postgres and the client "
    "(\"CPU time per service step, by part\" above) run on the same two cores as the "
    "2-thread compute, and a 2-thread torch step feels every millisecond taken from one of "
    "its cores.",
    "3. Inside optim_step: the gradient-norm pass (`clip_grad_norm_`, run even without "
    "clipping because the step reports `grad_norm`), and every `snapshot_every_steps` (20) "
    "optimizer steps a snapshot of the adapter and its AdamW moments to storage, which shows "
    "in the p90/p99 rather than in the median.",
    "",
    "These are CPU numbers. The fixed part (1) dominates the tiny model's ratio; at 100M "
    "parameters the compute dominates and the ratio is close to 1. On a GPU a step's compute "
    "shrinks by one to two orders of magnitude while (1) and the Python of (2) do not, so the "
    "ratio there will sit closer to the tiny row than to the 100M row: judge the service by "
    "its added milliseconds per step, not only by the ratio.",
]


def stage_lines(r: SizeResult) -> list[str]:
    lines = [f"Where a service step goes, `{r.size.model}` ({shape(r.size)}), in ms (client "
             "clock plus the Redis-clock `started_at` / `finished_at` the worker writes into "
             "each job hash; the rows after the first add up to the step):", "",
             "| stage | p50, all rounds | p50, quiet rounds | p99, all rounds |",
             "| --- | --- | --- | --- |"]
    p50, quiet, p99 = r.stages.medians_ms(), r.quiet_stages.medians_ms(), r.stages.p99s_ms()
    for name in STAGE_NAMES:
        q = f"{quiet[name]:,.1f}" if name in quiet else "n/a"
        lines.append(f"| {name} | {p50.get(name, 0):,.1f} | {q} | {p99.get(name, 0):,.1f} |")
    return [*lines, ""]


def ms(values: Sequence[float]) -> float:
    return statistics.median(values) * 1000


def split(r: SizeResult, quiet: bool) -> dict[str, float] | None:
    """Median milliseconds of the parts the service step and the bare step share, over the
    quiet rounds or all of them (None when there are none)."""
    rounds = r.quiet_rounds() if quiet else r.rounds
    rows = (r.quiet_stages if quiet else r.stages).rows
    if not rounds or not rows:
        return None
    bare = [(t, fb) for x in rounds for t, fb in zip(x.bare.times, x.bare.fb, strict=True)]
    return {
        "service": ms([t for x in rounds for t in x.service.times]),
        "bare": ms([t for t, _ in bare]),
        "service fb": ms([row[2] for row in rows]),
        "bare fb": ms([fb for _, fb in bare]),
        "service optim": ms([row[4] for row in rows]),
        "bare optim": ms([t - fb for t, fb in bare]),
        "queue": ms([row[1] + row[3] + row[5] for row in rows]),
    }


def overhead_note(r: SizeResult) -> str:
    """The service's median extra over bare, split at the worker's op boundaries (over the
    quiet rounds when there are any)."""
    quiet = bool(r.quiet_rounds())
    m = split(r, quiet)
    if m is None:
        return f"- `{r.size.model}`: no service step has its job timestamps."
    which = f"the {len(r.quiet_rounds())} quiet rounds" if quiet else "all rounds (none quiet)"
    codec = ", ".join(f"{k} {v:.2f} ms" for k, v in r.codec_ms.items())
    engine = " vs ".join(f"{k} {v:,.1f} ms" for k, v in r.engine_ms.items())
    side = ", ".join(f"{k} {v:,.1f} ms" for k, v in r.side_ms.items())
    return (f"- `{r.size.model}`, {which}: service {m['service']:,.1f} ms vs bare "
            f"{m['bare']:,.1f} ms per step ({m['service'] - m['bare']:+,.1f} ms). On the "
            f"worker, forward_backward ran {m['service fb']:,.1f} ms (bare forward + backward "
            f"{m['bare fb']:,.1f} ms) and optim_step {m['service optim']:,.1f} ms (bare AdamW "
            f"step + zero_grad {m['bare optim']:,.1f} ms); outside the two ops (submit → start, "
            f"between them, finish → client) a step spent {m['queue']:,.1f} ms. "
            f"{r.snapshots} of the {len(r.service)} measured service steps wrote a snapshot. "
            f"(De)serialisation of one forward_backward, timed in-process with the same "
            f"functions: {codec}. The engine's forward_backward function run in-process on the "
            f"bare model: {engine}. CPU time per service step, by part: {side}.")


def result_rows(results: list[SizeResult]) -> list[str]:
    lines = ["| model | params (LoRA) | batch (datums × tokens) | rounds × steps "
             "| bare ms/step p50 (p10–p90) | service ms/step p50 (p10–p90) "
             "| service / bare (medians) | at p10 | quiet rounds only (how many) "
             "| per round: median (min–max) | other processes, cores (service / bare blocks) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(
            f"| `{r.size.model}` | {r.params:,} ({r.lora_params:,}) | {shape(r.size)} "
            f"| {len(r.rounds)} × {r.size.steps} | {spread(r.bare)} | {spread(r.service)} "
            f"| **{r.ratio:.2f}** | {r.ratio_p10:.2f} | {quiet_text(r)} | {rounds_range(r)} "
            f"| {foreign_text(r)} |")
    return [*lines, ""]


def render(args: argparse.Namespace, info: dict[str, str], results: list[SizeResult],
           total_s: float) -> str:
    """The docs section, in Markdown."""
    largest = results[-1]
    ok = largest.ratio <= TARGET_RATIO
    threads = ", ".join(f"{k} {v}" for k, v in largest.threads.items())
    lines = [SECTION, "", INTRO.format(rank=RANK, warmup=args.warmup, rounds=args.rounds), "",
             "Reproduce (`--quick` is a smoke run that leaves this file alone):", "", "```",
             COMMAND, "```", "",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in info.items()) + f"; torch threads: "
             f"{threads}. The run took {total_s:.0f} s.", "", NOISE.format(quiet=QUIET_CORES),
             "",
             f"Target: service / bare ≤ {TARGET_RATIO:.2f} at `{largest.size.model}` (median "
             f"step over median step, all rounds): **{largest.ratio:.3f}, "
             f"{'met' if ok else 'not met'}** (quiet rounds only: {quiet_text(largest)}).", "",
             *result_rows(results)]
    for r in results:
        lines += stage_lines(r)
    lines += ["Medians per step, split where the two steps can be compared:", "",
              *(overhead_note(r) for r in results)]
    return "\n".join([*lines, "", *HOW_TO_READ, ""])


def results_json(info: dict[str, str], results: list[SizeResult]) -> str:
    return json.dumps({"machine": info, "sizes": [
        {"size": asdict(r.size), "params": r.params, "lora_params": r.lora_params,
         "threads": r.threads, "ratio": r.ratio, "ratio_quiet": r.ratio_quiet(),
         "rounds": [asdict(x) for x in r.rounds],
         "bare_s": r.bare, "service_s": r.service, "first_loss": r.first_loss,
         "stages_p50_ms": r.stages.medians_ms(), "snapshots": r.snapshots, "load": r.load,
         "codec_ms": r.codec_ms, "engine_ms": r.engine_ms, "side_cpu_ms": r.side_ms}
        for r in results]}, indent=2)


# --- main --------------------------------------------------------------------------------------
def sizes(args: argparse.Namespace) -> list[Size]:
    return [Size("tiny", "queue-tinker/tiny-llama", args.tiny_batch[0], args.tiny_batch[1],
                 args.tiny_steps, args.tiny_budget),
            Size("100m", "queue-tinker/llama-100m", args.big_batch[0], args.big_batch[1],
                 args.big_steps, args.big_budget)]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.train_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default=os.environ.get("QT_BENCH_REDIS_URL", DEFAULT_REDIS))
    parser.add_argument("--postgres-url", default=os.environ.get("QT_BENCH_DATABASE_URL",
                                                                 DEFAULT_POSTGRES),
                        help="admin URL; a scratch database is created beside it")
    parser.add_argument("--rounds", type=int, default=40,
                        help="most service/bare block pairs per size")
    parser.add_argument("--warmup", type=int, default=3, help="steps of each before measuring")
    parser.add_argument("--tiny-steps", type=int, default=5, help="steps per block, tiny")
    parser.add_argument("--big-steps", type=int, default=1, help="steps per block, 100M")
    parser.add_argument("--tiny-budget", type=float, default=45,
                        help="seconds of tiny rounds after which no new round starts")
    parser.add_argument("--big-budget", type=float, default=200,
                        help="seconds of 100M rounds after which no new round starts")
    parser.add_argument("--tiny-batch", type=int, nargs=2, default=[8, 128],
                        metavar=("DATUMS", "TOKENS"))
    parser.add_argument("--big-batch", type=int, nargs=2, default=[2, 64],
                        metavar=("DATUMS", "TOKENS"))
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="where the models are built and checkpoints go (default: a temp "
                        "dir); reuse one to skip building the 100M model")
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
            print(f"[{size.label}] {size.model}: {shape(size)} tokens, {args.rounds} rounds × "
                  f"{size.steps} steps each way, {threads} torch threads "
                  f"(model ready in {time.perf_counter() - began:.0f} s) ...", flush=True)
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
    print(f"\ntarget service/bare <= {TARGET_RATIO:.2f} at {results[-1].size.model}: "
          f"{results[-1].ratio:.3f} (quiet rounds: {quiet_text(results[-1])})\n"
          f"total {total_s:.0f} s")
    if args.json is not None:
        args.json.write_text(results_json(info, results))
    if not args.no_docs:
        write_docs(args.docs, render(args, info, results, total_s), heading=SECTION)
        print(f"wrote {args.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
