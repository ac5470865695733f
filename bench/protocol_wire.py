"""The SDK 0.38 protocol features that change what goes over the wire, on against off, through
`queue-tinker serve` and the official SDK: zstd bodies, batched sample polling, server-side
custom losses. What each part measures: the `## Protocol features` section of docs/benchmarks.md.

    .venv/bin/python -m bench.protocol_wire            # writes its docs/benchmarks.md section
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import tinker
import zstandard
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.types.forward_backward_request import ForwardBackwardRequest

from bench.big_bodies import tenant
from bench.harness import cli
from bench.harness.gateway import gateway_proc, make_key, requests_by_endpoint
from bench.harness.report import Report, Table, docs_of, emit
from bench.harness.run import Run, service_run
from bench.harness.workers import lora_worker

SECTION = "## Protocol features: zstd bodies, batched sample polling, server-side custom losses"
COMMAND = ".venv/bin/python -m bench.protocol_wire"
MODEL = "queue-tinker/tiny-llama"
VOCAB = 32_000
KNOBS = {
    "--rounds": (20, "posts per mode and shape"),
    "--samples": (64, "samples in flight"),
    "--steps": (8, "custom-loss steps per mode"),
}


@dataclass(frozen=True)
class Shape:
    label: str
    datums: int
    tokens: int
    loss_fn: types.LossFnType


SHAPES = (
    Shape("8 x 128 cross_entropy", 8, 128, "cross_entropy"),
    Shape("64 x 1024 cross_entropy", 64, 1024, "cross_entropy"),
    Shape("64 x 1024 importance_sampling", 64, 1024, "importance_sampling"),
)


def batch(shape: Shape, rng: np.random.Generator) -> list[types.Datum]:
    data = []
    for _ in range(shape.datums):
        tokens = rng.integers(0, VOCAB, shape.tokens + 1)
        inputs: dict[str, Any] = {"target_tokens": tokens[1:].astype(np.int64)}
        if shape.loss_fn == "cross_entropy":
            # 0 over the first quarter (the prompt), 1 after
            inputs["weights"] = (np.arange(shape.tokens) >= shape.tokens // 4).astype(np.float32)
        else:
            inputs["logprobs"] = -rng.exponential(1.0, shape.tokens).astype(np.float32)
            inputs["advantages"] = np.full(shape.tokens, rng.normal(), dtype=np.float32)
        data.append(datum(tokens, inputs))
    return data


def datum(tokens: np.ndarray, inputs: dict[str, Any]) -> types.Datum:
    """The datum of `tokens` but the last, with these loss inputs."""
    model_input = types.ModelInput.from_ints(tokens[:-1].tolist())
    return types.Datum(model_input=model_input, loss_fn_inputs=inputs)


def proto_body(shape: Shape, model_id: str, seq_id: int, data: list[types.Datum]) -> bytes:
    fb = types.ForwardBackwardInput(data=data, loss_fn=shape.loss_fn)
    request = ForwardBackwardRequest(forward_backward_input=fb, model_id=model_id, seq_id=seq_id)
    return forward_backward_request_to_proto(request).SerializeToString()


@dataclass
class WireResult:
    shape: Shape
    plain_bytes: int
    zstd_bytes: int
    plain_ms: list[float]
    zstd_ms: list[float]
    compress_ms: list[float]


def wire_run(url: str, key: str, shape: Shape, rounds: int) -> WireResult:
    """Its ops only queue: no worker serves the run's base model."""
    model_id = tenant(url, key, "bench-no-worker", lora_config={"rank": 32})
    data = batch(shape, np.random.default_rng(0))
    result = WireResult(shape, 0, 0, [], [], [])
    headers = {"X-API-Key": key, "Content-Type": "application/x-protobuf"}
    with httpx.Client(timeout=60) as client:
        for seq_id in range(1, 2 * rounds + 1):
            compress = seq_id % 2 == 0  # alternate, so drift hits both alike
            body = proto_body(shape, model_id, seq_id, data)
            began = time.perf_counter()
            sent = zstandard.ZstdCompressor().compress(body) if compress else body
            packed = time.perf_counter()
            answer = client.post(
                f"{url}/api/v1/forward_backward",
                content=sent,
                headers={**headers, **({"Content-Encoding": "zstd"} if compress else {})},
            )
            took_ms = (time.perf_counter() - began) * 1e3
            answer.raise_for_status()
            if compress:
                result.zstd_bytes = len(sent)
                result.zstd_ms.append(took_ms)
                result.compress_ms.append((packed - began) * 1e3)
            else:
                result.plain_bytes = len(sent)
                result.plain_ms.append(took_ms)
    return result


