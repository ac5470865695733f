"""Sampling: tokens/s of 32 concurrent requests through the service against `generate()` and
the worker's own loop in this process; the method is `## Sampling` of docs/benchmarks.md."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peft import PeftModel

from bench.decode_step import Info, Prompts, requests
from bench.harness import baselines, cli
from bench.harness.data import datums, random_prompts, sampling_params
from bench.harness.meters import CpuMeter, synchronize
from bench.harness.models import ensure_model, frozen_base
from bench.harness.report import Report, Table, Target, docs_of, emit
from bench.harness.run import TORCH, service_run
from bench.harness.services import deployment, job_times, service_client
from bench.harness.workers import lora_worker, use_torch_threads
from bench.sampling_engine import BIG, TINY
from queue_tinker.builtin_models import EOS_ID
from queue_tinker.client import SamplingClient, ServiceClient
from queue_tinker.queue.keys import Keys
from queue_tinker.types import AdamParams, ModelInput, SampleResponse
from queue_tinker.types.service.checkpoints import CheckpointPath
from queue_tinker.workers.model.checkpoints import checkpoint_dir
from queue_tinker.workers.model.memory import lora_compute_dtype
from queue_tinker.workers.sampling.decode_loop import generate

SECTION = "## Sampling"
GPU_SECTION = "## Sampling on a GPU"
COMMAND = ".venv/bin/python -m bench.sampling"
TARGET = 1.0  # service tokens/s over generate() tokens/s, base model
REQUESTS, ADAPTERS = 32, 4
SIDES = ("service", "generate", "loop")
CASES = ("base", "mixed")
SEED = 1000  # request i samples with seed SEED + i
TIMEOUT_S = 600.0


@dataclass
class Size:
    model: str
    tokens: int  # max_tokens of every request
    rounds: int
    budget_s: float  # no new round of a case starts after this many seconds of its rounds


@dataclass
class Split:
    """One service call split at the sample jobs' Redis-clock `started_at` / `finished_at`."""

    queue_in: float  # submit -> first op started
    worker: float  # first started -> last finished
    queue_out: float  # last finished -> last result in hand
    batches: list[int]  # requests in each generation batch the worker ran, in order
    batch_s: list[float]  # each batch: its first start -> its last finish


@dataclass
class CaseResult:
    times: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SIDES})
    foreign: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SIDES})
    split: list[Split] = field(default_factory=list)
    same_as_loop: list[int] = field(default_factory=list)  # service sequences equal to loop's

    def median(self, side: str) -> float:
        return statistics.median(self.times[side])

    def tok_s(self, side: str, tokens: int) -> float:
        return REQUESTS * tokens / self.median(side)

    def ratio(self, side: str = "service") -> float:
        """`side`'s tokens/s over generate()'s (median call time over median call time)."""
        return self.median("generate") / self.median(side)

    def first_batch(self) -> float | None:
        """Median time of the worker's first batch in calls it split; None unless most did
        (a split now and then is not what the median call saw)."""
        firsts = [x.batch_s[0] for x in self.split if len(x.batches) > 1]
        return statistics.median(firsts) if 2 * len(firsts) > len(self.split) else None


@dataclass
class SizeResult:
    size: Size
    params: int = 0
    hook_ms: float = 0.0  # PEFT's forward hooks for a mixed batch: register + remove, once
    cases: dict[str, CaseResult] = field(default_factory=lambda: {c: CaseResult() for c in CASES})


