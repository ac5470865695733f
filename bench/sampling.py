"""Sampling: generated tokens per second for 32 concurrent requests through the service vs
transformers' batched `generate()` on the same model, in the same run.

For each model, after a short warm-up of every side, rounds rotate three sides (so drift from
other jobs hits them alike; only one computes at a time, the worker idles between its ops):

- service: 32 `sample_async` calls (prompts of 8-48 tokens, num_samples 1, temperature 1,
  `stop=[]`, a seed each) sent at once to a real LoRA worker process, timed from the first
  submit to the last result in hand;
- generate: the same 32 prompts left-padded into one `model.generate(do_sample=True,
  min_new_tokens=max_new_tokens, ...)` call on the same model loaded in this process;
- loop: the worker's own generation function
  (`queue_tinker.workers.sampling.decode_loop.generate`) on the same batch in this process: the
  service minus the queue, to split the service's cost in two.

Two cases: the base model (one sampling session), then mixed adapters (4 sampler checkpoints
made by a few training steps through the service; 8 requests on each, one session each) against
PEFT `generate(adapter_names=...)` on a PeftModel holding the same 4 checkpoint directories.
max_tokens is 64 for the tiny model and 32 for the 100M one (fewer rounds too), which keeps a
full run near 10 minutes on a 2-core CPU machine; results and the machine go into the
`## Sampling` section of docs/benchmarks.md (bench/sampling_report.py renders it).

    .venv/bin/python -m bench.sampling            # full run (several minutes), writes the docs
    .venv/bin/python -m bench.sampling --quick    # smoke run, docs left alone
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peft import PeftModel

from bench.harness import cli
from bench.harness.baselines import generate as batched_generate
from bench.harness.baselines import left_padded
from bench.harness.data import datums, random_prompts, sampling_params
from bench.harness.meters import CpuMeter, synchronize
from bench.harness.models import ensure_model, frozen_base
from bench.harness.report import publish
from bench.harness.run import TORCH, service_run
from bench.harness.services import (
    deployment,
    job_times,
    service_client,
)
from bench.harness.workers import lora_worker, use_torch_threads
from bench.sampling_report import (
    ADAPTERS,
    REQUESTS,
    SIDES,
    Size,
    SizeResult,
    Split,
    findings,
    render,
    split_lines,
    table,
)
from queue_tinker.builtin_models import EOS_ID
from queue_tinker.client import SamplingClient, ServiceClient
from queue_tinker.queue.keys import Keys
from queue_tinker.types import AdamParams, ModelInput, SampleResponse, SamplingParams
from queue_tinker.types.service.checkpoints import CheckpointPath
from queue_tinker.workers.model.checkpoints import checkpoint_dir
from queue_tinker.workers.model.memory import lora_compute_dtype
from queue_tinker.workers.sampling.decode_loop import GenerationRequest, generate

SEED = 1000  # request i samples with seed SEED + i
TIMEOUT_S = 600.0


def params(i: int, tokens: int) -> SamplingParams:
    return sampling_params(SEED + i, tokens)


# --- this process: generate() and the worker's loop on the same model -------------------------
class Local:
    """The base model (and a PeftModel holding the checkpoints) in this process."""

    def __init__(
        self, model: str, data_dir: Path, prompts: list[list[int]], device: str = "cpu"
    ) -> None:
        self.name, self.data_dir, self.prompts = model, data_dir, prompts
        self.device = torch.device(device)
        self.base = frozen_base(model, device, data_dir)
        self.peft: PeftModel | None = None
        self.ids, self.mask = left_padded(prompts, self.device)

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

    def generate(self, tokens: int, adapters: list[str] | None) -> None:
        """One batched HF generate() call."""
        model: Any = self.base if adapters is None else self.peft
        extra = {} if adapters is None else {"adapter_names": adapters}
        batched_generate(model, self.ids, self.mask, tokens, **extra)

    def loop(self, tokens: int, adapters: list[str] | None) -> list[SampleResponse]:
        """The worker's generation function on the same requests."""
        model: Any = self.base if adapters is None else self.peft
        requests = [
            GenerationRequest(
                prompt=p,
                num_samples=1,
                params=params(i, tokens),
                max_tokens=tokens,
                prompt_logprobs=False,
                adapter=None if adapters is None else adapters[i],
            )
            for i, p in enumerate(self.prompts)
        ]
        # LoRA's matmuls as the worker runs them (QT_LORA_MATMUL_DTYPE's auto: bf16 on CUDA).
        lora = lora_compute_dtype(self.base.dtype, "auto")
        return generate(
            model,
            requests,
            device=self.device,
            eos_token_ids=[EOS_ID],
            decode=lambda _: "",
            lora_compute=lora,
        )


