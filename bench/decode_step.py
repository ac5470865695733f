"""The sampler's decode step in process: the worker's decode loop (workers/sampling/
decode_loop.py) on each way of running a step (QT_DECODE_STEP: padded, slots, graphs), against
the memory floor and transformers' `generate()` on the same requests, measured in one run.

A Llama of the chosen shape with random weights built on the device (no download: on CUDA the
Llama-3.1-8B shape in bf16), rank-32 LoRA adapters on every linear added through the worker's
`AdapterPool` (their B drawn at random, so the updates are not zero). `rows` requests of
`prompt` random tokens each sample exactly `new` tokens (temperature 1, no stop). Per step kind:

- the median decode step (ms) while every row is in flight, on the base model and with the rows
  spread over `adapters` adapters; a first pass over the requests warms up (graphs: the
  whole pass, capturing every bucket; eager: a few tokens), a second on other prompts of the
  same lengths is timed;
- tokens/s of that second pass, prefill included, against `generate()` on the same prompts;
- the memory floor of a step: the bytes it must read (every linear's weights, the adapters'
  A and B, each row's keys and values at the median context) over the device's copy rate
  (a large on-device copy, reads and writes counted).

    .venv/bin/python -m bench.decode_step --device cuda      # the 8B shape, 64 x 1k + 256
    .venv/bin/python -m bench.decode_step --quick            # CPU smoke run, docs left alone
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from bench.harness import cli
from bench.harness.baselines import generate, left_padded
from bench.harness.machine import announce, device_name, engine_machine
from bench.harness.meters import synchronize
from bench.harness.models import Shape, add_adapters, build_model, lora_pool
from bench.harness.report import machine_line, publish, reproduce, table
from bench.mfu import SHAPES
from queue_tinker.types.requests.sampling import SamplingParams
from queue_tinker.types.requests.training import LoraConfig
from queue_tinker.workers.model.row_blocks import lora_layers_of
from queue_tinker.workers.sampling.decode_loop import DecodeLoop, GenerationRequest
from queue_tinker.workers.sampling.slot_decode import decode_step_of

SECTION = "## Decode step: slots and CUDA graphs against the memory floor"
COMMAND = ".venv/bin/python -m bench.decode_step --device cuda"
# The captured step first: on a GPU it is the figure that matters, and a run cut short by its
# time limit should have it; then the default (padded), then the eager slots.
KINDS = ("graphs", "padded", "slots")
# New tokens of an eager step kind's warm-up pass.
WARM_TOKENS = 16


@dataclass
class Measured:
    """One step kind on one adapter mix."""

    kind: str
    mix: str  # "base" or "N adapters"
    step_ms: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0
    captured: int = 0
    first_token_ms: list[float] = field(default_factory=list)  # base mix only
    # The widest captured step replayed back to back, no host work between: the device's
    # time of a step, against which the median step shows the host's share (graphs only).
    replay_ms: float | None = None

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms)


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    draws = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=draws).tolist()


def requests(
    batch: list[list[int]], new: int, adapters: Sequence[str | None]
) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            prompt=prompt,
            num_samples=1,
            params=SamplingParams(max_tokens=new, temperature=1.0, seed=row, stop=[]),
            max_tokens=new,
            prompt_logprobs=False,
            adapter=adapters[row % len(adapters)],
        )
        for row, prompt in enumerate(batch)
    ]


def run_pass(
    loop: DecodeLoop,
    model: torch.nn.Module,
    batch: list[GenerationRequest],
    compute: torch.dtype | None,
    device: torch.device,
) -> tuple[list[float], float]:
    """The requests through the loop: each full-batch decode step's time (ms), and the pass's
    wall time (s)."""
    layers = lora_layers_of(model)
    for index, request in enumerate(batch):
        loop.add(index, request)
    steps: list[float] = []
    synchronize(device)
    began = time.perf_counter()
    while loop.busy:
        full = loop.rows == len(batch)
        start = time.perf_counter()
        loop.step(model, layers, compute)  # ends in a copy to the host: the device is done
        if full and loop.rows == len(batch):
            steps.append((time.perf_counter() - start) * 1e3)
    return steps, time.perf_counter() - began


def first_token_times(
    loop: DecodeLoop,
    model: torch.nn.Module,
    background: list[GenerationRequest],
    joiners: list[list[int]],
    compute: torch.dtype | None,
) -> list[float]:
    """With the background requests decoding, each joiner (one new token) added at a step's
    boundary: ms from its add() to the end of the step that hands back its token (a decode
    step of the running rows, then its prefill)."""
    layers = lora_layers_of(model)
    for index, request in enumerate(background):
        loop.add(("background", index), request)
    while loop.rows < len(background):
        loop.step(model, layers, compute)
    times = []
    for index, prompt in enumerate(joiners):
        key = ("joiner", index)
        start = time.perf_counter()
        loop.add(key, requests([prompt], 1, [None])[0])
        while key not in dict(loop.step(model, layers, compute)):
            pass
        times.append((time.perf_counter() - start) * 1e3)
    loop.cancel({("background", index) for index in range(len(background))})
    return times


def replay_alone_ms(loop: DecodeLoop, device: torch.device, reps: int = 20) -> float | None:
    """The widest graph the loop captured, replayed `reps` times back to back: ms a replay
    (it writes the same columns each time)."""
    if loop.slots is None or not loop.slots.graphs:
        return None
    graph, _ = loop.slots.graphs[max(loop.slots.graphs)]
    with torch.inference_mode():  # as the loop replays it
        graph.replay()
        synchronize(device)
        began = time.perf_counter()
        for _ in range(reps):
            graph.replay()
        synchronize(device)
    return (time.perf_counter() - began) / reps * 1e3


def copy_rate(device: torch.device) -> float:
    """Bytes per second a large on-device copy moves (read and write counted)."""
    size = (1 << 30) if device.type == "cuda" else (1 << 27)
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    synchronize(device)
    began = time.perf_counter()
    for _ in range(5):
        target.copy_(source)
    synchronize(device)
    return 2 * 5 * size / (time.perf_counter() - began)


def floor_ms(
    model: torch.nn.Module, shape: Shape, rows: int, context: int, lora_bytes: int, rate: float
) -> float:
    """The bytes a decode step must read, over the copy rate: the linears' weights (the
    embedding is gathered, not read), LoRA's A and B, each row's keys and values."""
    weights = sum(
        module.weight.nbytes
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and ".lora_" not in name
    )
    itemsize = next(model.parameters()).element_size()
    kv = rows * context * shape.layers * 2 * shape.kv_heads * shape.head_dim * itemsize
    return (weights + lora_bytes + kv) / rate * 1e3


def measure(args: argparse.Namespace) -> tuple[list[Measured], dict[str, float]]:
    device = torch.device(args.device)
    shape = SHAPES[args.shape]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base = build_model(shape, args.device, dtype)
    pool = lora_pool(base, "bench", args.adapters)
    names = [
        a.model_id for a in add_adapters(pool, LoraConfig(rank=args.rank), range(args.adapters))
    ]
    with torch.no_grad():  # B is zero when added: draw it, so every update counts
        for key, param in pool.model.named_parameters():
            if ".lora_B." in key:
                param.normal_(std=0.02)
    compute = pool.lora_compute
    lora_bytes = sum(
        p.numel() * (compute or p.dtype).itemsize
        for k, p in pool.model.named_parameters()
        if ".lora_" in k
    )
    warm_prompts = prompts(args.rows, args.prompt, shape.vocab, 1)
    timed_prompts = prompts(args.rows, args.prompt, shape.vocab, 2)
    results: list[Measured] = []
    kinds = [k for k in args.kinds if k != "graphs" or device.type == "cuda"]
    for kind in kinds:
        step = decode_step_of(kind, device, grouped=False)
        for mix, adapters in (("base", [None]), (f"{args.adapters} adapters", names)):
            loop = DecodeLoop(
                device, [], lambda t: "", max_rows=None, slots=step.slots, graphs=step.graphs
            )
            # Graphs warm up on the whole pass (every bucket the timed one meets is captured);
            # an eager step needs its kernels and allocations warm only.
            warm_new = args.new if step.graphs else min(args.new, WARM_TOKENS)
            run_pass(loop, pool.model, requests(warm_prompts, warm_new, adapters), compute, device)
            steps, seconds = run_pass(
                loop, pool.model, requests(timed_prompts, args.new, adapters), compute, device
            )
            captured = loop.slots.captured if loop.slots is not None else 0
            measured = Measured(kind, mix, steps, args.rows * args.new / seconds, captured)
            measured.replay_ms = replay_alone_ms(loop, device)
            if mix == "base":  # the rows but one decoding, a joiner's first token
                background = requests(warm_prompts[1:], args.new, adapters)
                joiners = prompts(args.joiners, args.first_prompt, shape.vocab, 3)
                measured.first_token_ms = first_token_times(
                    loop, pool.model, background, joiners, compute
                )
            results.append(measured)
            first = (
                f"  first token p50 {statistics.median(measured.first_token_ms):.1f} ms"
                if measured.first_token_ms
                else ""
            )
            print(
                f"{kind:7} {mix:11} step {measured.median_ms:8.2f} ms  "
                f"{measured.tokens_per_s:10,.0f} tok/s  graphs {captured}{first}",
                flush=True,
            )
    ids, mask = left_padded(timed_prompts, device)
    with pool.model.disable_adapter():  # type: ignore[operator]
        generate(pool.model, ids, mask, args.new)  # warm-up
        synchronize(device)
        began = time.perf_counter()
        generate(pool.model, ids, mask, args.new)
        synchronize(device)
    baseline = args.rows * args.new / (time.perf_counter() - began)
    rate = copy_rate(device)
    context = args.prompt + args.new // 2
    figures = {
        "generate_tok_s": baseline,
        "copy_gb_s": rate / 1e9,
        "floor_base_ms": floor_ms(base, shape, args.rows, context, 0, rate),
        "floor_adapters_ms": floor_ms(base, shape, args.rows, context, lora_bytes, rate),
    }
    print(f"generate() {baseline:,.0f} tok/s; copy {rate / 1e9:,.0f} GB/s", flush=True)
    return results, figures


def render(
    results: list[Measured],
    figures: dict[str, float],
    info: dict[str, str],
    args: argparse.Namespace,
) -> str:
    base_ms = {r.kind: r.median_ms for r in results if r.mix == "base"}
    rows = []
    for r in results:
        floor = figures["floor_base_ms" if r.mix == "base" else "floor_adapters_ms"]
        rows.append(
            [
                r.kind,
                r.mix,
                f"{r.median_ms:,.2f}",
                f"{floor:,.2f}",
                f"**{r.median_ms / floor:.2f}×**",
                f"{r.median_ms / base_ms[r.kind]:.2f}×",
                f"{r.tokens_per_s:,.0f}",
                f"**{r.tokens_per_s / figures['generate_tok_s']:.2f}×**",
                f"{statistics.median(r.first_token_ms):,.1f}" if r.first_token_ms else "",
                f"{r.replay_ms:,.2f}" if r.replay_ms is not None else "",
                r.captured,
            ]
        )
    columns = [
        "step",
        "rows on",
        "decode step, ms (median)",
        "memory floor, ms",
        "step ÷ floor",
        "÷ the base model's step",
        "tokens/s (prefill included)",
        "÷ generate()",
        "first token, ms (p50)",
        "widest graph replayed alone, ms",
        "graphs captured",
    ]
    return "\n".join(
        [
            SECTION,
            "",
            f"The worker's decode loop in process on a {args.shape}-shaped Llama with random "
            f"weights ({'bf16' if args.device.startswith('cuda') else 'fp32'}), {args.rows} "
            f"requests of {args.prompt} random tokens sampling {args.new} new tokens each "
            f"(temperature 1, no stop), on the base model and spread over {args.adapters} "
            f"rank-{args.rank} adapters on every linear; each way of running a step "
            "(QT_DECODE_STEP) after a warm-up pass on other prompts of the same lengths. "
            "The floor is the bytes a step reads (linears' weights, LoRA's A and B, keys and "
            "values at the median context) over a large on-device copy's rate "
            f"({figures['copy_gb_s']:,.0f} GB/s here, read and write counted); `generate()` is "
            f"transformers' on the same prompts, base model: {figures['generate_tok_s']:,.0f} "
            f"tokens/s. First token: {args.joiners} requests of {args.first_prompt} tokens, "
            f"one at a time, each added at a step's boundary while {args.rows - 1} rows "
            "decode, from add() to the end of the step that hands back its token (in process: "
            "the queue's own round trip is bench.queue_overhead's). For graphs, the widest "
            "captured step replayed back to back, no host work between: the device's time of a "
            "step, so the median step minus it is what the host adds (what overlapping the "
            "host's bookkeeping with the next step could win back).",
            "",
            *reproduce(COMMAND),
            "",
            machine_line(info) + ".",
            "",
            *table(columns, rows),
            "",
        ]
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser("bench.decode_step", __doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=list(SHAPES), default=None)
    cli.add_knobs(
        parser,
        {
            "--rows": (0, "requests in flight at once (default 64 on CUDA, 8 on the CPU)"),
            "--prompt": (0, "prompt tokens each (default 1024 on CUDA, 64 on the CPU)"),
            "--new": (0, "new tokens each (default 256 on CUDA, 32 on the CPU)"),
            "--adapters": (8, "adapters the mixed rows are spread over"),
            "--first-prompt": (512, "tokens of a request whose first token is timed"),
            "--joiners": (5, "such requests, one at a time"),
            "--rank": (32, "LoRA rank"),
        },
    )
    parser.add_argument(
        "--kinds",
        nargs="+",
        choices=KINDS,
        default=list(KINDS),
        help="the steps to measure, in this order (graphs on CUDA only)",
    )
    cli.add_report(parser, json=False)
    cli.add_quick(parser)
    quick = {"rows": 4, "prompt": 16, "new": 8, "adapters": 2, "first_prompt": 32, "joiners": 2}
    args = cli.parse(parser, argv, quick)
    cuda = args.device.startswith("cuda")
    args.shape = args.shape or ("llama-3.1-8b" if cuda else "small")
    args.rows = args.rows or (64 if cuda else 8)
    args.prompt = args.prompt or (1024 if cuda else 64)
    args.new = args.new or (256 if cuda else 32)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    info = announce(engine_machine(args.device))
    print(f"device: {device_name(args.device)}", flush=True)
    results, figures = measure(args)
    section = render(results, figures, info, args)
    print("\n" + section)
    publish(args.docs, args.no_docs, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
