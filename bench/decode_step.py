"""The worker's decode loop in process on each QT_DECODE_STEP (padded, slots, graphs) against the
memory floor and `generate()`; the method is `## Decode step: ...` of docs/benchmarks.md."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import torch

from bench.harness import cli
from bench.harness.baselines import generate, left_padded
from bench.harness.data import sampling_params
from bench.harness.engine import set_lora_matmuls
from bench.harness.kernel_count import Counts, Moved, count_kernels
from bench.harness.machine import announce, engine_machine
from bench.harness.meters import synchronize, timed
from bench.harness.models import BASE_NAME, Shape, add_adapters, build_model, lora_pool
from bench.harness.report import Report, Table, docs_of, emit
from bench.mfu import SHAPES
from queue_tinker.types.requests.training import LoraConfig
from queue_tinker.workers.model.adapters import AdapterPool
from queue_tinker.workers.model.lora.row_blocks import lora_layers_of
from queue_tinker.workers.sampling.decode_loop import DecodeLoop, Finished, GenerationRequest
from queue_tinker.workers.sampling.slot_decode import DecodeStep, decode_step_of

SECTION = "## Decode step: slots and CUDA graphs against the memory floor"
COUNT_SECTION = "## Kernels of a decode step, counted without a GPU"
COMMAND = ".venv/bin/python -m bench.decode_step"
# --count: the step the sampling issue's targets are set at (64 rows, 1,280 tokens filled).
COUNT_ROWS, COUNT_FILLED = 64, 1280
# The captured step first: on a GPU it is the figure that matters, and a run cut short by its
# time limit should have it; then the default (padded), then the eager slots.
KINDS = ("graphs", "padded", "slots")
KNOBS = {
    "--rows": (0, "requests in flight at once (default 64 on CUDA, 8 on the CPU)"),
    "--prompt": (0, "prompt tokens each (default 1024 on CUDA, 64 on the CPU)"),
    "--new": (0, "new tokens each (default 256 on CUDA, 32 on the CPU)"),
    "--adapters": (8, "adapters the mixed rows are spread over"),
    "--first-prompt": (512, "tokens of a request whose first token is timed"),
    "--joiners": (5, "such requests, one at a time"),
    "--rank": (32, "LoRA rank"),
}
# New tokens of an eager step kind's warm-up pass.
WARM_TOKENS = 16
# New tokens of the requests whose full-batch step the profiler counts (slots, CUDA).
PROFILED_TOKENS = 4
Prompts = list[list[int]]
Requests = list[GenerationRequest]
Info = dict[str, str]  # what a report's machine line says
Mix = tuple[str, Sequence[str | None]]  # "base" or "N adapters", the rows' adapters in turn
Step = Callable[[], Finished]  # one step of the loop on the model, as the worker runs it


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
    # The kernels one full-batch step launched on the device, by the profiler (eager slots on
    # CUDA): the card's check of what --count counts on meta tensors.
    device_kernels: int | None = None

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms)


def prompts(count: int, length: int, vocab: int, seed: int) -> Prompts:
    draws = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=draws).tolist()


def requests(batch: Prompts, new: int, adapters: Sequence[str | None], seed: int = 0) -> Requests:
    """Exactly `new` tokens from each prompt (temperature 1, `seed` + its row the seed, no stop),
    the rows spread over `adapters` in turn."""
    return [  # prompt, num_samples, params, max_tokens, prompt_logprobs, adapter
        GenerationRequest(
            p, 1, sampling_params(seed + row, new), new, False, adapters[row % len(adapters)]
        )
        for row, p in enumerate(batch)
    ]


def run_pass(loop: DecodeLoop, step: Step, batch: Requests) -> tuple[list[float], float]:
    """The requests through the loop: each full-batch decode step's ms, and the pass's seconds."""
    for index, request in enumerate(batch):
        loop.add(index, request)
    steps: list[float] = []
    synchronize(loop.device)
    began = time.perf_counter()
    while loop.busy:
        full = loop.rows == len(batch)
        start = time.perf_counter()
        step()  # ends in a copy to the host: the device is done
        if full and loop.rows == len(batch):
            steps.append((time.perf_counter() - start) * 1e3)
    return steps, time.perf_counter() - began


def first_token_times(
    loop: DecodeLoop, step: Step, background: Requests, joiners: Prompts
) -> list[float]:
    """With the background requests decoding, each joiner (one new token) added at a step's
    boundary: ms from its add() to the end of the step that hands back its token (a decode
    step of the running rows, then its prefill)."""
    for index, request in enumerate(background):
        loop.add(("background", index), request)
    while loop.rows < len(background):
        step()
    times = []
    for index, prompt in enumerate(joiners):
        key = ("joiner", index)
        start = time.perf_counter()
        loop.add(key, requests([prompt], 1, [None])[0])
        while key not in dict(step()):
            pass
        times.append((time.perf_counter() - start) * 1e3)
    loop.cancel({("background", index) for index in range(len(background))})
    return times


def device_kernels(loop: DecodeLoop, step: Step, batch: Requests) -> int | None:
    """The kernels (and device copies) one full-batch step launches, counted by torch's
    profiler on CUDA (None elsewhere): every request admitted first, then one step profiled,
    then the rest run out."""
    if loop.device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for index, request in enumerate(batch):
        loop.add(("profiled", index), request)
    while loop.rows < len(batch):
        step()
    with profile(activities=[ProfilerActivity.CUDA]) as profiled:
        step()
        synchronize(loop.device)
    while loop.busy:
        step()
    return sum(1 for event in profiled.events() if event.device_type == DeviceType.CUDA)


def replay_alone_ms(loop: DecodeLoop, reps: int = 20) -> float | None:
    """The widest graph the loop captured, replayed `reps` times back to back: ms a replay
    (it writes the same columns each time)."""
    if loop.slots is None or not loop.slots.graphs:
        return None
    graph, _ = loop.slots.graphs[max(loop.slots.graphs)]
    with torch.inference_mode():  # as the loop replays it
        graph.replay()
        synchronize(loop.device)
        began = time.perf_counter()
        for _ in range(reps):
            graph.replay()
        synchronize(loop.device)
    return (time.perf_counter() - began) / reps * 1e3


def copy_rate(device: torch.device) -> float:
    """Bytes per second a large on-device copy moves (read and write counted)."""
    size = (1 << 30) if device.type == "cuda" else (1 << 27)
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    return 2 * 5 * size / timed(lambda: [target.copy_(source) for _ in range(5)], device)


def floor_bytes(
    model: torch.nn.Module, shape: Shape, rows: int, context: int, lora_bytes: int
) -> int:
    """The bytes a decode step must read: the linears' weights (the embedding is gathered,
    not read), LoRA's A and B, each row's keys and values."""
    weights = sum(
        module.weight.nbytes
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and ".lora_" not in name
    )
    itemsize = next(model.parameters()).element_size()
    kv = rows * context * shape.layers * 2 * shape.kv_heads * shape.head_dim * itemsize
    return weights + lora_bytes + kv


def floor_ms(
    model: torch.nn.Module, shape: Shape, rows: int, context: int, lora_bytes: int, rate: float
) -> float:
    """floor_bytes over the copy rate."""
    return floor_bytes(model, shape, rows, context, lora_bytes) / rate * 1e3


def measure(args: argparse.Namespace) -> tuple[list[Measured], dict[str, float]]:
    """Every step kind on the base model and on the adapters, then generate() and the floor."""
    device = torch.device(args.device)
    shape = SHAPES[args.shape]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base = build_model(shape, args.device, dtype)
    pool = lora_pool(base, BASE_NAME, args.adapters)
    adapters = add_adapters(pool, LoraConfig(rank=args.rank), range(args.adapters))
    lora = {k: p for k, p in pool.model.named_parameters() if ".lora_" in k}
    with torch.no_grad():  # B is zero when added: draw it, so every update counts
        for param in (p for k, p in lora.items() if ".lora_B." in k):
            param.normal_(std=0.02)
    lora_bytes = sum(p.numel() * (pool.lora_compute or p.dtype).itemsize for p in lora.values())
    mixes = (("base", [None]), (f"{args.adapters} adapters", [a.name for a in adapters]))
    kinds = [kind for kind in args.kinds if kind != "graphs" or device.type == "cuda"]
    results = [one_kind(args, pool, kind, mix) for kind in kinds for mix in mixes]
    ids, mask = left_padded(prompts(args.rows, args.prompt, shape.vocab, 2), device)
    with pool.model.disable_adapter():  # type: ignore[operator]
        generate(pool.model, ids, mask, args.new)  # warm-up
        seconds = timed(lambda: generate(pool.model, ids, mask, args.new), device)
    baseline = args.rows * args.new / seconds
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


def one_kind(args: argparse.Namespace, pool: AdapterPool, kind: DecodeStep, mix: Mix) -> Measured:
    """One step kind on one adapter mix: a warm-up pass on the first prompts, a timed pass on the
    second (generate()'s); on the base model, then a joiner's first token."""
    (name, adapters), device, vocab = mix, torch.device(args.device), SHAPES[args.shape].vocab
    warm_prompts, timed_prompts = (prompts(args.rows, args.prompt, vocab, seed) for seed in (1, 2))
    mode = decode_step_of(kind, device, grouped=False)
    loop = DecodeLoop(device, [], lambda t: "", max_rows=None, slots=mode.slots, graphs=mode.graphs)
    step = partial(loop.step, pool.model, lora_layers_of(pool.model), pool.lora_compute)
    # Graphs warm up on the whole pass (every bucket the timed one meets is captured); an eager
    # step needs its kernels and allocations warm only.
    warm_new = args.new if mode.graphs else min(args.new, WARM_TOKENS)
    run_pass(loop, step, requests(warm_prompts, warm_new, adapters))
    steps, seconds = run_pass(loop, step, requests(timed_prompts, args.new, adapters))
    captured = loop.slots.captured if loop.slots is not None else 0
    measured = Measured(kind, name, steps, args.rows * args.new / seconds, captured)
    measured.replay_ms = replay_alone_ms(loop)
    if kind == "slots":  # eager: the profiler sees each kernel a graph would replay
        few = requests(warm_prompts, PROFILED_TOKENS, adapters)
        measured.device_kernels = device_kernels(loop, step, few)
    first = ""
    if name == "base":  # the rows but one decoding, a joiner's first token
        background = requests(warm_prompts[1:], args.new, adapters)
        joiners = prompts(args.joiners, args.first_prompt, vocab, 3)
        measured.first_token_ms = first_token_times(loop, step, background, joiners)
        first = f", first token p50 {statistics.median(measured.first_token_ms):.1f} ms"
    profiled = f", {measured.device_kernels:,} kernels a step" if measured.device_kernels else ""
    print(
        f"{kind} {name}: step {measured.median_ms:.2f} ms, {measured.tokens_per_s:,.0f} tok/s, "
        f"graphs {captured}{first}{profiled}",
        flush=True,
    )
    return measured


COLUMNS = (
    "step", "rows on", "decode step, ms (median)", "memory floor, ms", "step ÷ floor",
    "÷ the base model's step", "tokens/s (prefill included)", "÷ generate()",
    "first token, ms (p50)", "widest graph replayed alone, ms", "graphs captured",
    "kernels a step (profiler)",
)  # fmt: skip


def report(
    results: list[Measured], figures: dict[str, float], info: Info, args: argparse.Namespace
) -> Report:
    """Each step kind's median step against the floor, the base model's step and generate()."""
    base_ms = {r.kind: r.median_ms for r in results if r.mix == "base"}
    rows = [
        (r.kind, r.mix, f"{r.median_ms:,.2f}", f"{floor:,.2f}", f"**{r.median_ms / floor:.2f}×**",
         f"{r.median_ms / base_ms[r.kind]:.2f}×", f"{r.tokens_per_s:,.0f}",
         f"**{r.tokens_per_s / figures['generate_tok_s']:.2f}×**",
         f"{statistics.median(r.first_token_ms):,.1f}" if r.first_token_ms else "",
         f"{r.replay_ms:,.2f}" if r.replay_ms is not None else "", r.captured,
         f"{r.device_kernels:,}" if r.device_kernels is not None else "")
        for r in results
        for floor in (figures["floor_base_ms" if r.mix == "base" else "floor_adapters_ms"],)
    ]  # fmt: skip
    dtype = "bf16" if args.device.startswith("cuda") else "fp32"
    facts = [
        f"A {args.shape}-shaped Llama of random weights ({dtype}): {args.rows} requests of "
        f"{args.prompt} tokens sampling {args.new} new tokens each, on the base model and over "
        f"{args.adapters} rank-{args.rank} adapters; first token: {args.joiners} requests of "
        f"{args.first_prompt} tokens while {args.rows - 1} rows decode.",
        f"Copy rate {figures['copy_gb_s']:,.0f} GB/s (read and write counted); `generate()` on "
        f"the base model {figures['generate_tok_s']:,.0f} tokens/s.",
    ]
    command = f"{COMMAND} --device {args.device}"
    raw = {"steps": [asdict(r) for r in results], **figures}
    return Report(SECTION, command, info, facts, (), [Table(COLUMNS, rows)], raw)


# --- counting ----------------------------------------------------------------------------------
def counted_step(
    pool: AdapterPool,
    shape_name: str,
    kind: DecodeStep,
    adapters: Sequence[str | None],
    fused: bool = True,
) -> Counts:
    """One decode step of COUNT_ROWS rows with COUNT_FILLED tokens each in the cache once it
    runs, every row admitted first (their prefill uncounted), on meta tensors; on slots in the
    family's fused step if `fused`, else in transformers' layers."""
    meta, vocab = torch.device("meta"), SHAPES[shape_name].vocab
    mode = decode_step_of(kind, torch.device("cuda"), grouped=False)  # as a CUDA worker's
    # Every prompt prefilled in the first step (no prefill cap): a cap would chunk them.
    loop = DecodeLoop(
        meta, [], lambda t: "", max_rows=None, prefill_tokens=None, slots=mode.slots,
        graphs=False, fused=fused,
    )  # fmt: skip
    step = partial(loop.step, pool.model, lora_layers_of(pool.model), pool.lora_compute)
    batch = requests(prompts(COUNT_ROWS, COUNT_FILLED - 1, vocab, 1), 8, adapters)
    for index, request in enumerate(batch):
        loop.add(index, request)
    count_kernels(step)  # the prefill (a step on meta tensors needs the counter's answers)
    if loop.rows != COUNT_ROWS:
        raise RuntimeError(f"{loop.rows} of {COUNT_ROWS} rows admitted")
    used = len({name for name in adapters if name is not None})
    return count_kernels(step, kernel_bytes(COUNT_FILLED, used))


def kernel_bytes(filled: int, adapters: int) -> Moved:
    """What the step's kernels read and write where their arguments say more, from what the
    host knows: the embedding gathers the rows' rows of its table; the KV write writes each
    row's one column; attention reads each row's `filled` columns (the first GPU row checks
    this against the profiler); a LoRA kernel reads the slots of the `adapters` the rows use."""

    def size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def embedding(args: tuple[Any, ...], out: Any) -> int:
        return 2 * size(out) + size(args[1])

    def kv_write(args: tuple[Any, ...], out: Any) -> int:
        qkv, positions, keys = args[0], args[1], args[6]
        column = qkv.shape[0] * keys.shape[2] * keys.shape[3] * keys.element_size()
        return size(qkv) + size(out) + size(positions) + 2 * column

    def attention(args: tuple[Any, ...], out: Any) -> int:
        q, keys, table, lengths = args[0], args[1], args[3], args[4]
        read = q.shape[0] * filled * keys.shape[2] * keys.shape[3] * keys.element_size()
        outs = out if isinstance(out, tuple) else (out,)
        return size(q) + sum(size(o) for o in outs) + 2 * read + size(table) + size(lengths)

    def shrink(args: tuple[Any, ...], out: Any) -> int:
        x, a, slots = args[:3]
        return size(x) + size(out) + size(slots) + min(adapters, a.shape[0]) * size(a[0])

    def expand(args: tuple[Any, ...], out: Any) -> int:
        y, low, b, slots = args[:4]
        return 2 * size(y) + size(low) + size(slots) + min(adapters, b.shape[0]) * size(b[0])

    return {
        "embedding": embedding, "rope_kv_write": kv_write, "paged_attention": attention,
        "paged_attention_parts": attention, "lora_shrink": shrink, "lora_expand_": expand,
    }  # fmt: skip


# The step kinds counted: (name, QT_DECODE_STEP, the family's fused step).
COUNTED = (
    ("padded", "padded", False),
    ("slots, transformers' layers", "slots", False),
    ("slots, fused", "slots", True),
)


def counted(args: argparse.Namespace) -> Report:
    """--count: the kernels and bytes of one decode step at the shape, on meta tensors
    (bench/harness/kernel_count.py), on the base model and over the adapters, padded and on
    slots (eager: a captured step replays the same kernels), bf16 as on a CUDA worker."""
    shape = SHAPES[args.shape]
    pool = lora_pool(build_model(shape, "meta", torch.bfloat16), BASE_NAME, args.adapters)
    set_lora_matmuls(pool, "auto")  # as QT_LORA_MATMUL_DTYPE's default makes it: bf16 here
    with torch.device("meta"):  # PEFT leaves a new adapter's weights beside a meta base
        adapters = add_adapters(pool, LoraConfig(rank=args.rank), range(args.adapters))
    lora = [p for k, p in pool.model.named_parameters() if ".lora_" in k]
    lora_bytes = sum(p.numel() * (pool.lora_compute or p.dtype).itemsize for p in lora)
    mixes: list[tuple[str, Sequence[str | None], int]] = [  # name, rows' adapters, LoRA read
        ("base", [None], 0),
        (f"{args.adapters} adapters", [a.name for a in adapters], lora_bytes),
    ]
    rows, totals = [], {}
    for label, kind, fused in COUNTED:
        for name, names, read in mixes:
            got = totals[label, name] = counted_step(pool, args.shape, kind, names, fused)  # type: ignore[arg-type]
            floor = floor_bytes(pool.base, shape, COUNT_ROWS, COUNT_FILLED, read)
            rows.append((
                label, name, f"{got.total:,}", f"{got.total / totals[label, 'base'].total:.2f}×",
                got.host_reads, f"{got.bytes_moved / 2**30:,.1f}", f"{floor / 2**30:,.1f}",
                f"**{got.bytes_moved / floor:.2f}×**",
                ", ".join(f"{k} {v:,}" for k, v in got.kernels.most_common(4)),
            ))  # fmt: skip
            print(f"{label} {name}: {got.total:,} kernels", flush=True)
    columns = (
        "step", "rows on", "kernels", "÷ the base model's", "host reads", "GiB read + written",
        "floor, GiB", "÷ floor", "most launched",
    )  # fmt: skip
    caption = (
        f"One decode step at the {args.shape} shape, bf16, {COUNT_ROWS} rows of "
        f"{COUNT_FILLED:,} tokens in the cache, the adapters rank {args.rank}, counted on meta "
        "tensors:"
    )
    facts = [
        "No GPU: a count, not a timing; transformers' attention counted as one fused kernel "
        "over the columns it reads, the fused step's over each row's filled columns, its LoRA "
        "kernels over the slots the rows use, the embedding over the rows it gathers "
        "(kernel_bytes); the floor is the linears' weights, the filled KV and the LoRA of the "
        "adapters the rows use (floor_bytes)."
    ]
    body: list[Table | str] = [Table(columns, rows, caption=caption)]
    command = f"{COMMAND} --count --shape {args.shape}"
    return Report(COUNT_SECTION, command, engine_machine("cpu"), facts, (), body, {})


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser("bench.decode_step", __doc__, knobs=KNOBS)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=list(SHAPES), default=None)
    parser.add_argument(
        "--count",
        action="store_true",
        help="count the kernels and bytes of one step on meta tensors (no GPU; 8B by default)",
    )
    parser.add_argument(
        "--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="in order; graphs: CUDA only"
    )
    quick = {"rows": 4, "prompt": 16, "new": 8, "adapters": 2, "first_prompt": 32, "joiners": 2}
    args = cli.parse(parser, argv, quick)
    cuda = args.device.startswith("cuda")
    args.shape = args.shape or ("llama-3.1-8b" if cuda or args.count else "small")
    args.rows = args.rows or (64 if cuda else 8)
    args.prompt = args.prompt or (1024 if cuda else 64)
    args.new = args.new or (256 if cuda else 32)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.count:
        emit(counted(args), docs_of(args), args.json)
        return 0
    info = announce(engine_machine(args.device))
    results, figures = measure(args)
    emit(report(results, figures, info, args), docs_of(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