class Local:
    """The base model (and a PeftModel holding the checkpoints) in this process."""

    def __init__(self, model: str, data_dir: Path, prompts: Prompts, device: str) -> None:
        self.name, self.data_dir, self.prompts = model, data_dir, prompts
        self.device = torch.device(device)
        self.base = frozen_base(model, device, data_dir)
        self.peft: PeftModel | None = None
        self.ids, self.mask = baselines.left_padded(prompts, self.device)

    def attach(self, directories: list[Path]) -> list[str]:
        """A second copy of the base with the checkpoints loaded; their adapter names."""
        base = frozen_base(self.name, str(self.device), self.data_dir)
        names = [f"a{i}" for i in range(len(directories))]
        self.peft = PeftModel.from_pretrained(
            base, str(directories[0]), adapter_name=names[0], is_trainable=False
        )
        for name, directory in zip(names[1:], directories[1:], strict=True):
            self.peft.load_adapter(str(directory), adapter_name=name, is_trainable=False)
        self.peft.eval()
        return names

    def hook_ms(self, adapters: list[str], reps: int = 20) -> float:
        """What PEFT's forward hooks for a mixed batch cost to register and remove, once (as
        `PeftModel.forward(adapter_names=...)` does every step): median ms."""
        assert self.peft is not None
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            with self.peft._enable_peft_forward_hooks(adapter_names=adapters):
                pass
            times.append(time.perf_counter() - t0)
        return sorted(times)[reps // 2] * 1000

    def model(self, adapters: list[str] | None) -> Any:
        return self.base if adapters is None else self.peft

    def generate(self, tokens: int, adapters: list[str] | None) -> None:
        """One batched HF generate() call."""
        extra = {} if adapters is None else {"adapter_names": adapters}
        baselines.generate(self.model(adapters), self.ids, self.mask, tokens, **extra)

    def loop(self, tokens: int, adapters: list[str] | None) -> list[SampleResponse]:
        """The worker's generation function on the same requests."""
        batch = requests(self.prompts, tokens, adapters or [None], SEED)
        # LoRA's matmuls as the worker runs them (QT_LORA_MATMUL_DTYPE's auto: bf16 on CUDA).
        lora = lora_compute_dtype(self.base.dtype, "auto")
        return generate(
            self.model(adapters),
            batch,
            device=self.device,
            eos_token_ids=[EOS_ID],
            decode=lambda _: "",
            lora_compute=lora,
        )


@dataclass
class ServiceCall:
    wall: float  # time.time() before the first submit (lines up with Redis TIME)
    seconds: float
    job_ids: list[str]
    responses: list[SampleResponse]


def service_call(samplers: list[SamplingClient], prompts: Prompts, tokens: int) -> ServiceCall:
    """All requests at once through the async API (request i on sampler i mod n)."""

    async def go() -> ServiceCall:
        wall, t0 = time.time(), time.perf_counter()
        sends = (
            sampler.sample_async(ModelInput.from_ints(p), 1, sampling_params(SEED + i, tokens))
            for i, p in enumerate(prompts)
            for sampler in (samplers[i % len(samplers)],)
        )
        futures = await asyncio.gather(*sends)
        responses = await asyncio.wait_for(asyncio.gather(*futures), TIMEOUT_S)
        seconds = time.perf_counter() - t0
        return ServiceCall(wall, seconds, [f.request_id for f in futures], list(responses))

    return asyncio.run(go())


def check(responses: list[SampleResponse], tokens: int, what: str) -> None:
    """Each response: one sequence of `tokens` tokens, stopped by its length."""
    shapes = [[(len(x.tokens), x.stop_reason) for x in r.sequences] for r in responses]
    if bad := [i for i, shape in enumerate(shapes) if shape != [(tokens, "length")]]:
        raise AssertionError(f"{what}: requests {bad} did not generate {tokens} tokens to length")


def split_of(call: ServiceCall, times: list[tuple[float, ...] | None]) -> Split:
    known = sorted((t for t in times if t is not None), key=lambda t: t[1])
    groups: list[list[tuple[float, ...]]] = []
    for t in known:  # the ops of one batch all start before any of them is published
        if not groups or t[1] > min(g[2] for g in groups[-1]):
            groups.append([])
        groups[-1].append(t)
    started, finished = known[0][1], max(t[2] for t in known)
    return Split(
        started - call.wall,
        finished - started,
        call.wall + call.seconds - finished,
        [len(g) for g in groups],
        [max(t[2] for t in g) - g[0][1] for g in groups],
    )


def make_checkpoints(
    service: ServiceClient, model: str, storage: Path
) -> tuple[list[str], list[Path]]:
    """4 sampler checkpoints of one LoRA run, 2 training steps apart (so all differ)."""
    tc = service.create_lora_training_client(model, rank=32, seed=0)
    batch = datums(np.random.default_rng(1).integers(0, 256, (4, 33)), weights=False)
    paths = []
    for i in range(ADAPTERS):
        for _ in range(2):
            tc.forward_backward(batch, "cross_entropy")
            tc.optim_step(AdamParams(learning_rate=1e-2))
        paths.append(tc.save_weights_for_sampler(f"bench-{i}").result(TIMEOUT_S).path)
    return paths, [checkpoint_dir(storage, CheckpointPath.parse(p)) for p in paths]


def run_case(
    case: str,
    result: SizeResult,
    local: Local,
    samplers: list[SamplingClient],
    adapters: list[str] | None,
    meter: CpuMeter,
    redis_url: str,
    keys: Keys,
) -> None:
    size, out, prompts = result.size, result.cases[case], local.prompts
    # Warm-up: a few tokens on every side (first calls load kernels, adapters, caches).
    check(service_call(samplers, prompts, 4).responses, 4, "warm-up")
    local.generate(4, adapters)
    local.loop(4, adapters)
    began = time.perf_counter()
    for r in range(size.rounds):
        if r >= 2 and time.perf_counter() - began > size.budget_s:
            print(f"    {case}: time budget spent, {r} rounds", flush=True)
            break
        loop_out: list[SampleResponse] = []
        call: ServiceCall | None = None
        for side in SIDES[r % 3 :] + SIDES[: r % 3]:
            time.sleep(0.3)  # let the worker's write-behind settle before any side
            mark = meter.mark()
            t0 = time.perf_counter()
            if side == "service":
                call = service_call(samplers, prompts, size.tokens)
            elif side == "generate":
                local.generate(size.tokens, adapters)
            else:
                loop_out = local.loop(size.tokens, adapters)
            if side != "service":
                synchronize(local.device)
            seconds = call.seconds if side == "service" and call else time.perf_counter() - t0
            out.foreign[side].append(meter.foreign_since(mark))
            out.times[side].append(seconds)
        assert call is not None
        check(call.responses, size.tokens, f"service, {case}")
        check(loop_out, size.tokens, f"loop, {case}")
        pairs = zip(call.responses, loop_out, strict=True)
        same = sum(a.sequences[0].tokens == b.sequences[0].tokens for a, b in pairs)
        out.same_as_loop.append(same)
        out.split.append(split_of(call, job_times(redis_url, keys, call.job_ids)))
        rates = (f"{s} {REQUESTS * size.tokens / out.times[s][-1]:,.0f}" for s in SIDES)
        print(f"    {case} round {r + 1}: tok/s " + ", ".join(rates), flush=True)


def measure(args: argparse.Namespace, size: Size, database_url: str, data_dir: Path) -> SizeResult:
    ensure_model(size.model, data_dir)
    local = Local(size.model, data_dir, random_prompts(REQUESTS, 0), args.device)
    result = SizeResult(size, sum(p.numel() for p in local.base.parameters()))
    with deployment(args.redis_url, database_url, "sampling", data_dir) as settings:
        keys = Keys(settings.key_prefix)
        log = data_dir / f"worker-{settings.key_prefix}.log"
        with (
            lora_worker(settings, size.model, log, device=args.device) as proc,
            service_client(settings) as service,
        ):
            meter = CpuMeter([os.getpid(), proc.pid])
            base = service.create_sampling_client(base_model=size.model)
            run_case("base", result, local, [base], None, meter, args.redis_url, keys)
            paths, directories = make_checkpoints(service, size.model, settings.storage_dir)
            names = local.attach(directories)
            adapters = [names[i % ADAPTERS] for i in range(REQUESTS)]
            result.hook_ms = local.hook_ms(adapters)
            samplers = [service.create_sampling_client(model_path=p) for p in paths]
            run_case("mixed", result, local, samplers, adapters, meter, args.redis_url, keys)
    return result


SIZES = {s.model: s for s in (Size(TINY, 64, 10, 40), Size(BIG, 32, 5, 150))}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.parser("bench.sampling", __doc__, services=True)
    cli.add_models(parser, SIZES, default=SIZES)
    cli.add_torch(parser)
    parser.add_argument("--big-tokens", type=int, default=None, help="max_tokens at 100M")
    return cli.parse(parser, argv)


def sizes(args: argparse.Namespace) -> list[Size]:
    chosen = [SIZES[m] for m in args.models]
    if args.big_tokens:
        chosen = [replace(s, tokens=args.big_tokens) if "100m" in s.model else s for s in chosen]
    if args.quick:
        chosen = [Size(s.model, 16, 2, 0) for s in chosen]
    return chosen


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_torch_threads(args.threads)
    results = []
    with service_run(args, TORCH, "qt-bench-sampling-") as run:
        threads = {"benchmark process": torch.get_num_threads(), **run.worker_threads()}
        for size in sizes(args):
            print(f"{size.model}: {REQUESTS} × {size.tokens} tokens, threads {threads}", flush=True)
            results.append(measure(args, size, run.database_url, run.data_dir))
    counts = ", ".join(f"{k} {v}" for k, v in threads.items())
    facts = [
        f"Torch threads, set explicitly (OMP_NUM_THREADS={args.threads} in the worker's "
        f"environment, `torch.set_num_threads({args.threads})` here): {counts}.",
        f"The run took {run.total_s:.0f} s; client, worker, Redis and Postgres share the cores.",
    ]
    emit(report(run.info, facts, results, args.device), docs_of(args), args.json)
    return 0


def report(info: Info, facts: list[str], results: list[SizeResult], device: str = "cpu") -> Report:
    """The base-model target, the three sides' tokens/s, where the service's time goes."""
    ratios = [(r.size.model, r.cases["base"].ratio()) for r in results]
    what = f"service ≥ {TARGET:.1f}× generate() tokens/s, base model"
    targets = [Target(f"{what}, `{model}`", f"{x:.2f}×", x >= TARGET) for model, x in ratios]
    cases = [(r, name, c) for r in results for name, c in r.cases.items()]
    queue = ", ".join(
        f"`{r.size.model}` {name} {ms([x.queue_in + x.queue_out for x in c.split])}"
        for r, name, c in cases
    )
    hooks = ", ".join(f"{r.hook_ms:.1f} ms at `{r.size.model}`" for r in results)
    body: list[Table | str] = [
        throughput(cases),
        where(cases),
        "The queue itself (submit → first op started, last finished → last result), median ms "
        f"a call: {queue}.",
        "PEFT's forward hooks for a mixed batch, registered and removed once (as "
        f"`generate(adapter_names=...)` does at every step): {hooks}.",
    ]
    for r, name, c in cases:
        if (first := c.first_batch()) is not None:
            without = c.ratio() * c.median("service") / (c.median("service") - first)
            body.append(
                f"`{r.size.model}`, {name}: the worker started generating on the first request "
                f"to arrive; that first batch alone took {first * 1000:,.0f} ms, and without it "
                f"the service would have reached about {without:.2f}× generate()."
            )
    splits = [x for _, _, c in cases for x in c.split]
    if linger := sum(len(x.batches) > 2 for x in splits):
        body.append(
            f"{linger} of {len(splits)} calls ran in more than two worker batches: some "
            "sampling sessions had been released (`linger_ms`)."
        )
    gpu = device != "cpu"
    command = COMMAND + (f" --device {device}" if gpu else "")
    raw = {"results": [asdict(r) for r in results]}
    return Report(GPU_SECTION if gpu else SECTION, command, info, facts, targets, body, raw)


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:,.0f}"