# --- the service -------------------------------------------------------------------------------
@dataclass
class ServiceCall:
    wall: float  # time.time() before the first submit (lines up with Redis TIME)
    seconds: float
    job_ids: list[str]
    responses: list[SampleResponse]


def service_call(
    samplers: list[SamplingClient], prompts: list[list[int]], tokens: int
) -> ServiceCall:
    """All requests at once through the async API (request i on sampler i mod n)."""

    async def go() -> ServiceCall:
        wall, t0 = time.time(), time.perf_counter()
        futures = await asyncio.gather(
            *(
                samplers[i % len(samplers)].sample_async(
                    ModelInput.from_ints(p), 1, params(i, tokens)
                )
                for i, p in enumerate(prompts)
            )
        )
        responses = await asyncio.wait_for(asyncio.gather(*futures), TIMEOUT_S)
        return ServiceCall(
            wall, time.perf_counter() - t0, [f.request_id for f in futures], list(responses)
        )

    return asyncio.run(go())


def check(responses: list[SampleResponse], tokens: int, what: str) -> None:
    bad = [
        i
        for i, r in enumerate(responses)
        if len(r.sequences) != 1
        or len(r.sequences[0].tokens) != tokens
        or r.sequences[0].stop_reason != "length"
    ]
    if bad:
        raise AssertionError(
            f"{what}: requests {bad} did not generate {tokens} tokens ending with 'length'"
        )


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


# --- one model ---------------------------------------------------------------------------------
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
                seconds = call.seconds
            elif side == "generate":
                local.generate(size.tokens, adapters)
                synchronize(local.device)
                seconds = time.perf_counter() - t0
            else:
                loop_out = local.loop(size.tokens, adapters)
                synchronize(local.device)
                seconds = time.perf_counter() - t0
            out.foreign[side].append(meter.foreign_since(mark))
            out.times[side].append(seconds)
        assert call is not None
        check(call.responses, size.tokens, f"service, {case}")
        check(loop_out, size.tokens, f"loop, {case}")
        out.same_as_loop.append(
            sum(
                a.sequences[0].tokens == b.sequences[0].tokens
                for a, b in zip(call.responses, loop_out, strict=True)
            )
        )
        out.split.append(split_of(call, job_times(redis_url, keys, call.job_ids)))
        print(
            f"    {case} round {r + 1}: "
            + ", ".join(
                f"{s} {REQUESTS * size.tokens / out.times[s][-1]:,.0f} tok/s" for s in SIDES
            )
            + f"; worker batches {out.split[-1].pattern} ("
            + "+".join(f"{t * 1000:,.0f}" for t in out.split[-1].batch_s)
            + " ms), other load "
            + "/".join(f"{out.foreign[s][-1]:.2f}" for s in SIDES),
            flush=True,
        )


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
            result.hook_ms = local.hook_ms([names[i % ADAPTERS] for i in range(REQUESTS)])
            samplers = [service.create_sampling_client(model_path=p) for p in paths]
            adapters = [names[i % ADAPTERS] for i in range(REQUESTS)]
            run_case("mixed", result, local, samplers, adapters, meter, args.redis_url, keys)
    return result


# --- main --------------------------------------------------------------------------------------
SIZES = {
    "queue-tinker/tiny-llama": Size("queue-tinker/tiny-llama", 64, 10, 40),
    "queue-tinker/llama-100m": Size("queue-tinker/llama-100m", 32, 5, 150),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.parser("bench.sampling", __doc__)
    cli.add_services(parser)
    cli.add_models(parser, SIZES, default=SIZES)
    cli.add_torch(parser)
    parser.add_argument("--big-tokens", type=int, default=None, help="max_tokens at 100M")
    cli.add_report(parser, json=False)
    cli.add_quick(parser)
    return cli.parse(parser, argv)


def sizes(args: argparse.Namespace) -> list[Size]:
    chosen = [SIZES[m] for m in args.models]
    if args.big_tokens:
        chosen = [
            Size(s.model, args.big_tokens, s.rounds, s.budget_s) if "100m" in s.model else s
            for s in chosen
        ]
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
            print(
                f"{size.model}: {REQUESTS} requests × {size.tokens} tokens, up to "
                f"{size.rounds} rounds, torch threads {threads}",
                flush=True,
            )
            results.append(measure(args, size, run.database_url, run.data_dir))
    total_s = run.total_s
    print("\n" + "\n".join(table(results) + split_lines(results) + findings(results)))
    print(f"total {total_s:.0f} s")
    section = render(run.info, results, threads, args.threads, total_s, args.device)
    publish(args.docs, args.no_docs, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