@dataclass
class PollResult:
    mode: str
    samples: int
    requests: dict[str, int]
    wall_s: float


def poll_run(url: str, key: str, log_path: Path, samples: int, batched: bool) -> PollResult:
    """`samples` samples in flight through one SamplingClient; the gateway's requests."""
    with tinker.ServiceClient(base_url=url, api_key=key) as service:
        sampler = service.create_sampling_client(base_model=MODEL).result()
        holder = sampler.holder
        if not batched:  # as a gateway without retrieve_futures would configure the SDK
            holder._client_config = holder._client_config.model_copy(
                update={"sample_use_retrieve_futures": False}
            )
        params = types.SamplingParams(max_tokens=8, temperature=1.0)
        sampler.sample(types.ModelInput.from_ints([3, 4, 5]), 1, params).result(timeout=300)
        before = requests_by_endpoint(log_path.read_text())
        began = time.perf_counter()
        futures = [
            sampler.sample(types.ModelInput.from_ints([3 + i % 50, 4, 5]), 1, params)
            for i in range(samples)
        ]
        for future in futures:
            future.result(timeout=600)
        wall_s = time.perf_counter() - began
        time.sleep(1.0)  # the last access-log lines
    after = requests_by_endpoint(log_path.read_text())
    counts = {  # the requests since `before`, by endpoint without the status
        name.rsplit(" ", 1)[0]: n
        for name, n in (after - before).items()
        if "sample" in name or "future" in name
    }
    return PollResult("retrieve_futures on" if batched else "off", samples, counts, wall_s)


def clipped_policy(logprobs: Any, old_logprobs: Any, advantages: Any) -> Any:
    import torch

    ratio = torch.exp(logprobs - old_logprobs)
    loss = -torch.minimum(ratio * advantages, torch.clamp(ratio, 0.8, 1.2) * advantages).sum()
    return loss, {"custom/ratio:mean": ratio.mean()}


@dataclass
class CustomLossResult:
    model: str
    shape: str
    server_s: list[float]
    client_s: list[float]


def custom_loss_run(
    url: str, key: str, model: str, datums: int, tokens: int, steps: int
) -> CustomLossResult:
    rng = np.random.default_rng(1)
    tensor = types.TensorData.from_numpy
    data = []
    for _ in range(datums):
        ids = rng.integers(3, 250, tokens + 1)
        inputs = {
            "target_tokens": tensor(ids[1:].astype(np.int64)),
            "old_logprobs": tensor(-rng.uniform(4, 7, tokens).astype(np.float32)),
            "advantages": tensor(rng.normal(size=tokens).astype(np.float32)),
        }
        data.append(datum(ids, inputs))
    with tinker.ServiceClient(base_url=url, api_key=key) as service:
        handle = service.create_custom_loss(
            clipped_policy, {"logprobs": 1, "old_logprobs": 1, "advantages": 1}
        ).result()
        client_handle = dataclasses.replace(handle, loss_id=None)
        runs = [
            service.create_lora_training_client(base_model=model, rank=32, seed=0).result()
            for _ in range(2)
        ]
        result = CustomLossResult(model, f"{datums} x {tokens}", [], [])
        for step in range(steps + 1):  # the first round warms up
            # server-side then client-side, one step each: drift hits both alike
            times_of = (result.server_s, result.client_s)
            for run, loss, times in zip(runs, (handle, client_handle), times_of, strict=True):
                began = time.perf_counter()
                run.forward_backward_custom(data, loss).result(timeout=600)
                if step:
                    times.append(time.perf_counter() - began)
    return result