def batch_text(splits: list[Split]) -> str:
    """Each batch pattern the worker ran, with the median time of each of its batches."""
    patterns: dict[str, list[Split]] = {}
    for x in splits:
        patterns.setdefault("+".join(map(str, x.batches)), []).append(x)
    return "; ".join(
        f"{p}: "
        + " + ".join(ms(list(col)) for col in zip(*(y.batch_s for y in group), strict=True))
        + f" ms ({len(group)} of {len(splits)} calls)"
        for p, group in sorted(patterns.items(), key=lambda kv: -len(kv[1]))
    )


def throughput(cases: list[tuple[SizeResult, str, CaseResult]]) -> Table:
    columns = (
        "model (params)", "case", "requests × max_tokens", "rounds", "generate() tok/s",
        "service tok/s", "service / generate()", "worker loop in-process tok/s",
        "loop / generate()", "other processes, cores (service / generate / loop)",
    )  # fmt: skip
    rows = [
        (f"`{r.size.model}` ({r.params / 1e6:,.1f}M)",
         "base model" if name == "base" else f"{ADAPTERS} adapters, mixed batch",
         f"{REQUESTS} × {t}", len(c.times["service"]), f"{c.tok_s('generate', t):,.0f}",
         f"{c.tok_s('service', t):,.0f}", f"**{c.ratio():.2f}×**", f"{c.tok_s('loop', t):,.0f}",
         f"{c.ratio('loop'):.2f}×",
         " / ".join(f"{statistics.mean(c.foreign[s]):.2f}" for s in SIDES))
        for r, name, c in cases
        for t in (r.size.tokens,)
    ]  # fmt: skip
    return Table(columns, rows)


def where(cases: list[tuple[SizeResult, str, CaseResult]]) -> Table:
    columns = (
        "model", "case", "service total", "submit → first op started",
        "on the worker (first started → last finished)", "last finished → last result in hand",
        "worker loop in-process", "generate()", "worker batches: requests, time each",
        "service sequences equal to the in-process loop's",
    )  # fmt: skip
    rows = [
        (f"`{r.size.model}`", name, ms(c.times["service"]),
         *(ms([getattr(x, part) for x in c.split]) for part in ("queue_in", "worker", "queue_out")),
         ms(c.times["loop"]), ms(c.times["generate"]), batch_text(c.split),
         f"{sum(c.same_as_loop)} of {REQUESTS * len(c.same_as_loop)}")
        for r, name, c in cases
    ]  # fmt: skip
    caption = (
        "Where the service's time goes (medians over rounds, ms per call of 32 requests; the "
        "split uses the Redis-clock `started_at` / `finished_at` of the sample jobs and the "
        "client's clock):"
    )
    return Table(columns, rows, caption=caption)


if __name__ == "__main__":
    sys.exit(main())