# --- the report --------------------------------------------------------------------------------
def report(
    args: argparse.Namespace,
    run: Run,
    wire: list[WireResult],
    polls: list[PollResult],
    custom: list[CustomLossResult],
) -> Report:
    """A table per feature: bytes and round trips, requests per sample, custom-loss steps/s."""
    median = statistics.median
    zstd = Table(
        ("shape", "bytes, plain", "bytes, zstd", "ratio", "round trip p50 ms, plain",
         "round trip p50 ms, zstd (of which compress)", "break-even link, Mbit/s"),
        [(r.shape.label, f"{r.plain_bytes:,}", f"{r.zstd_bytes:,}",
          f"{r.plain_bytes / r.zstd_bytes:.1f}x", f"{median(r.plain_ms):.1f}",
          f"{median(r.zstd_ms):.1f} ({median(r.compress_ms):.1f})", f"{break_even_mbit_s(r):,.0f}")
         for r in wire],
        f"zstd forward_backward bodies ({args.rounds} posts per mode and shape, alternating; "
        "loopback)",
    )  # fmt: skip
    polling = Table(
        ("polling", "samples in flight", "HTTP requests by endpoint", "requests per sample",
         "wall s"),
        [(r.mode, r.samples, ", ".join(f"`{k}` {v}" for k, v in sorted(r.requests.items())),
          f"{sum(r.requests.values()) / r.samples:.2f}", f"{r.wall_s:.1f}")
         for r in polls],
        f"Batched sample polling ({MODEL}, one LoRA worker, max_tokens 8)",
    )  # fmt: skip
    steps = [(r, 1 / median(r.server_s), 1 / median(r.client_s)) for r in custom]
    losses = Table(
        ("model", "batch", "server-side steps/s", "client-side steps/s", "ratio"),
        [(f"`{r.model}`", r.shape, f"{server:.2f}", f"{client:.2f}", f"{server / client:.2f}x")
         for r, server, client in steps],
        f"Server-side custom losses (`forward_backward_custom`, {args.steps} steps each, median)",
    )  # fmt: skip
    facts = [
        f"The run took {run.total_s:.0f} s; gateway, worker, Redis and Postgres share the cores."
    ]
    raw = {"wire": list(map(asdict, wire)), "polling": list(map(asdict, polls))}
    raw["custom_loss"] = list(map(asdict, custom))
    return Report(SECTION, COMMAND, run.info, facts, (), [zstd, polling, losses], raw)


def break_even_mbit_s(r: WireResult) -> float:
    """The link speed at which sending the bytes zstd saves takes as long as compressing."""
    saved_bits = (r.plain_bytes - r.zstd_bytes) * 8
    return saved_bits / (statistics.median(r.compress_ms) / 1e3) / 1e6


def main(argv: Sequence[str] | None = None) -> int:
    """The three parts against one gateway and worker; hand back the report."""
    parser = cli.parser("bench.protocol_wire", __doc__, knobs=KNOBS, services=True)
    parser.add_argument("--big-model", default="queue-tinker/llama-100m")
    quick = {"rounds": 2, "samples": 4, "steps": 1, "big_model": None}
    args = cli.parse(parser, argv, quick=quick)
    with (
        service_run(args, ("tinker", "zstandard"), "qt-bench-wire-") as run,
        # The wire runs create models on a base no worker serves, so their ops only queue.
        run.deployment("wire", queue_unserved_base_models=True) as settings,
        lora_worker(settings, MODEL, run.data_dir / "worker.log"),
        gateway_proc(settings, run.data_dir / "gateway.log") as (_, url),
    ):
        key = make_key(settings, f"bench-{uuid.uuid4().hex[:6]}")
        wire = [wire_run(url, key, shape, args.rounds) for shape in SHAPES]
        print("zstd bodies: done", flush=True)
        log_path = run.data_dir / "gateway.log"
        polls = [poll_run(url, key, log_path, args.samples, batched) for batched in (False, True)]
        print("sample polling: done", flush=True)
        custom = [custom_loss_run(url, key, MODEL, 8, 64, args.steps)]
        if args.big_model:
            with lora_worker(settings, args.big_model, run.data_dir / "worker-big.log"):
                custom.append(custom_loss_run(url, key, args.big_model, 4, 128, args.steps))
    emit(report(args, run, wire, polls, custom), docs_of(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
