"""Model FLOPs utilisation of LoRA training: training tokens/s and MFU of the engine's own
forward_backward (through bench/harness/engine.py, as a worker runs the op with its defaults)
on a Llama-3.1-8B-shaped model with random bf16 weights (no download), against plain
transformers + PEFT on the same model, adapter and batch. The FLOPs counts (LoRA count
4·N_mm + 6·N_lora + 12·L·d·T, and the 6N convention) and how to read the figures are in the
`## Model FLOPs utilisation` section of docs/benchmarks.md. liger's kernels go into the model
for good, so what needs transformers' own kernels is measured first.

    .venv/bin/python -m bench.mfu --device cuda                  # writes its docs section
    .venv/bin/python -m bench.mfu --device cpu --quick           # scaled-down smoke run
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any

import torch

from bench.harness import cli, engine
from bench.harness.baselines import plain_forward_backward
from bench.harness.data import datums, rl_datums, token_rows
from bench.harness.engine import LoraForm, PassPlan
from bench.harness.kernel_count import Counts, count_kernels
from bench.harness.machine import announce, device_name, engine_machine
from bench.harness.meters import timed, turns
from bench.harness.models import BASE_NAME, Shape, add_adapters, build_model, lora_pool
from bench.harness.report import Report, Table, docs_of, emit, reproduce
from bench.harness.workers import quiet_transformers
from queue_tinker.types.enums import LossFn
from queue_tinker.types.requests.training import AdamParams, LoraConfig
from queue_tinker.types.tensors import Datum
from queue_tinker.workers.model.adapters import Adapter, AdapterPool
from queue_tinker.workers.model.memory import Checkpointing

SECTION = "## Model FLOPs utilisation: LoRA training on a GPU"
COUNT_SECTION = "## Kernels of a training pass, counted without a GPU"
COUNT_ADAPTERS, COUNT_ROWS, COUNT_SEQ = 8, 4, 512  # RL-sized ops, as the rl rows
DEFAULT_SHAPE = "llama-3.1-8b"
HEADLINE = "the worker's plan, its kernels"
COMMAND = ".venv/bin/python -m bench.mfu --device cuda"
# scripts/gpu_checks rl: the RL-sized ops on a model where sharing a pass can pay
RL_COMMAND = f"{COMMAND} --shape llama-3.2-1b --adapters 1 --no-variants --long-seq 0"
NOT_MEASURED = "Not measured here"
# Dense bf16 peaks (no sparsity), TFLOPS; the first name found in the device's name wins.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("A100", 312.0),
)
SHAPES = {
    "llama-3.1-8b": Shape(
        layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256
    ),
    # Where a 2,048-token op is short against the host's launches: the shape on which sharing
    # a pass among several adapters' RL-sized ops can pay (scripts/gpu_checks rl). The real
    # model ties its unembedding to the embedding; here they are apart (the same FLOPs).
    "llama-3.2-1b": Shape(
        layers=16, hidden=2048, heads=32, kv_heads=8, intermediate=8192, vocab=128256
    ),
    # Small enough for a CPU smoke run in seconds; same structure.
    "small": Shape(layers=2, hidden=256, heads=4, kv_heads=2, intermediate=896, vocab=4096),
    # Where a CPU's layer is its GEMMs, not the host's per-op work: what recomputing costs
    # there, in minutes (the variants' rows).
    "cpu-medium": Shape(layers=4, hidden=1024, heads=8, kv_heads=4, intermediate=2816, vocab=4096),
}


# --- counting ----------------------------------------------------------------------------------
def matmul_params(shape: Shape) -> int:
    """Parameters that multiply activations: every layer's linears, and lm_head."""
    per_layer = sum(i * o for name, (i, o) in shape.linears().items() if name != "lm_head")
    return shape.layers * per_layer + shape.hidden * shape.vocab


def total_params(shape: Shape) -> int:
    """Every parameter (untied embeddings): linears, the embedding, the RMSNorm weights."""
    norms = (2 * shape.layers + 1) * shape.hidden
    return matmul_params(shape) + shape.vocab * shape.hidden + norms


def lora_params(shape: Shape, rank: int, targets: Sequence[str]) -> int:
    """rank × (in + out) for every adapted linear."""
    total = 0
    for name, (i, o) in shape.linears().items():
        if name in targets:
            total += rank * (i + o) * (1 if name == "lm_head" else shape.layers)
    return total


def flops_per_token(shape: Shape, seq: int, n_lora: int) -> dict[str, float]:
    """Training FLOPs per token, both ways (see the module's docstring)."""
    attention = 12 * shape.layers * shape.heads * shape.head_dim * seq
    return {
        "lora": 4 * matmul_params(shape) + 6 * n_lora + attention,
        "6N": 6 * total_params(shape),
    }


def peak_tflops(device_name: str) -> float | None:
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in device_name), None)


def random_data(shape: Shape, batch: int, seq: int) -> list[Datum]:
    return datums(token_rows(batch, seq, vocab=shape.vocab))


# --- timing ------------------------------------------------------------------------------------
@dataclass
class Variant:
    """The engine's forward_backward under one pass plan (and around it, `context`)."""

    name: str
    plan: PassPlan
    context: Callable[[], AbstractContextManager[object]] = nullcontext
    fb_s: list[float] = field(default_factory=list)
    first_s: float | None = None  # the first call: kernels' first launch (Triton's JIT)
    peak_gib: float | None = None
    checkpointed: str = ""
    error: str | None = None

    def median_ms(self) -> float:
        return statistics.median(self.fb_s) * 1000


@dataclass
class Result:
    device: str
    shape: str
    batch: int
    seq: int
    rank: int
    params: int
    lora_params: int
    fb_s: list[float] = field(default_factory=list)
    optim_s: list[float] = field(default_factory=list)
    peak_gib: float | None = None
    shrunk_from: int | None = None  # the batch asked for, when it did not fit
    adapters: int = 1  # --adapters
    multi: dict[str, float] = field(default_factory=dict)  # median seconds, both ways
    # Plain transformers + PEFT on the same model, adapter and data (the limit the engine is
    # held to), and whether it needed its own checkpointing to fit.
    bare_fb_s: list[float] = field(default_factory=list)
    bare_checkpointing: bool | None = None
    variants: list[Variant] = field(default_factory=list)
    # Activation bytes a token keeps per decoder layer, measured (a pass with nothing
    # checkpointed) and as the checkpointing plan estimates them.
    layer_bytes: tuple[float, int] | None = None
    layer_bytes_plain: float | None = None  # measured before the worker's kernels went in
    kernels: str = "transformers' own"  # the worker's: what QT_LIGER_KERNELS=auto put in
    long_pass: Variant | None = None  # one row of --long-seq tokens
    rl: dict[str, float] = field(default_factory=dict)  # RL-sized ops: one pass vs apart
    rl_shape: str = ""
    # One ppo op of many short datums: its loss over all their tokens at once, and datum by
    # datum (median seconds each).
    loss_paths: dict[str, float] = field(default_factory=dict)
    loss_paths_shape: str = ""
    # --memory-gib: the card a worker plans for (QT_DEVICE_MEMORY_GIB), and its fit check.
    memory_gib: float | None = None
    fit: str | None = None

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def tokens_per_s(self, with_optim: bool = False) -> float:
        step = statistics.median(self.fb_s)
        if with_optim:
            step += statistics.median(self.optim_s)
        return self.tokens / step

    def bare_tokens_per_s(self) -> float | None:
        return self.tokens / statistics.median(self.bare_fb_s) if self.bare_fb_s else None


@dataclass(frozen=True)
class Setup:
    """What every measurement of a run shares: the model's adapter pool, the adapter measured,
    the model's shape, the device, the options and the worker's pass plan."""

    pool: AdapterPool
    adapter: Adapter
    shape: Shape
    device: torch.device
    args: argparse.Namespace
    plan: PassPlan

    def step(self, data: list[Datum], plan: PassPlan | None = None) -> Callable[[], object]:
        """The adapter's forward_backward of `data` (under the worker's plan by default)."""
        op = [(self.adapter, data)]
        return partial(engine.forward_backward, self.pool, op, self.device, plan or self.plan)

    def step_times(
        self, calls: dict[str, Callable[[], object]], adapters: Sequence[Adapter] = ()
    ) -> dict[str, list[float]]:
        """Each call's seconds in `--steps` rounds after `--warmup` (meters.turns), the
        gradients of `adapters` (by default the adapter's) cleared after each call."""
        clear = partial(engine.clear_grads, adapters or [self.adapter])
        return turns(calls, self.args.steps, self.device, self.args.warmup, clear)

    def medians(
        self, calls: dict[str, Callable[[], object]], adapters: Sequence[Adapter] = ()
    ) -> dict[str, float]:
        times = self.step_times(calls, adapters)
        return {name: statistics.median(ts) for name, ts in times.items()}

    def free_memory(self) -> None:
        """The adapter's gradients dropped, and the cached blocks of a finished or failed pass
        given back to the device."""
        engine.clear_grads([self.adapter])
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def fit_batch(s: Setup) -> tuple[int, list[Datum]]:
    """The asked batch, halved until one forward_backward fits in the device's memory."""
    batch = s.args.batch
    while True:
        data = random_data(s.shape, batch, s.args.seq)
        try:
            s.step(data)()
            engine.clear_grads([s.adapter])
            return batch, data
        except torch.OutOfMemoryError:
            if batch == 1:
                raise
        # Out of the except block: its traceback no longer holds the failed pass's tensors.
        print(f"  {batch} × {s.args.seq} does not fit; halving", flush=True)
        s.free_memory()
        batch //= 2


def measure_bare(s: Setup, data: list[Datum], result: Result) -> None:
    """Plain transformers + PEFT's forward_backward on the same model, adapter and data:
    without checkpointing when it fits, with transformers' own checkpointing of every layer
    when it does not (what its users do)."""
    for checkpointing in (False, True):
        plain = partial(
            plain_forward_backward, s.pool, s.adapter, data, s.device, checkpointing=checkpointing
        )
        try:
            plain()
            break
        except torch.OutOfMemoryError:
            if checkpointing:
                print("  plain transformers + PEFT does not fit even checkpointed", flush=True)
                engine.clear_grads([s.adapter])
                return
        # Out of the except block: its traceback no longer holds the failed pass's tensors.
        print("  plain transformers + PEFT needs its checkpointing to fit", flush=True)
        s.free_memory()
    result.bare_checkpointing = checkpointing
    engine.clear_grads([s.adapter])
    result.bare_fb_s = s.step_times({"plain": plain})["plain"]


def measure_adapters(s: Setup, parts: list[list[Datum]]) -> dict[str, float]:
    """An adapter per part: one cross-adapter pass of all their ops (their LoRA in row blocks,
    stacked and grouped: PassPlan.lora_form) against a pass each, one at a time; median seconds of
    each, none when they run out of memory."""
    k = len(parts)
    have = [a for a in s.pool.adapters.values() if a is not s.adapter][: k - 1]
    try:
        more = add_adapters(s.pool, LoraConfig(rank=s.args.rank), seeds=range(len(have) + 1, k))
        adapters = [s.adapter, *have, *more]
        batches = [(a, part) for a, part in zip(adapters, parts, strict=True) if part]
        one_pass = partial(engine.forward_backward, s.pool, batches, s.device)

        def apart() -> None:
            for batch in batches:
                engine.forward_backward(s.pool, [batch], s.device, s.plan)

        calls: dict[str, Callable[[], object]] = {
            "one pass": partial(one_pass, replace(s.plan, lora_form="blocks")),
            "one pass, stacked": partial(one_pass, replace(s.plan, lora_form="stacked")),
            "one pass, grouped": partial(one_pass, replace(s.plan, lora_form="grouped")),
            "one at a time": apart,
        }
        times = s.medians(calls, adapters)
    except torch.OutOfMemoryError:
        print("  the multi-adapter case ran out of memory: skipped", flush=True)
        return {}
    print(f"  {len(parts)} adapters' ops: {times}", flush=True)
    return times


def measure_loss_paths(s: Setup) -> dict[str, float]:
    """One ppo op of `--datums` short datums: its loss over all their tokens at once (every
    datum sends the same inputs) against the same op taking it datum by datum (every other
    datum also sends weights of 1, the same numbers, so the datums' inputs differ); median
    seconds of each, alternating."""
    n = s.args.datums
    rows = token_rows(n, s.args.datum_seq, seed=7, vocab=s.shape.vocab)
    ops = {
        "joined": rl_datums(rows, 7, [False] * n),
        "datum by datum": rl_datums(rows, 7, [i % 2 == 1 for i in range(n)]),
    }
    op = partial(engine.forward_backward, s.pool, device=s.device, plan=s.plan, loss_fn=LossFn.PPO)
    return s.medians({name: partial(op, [(s.adapter, data)]) for name, data in ops.items()})


def measure_variant(s: Setup, data: list[Datum], variant: Variant) -> Variant:
    """The variant's forward_backward timed (after a first call, and warm-up calls); an error
    (out of memory, say) is kept as the variant's result."""
    variant.checkpointed = engine.pass_plan(s.pool, s.adapter, variant.plan, data, s.device)
    step = s.step(data, variant.plan)
    try:
        with variant.context():
            variant.first_s = timed(step, s.device)
            engine.clear_grads([s.adapter])
            if s.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(s.device)
            variant.fb_s = s.step_times({"step": step})["step"]
    except Exception as exc:  # the variant's outcome, reported
        variant.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    if s.device.type == "cuda":
        variant.peak_gib = torch.cuda.max_memory_allocated(s.device) / 2**30
    s.free_memory()
    shown = variant.error or f"{variant.median_ms():,.1f} ms (first {variant.first_s:.1f} s)"
    print(f"  {variant.name} [{variant.checkpointed}]: {shown}", flush=True)
    return variant


def measure_layer_bytes(s: Setup) -> tuple[float, int] | None:
    """Activation bytes a token keeps per decoder layer: the peak over the memory before one
    pass of 1 × 2048 tokens with nothing checkpointed (the logits' chunk and the embedding
    included), per token and layer; against the plan's estimate. None off CUDA."""
    if s.device.type != "cuda" or s.plan.layer_bytes is None:
        return None
    data = random_data(s.shape, 1, 2048)
    s.free_memory()
    before = torch.cuda.memory_allocated(s.device)
    torch.cuda.reset_peak_memory_stats(s.device)
    s.step(data, replace(s.plan, activation_checkpointing="off"))()
    peak = torch.cuda.max_memory_allocated(s.device) - before
    engine.clear_grads([s.adapter])
    return peak / (2048 * s.shape.layers), s.plan.layer_bytes.kept


def variants(pool: AdapterPool, device: torch.device, cap: int | None) -> list[Variant]:
    """What each of the worker's choices buys, against its plan (the headline), measured with
    the headline's kernels."""
    one_pass = replace(engine.worker_plan(pool, device, cap=cap), micro_batches=False)
    fp32 = engine.worker_plan(pool, device, "fp32", cap)
    context = partial(engine.lora_matmuls, pool, "fp32")
    return [
        Variant("one pass, its layers recomputed (no micro-batches)", one_pass),
        Variant(
            "one pass, whole layers only (no micro-batches, no selective layers)",
            replace(one_pass, selective_layers=False),
        ),
        Variant("every layer whole (QT_ACTIVATION_CHECKPOINTING=on)", on(one_pass, "on")),
        Variant(
            "every layer selective (QT_ACTIVATION_CHECKPOINTING=selective)",
            on(one_pass, "selective"),
        ),
        Variant("LoRA matmuls in fp32 (QT_LORA_MATMUL_DTYPE=fp32)", fp32, context),
    ]


def on(plan: PassPlan, mode: Checkpointing) -> PassPlan:
    """The plan with QT_ACTIVATION_CHECKPOINTING=`mode` (micro-batches are auto's alone)."""
    return replace(plan, activation_checkpointing=mode)


def fit_check(
    base: torch.nn.Module, device: torch.device, dtype: torch.dtype, cap: int | None
) -> str | None:
    """The worker's start-up fit check of this model on the device (as held), printed."""
    fit = engine.fit_explanation(base, device, dtype, cap)
    if fit is not None:
        print(f"  the worker's fit check: {fit}", flush=True)
    return fit


def run(args: argparse.Namespace) -> Result:
    device = torch.device(args.device)
    shape = SHAPES[args.shape]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # as load_base_model
    began = time.perf_counter()
    cap = engine.hold_device(device, args.memory_gib)  # before anything is allocated
    base = build_model(shape, args.device, dtype)
    pool = lora_pool(base, BASE_NAME, adapters=max(2, args.adapters + 1, args.rl_adapters + 1))
    [adapter] = add_adapters(pool, LoraConfig(rank=args.rank), seeds=[0])
    print(f"model built and adapter added in {time.perf_counter() - began:.0f} s", flush=True)
    engine.set_lora_matmuls(pool, "auto")  # as QT_LORA_MATMUL_DTYPE's default makes it
    plan = engine.worker_plan(pool, device, cap=cap)
    s = Setup(pool, adapter, shape, device, args, plan)
    fit = fit_check(base, device, dtype, cap)
    batch, data = fit_batch(s)
    if device.type == "cuda":  # after the fitting, whose failed tries would set the peak
        torch.cuda.reset_peak_memory_stats(device)
    params = sum(p.numel() for p in base.parameters())
    lora = sum(p.numel() for p in adapter.params.values())
    shrunk = args.batch if batch != args.batch else None
    result = Result(
        args.device, args.shape, batch, args.seq, args.rank, params, lora, shrunk_from=shrunk
    )
    result.memory_gib, result.fit = args.memory_gib, fit
    # First what needs transformers' own kernels (the worker's may change the model for
    # good): plain transformers + PEFT, and the worker's plan without the worker's kernels.
    measure_bare(s, data, result)
    plain_bytes = measure_layer_bytes(s)
    plain = Variant("the worker's plan, transformers' own kernels (QT_LIGER_KERNELS=off)", plan)
    if engine.kernels_wanted(device):
        plain = measure_variant(s, data, plain)
    if engine.put_kernels_in(pool, device):
        result.kernels = "liger's RMSNorm, RoPE and SwiGLU"
        result.layer_bytes_plain = plain_bytes[0] if plain_bytes else None
        result.layer_bytes = measure_layer_bytes(s)
    else:
        result.layer_bytes = plain_bytes
        plain.fb_s = []  # measured where the kernels then did not go in: not a row
    if result.layer_bytes:
        print(
            f"  activation bytes per token and layer: measured {result.layer_bytes[0]:,.0f}, "
            f"planned {result.layer_bytes[1]:,}",
            flush=True,
        )
    # Then the worker as it runs by default: the headline, and every other figure.
    headline = measure_variant(s, data, Variant(HEADLINE, plan))
    result.variants = [headline]
    if headline.error is not None:
        raise RuntimeError(f"the worker's plan failed: {headline.error}")
    result.peak_gib = headline.peak_gib
    if plain.fb_s or plain.error:
        result.variants.append(plain)
    if args.variants:
        result.variants += [measure_variant(s, data, v) for v in variants(pool, device, cap)]
    # The training step: forward_backward and optim_step (which clears the grads) taking turns.
    adam = AdamParams(learning_rate=1e-5)
    calls = {"fb": s.step(data), "optim": lambda: engine.optim_step(adapter, adam)}
    times = turns(calls, args.steps, device, args.warmup)
    result.fb_s, result.optim_s = times["fb"], times["optim"]
    if args.long_seq:
        long_pass = Variant(f"1 × {args.long_seq:,} tokens", plan)
        result.long_pass = measure_variant(s, random_data(shape, 1, args.long_seq), long_pass)
    if args.adapters > 1:
        result.adapters = min(args.adapters, batch)
        parts = [data[i :: result.adapters] for i in range(result.adapters)]
        result.multi = measure_adapters(s, parts)
    if args.datums > 1:
        result.loss_paths_shape = f"{args.datums} datums × {args.datum_seq} tokens"
        result.loss_paths = measure_loss_paths(s)
    if args.rl_adapters > 1:
        rows, seq = args.rl_rows, args.rl_seq
        result.rl_shape = f"{args.rl_adapters} adapters × {rows} × {seq} tokens"
        parts = [random_data(shape, rows, seq) for _ in range(args.rl_adapters)]
        result.rl = measure_adapters(s, parts)
    return result


# --- the report --------------------------------------------------------------------------------
def figures(result: Result, device_name: str) -> dict[str, Any]:
    """Achieved TFLOPS and MFU of the forward_backward, both FLOPs counts."""
    peak = peak_tflops(device_name)
    out: dict[str, Any] = {"peak_tflops": peak}
    flops = flops_per_token(SHAPES[result.shape], result.seq, result.lora_params)
    for name, per_token in flops.items():
        out[f"tflops_{name}"] = achieved = per_token * result.tokens_per_s() / 1e12
        out[f"mfu_{name}"] = achieved / peak if peak else None
    return out


def pct(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.1f}%"


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f} ms"


def section(shape: str, memory_gib: float | None = None) -> str:
    """The docs heading of a run on this shape: the 8B headline's, or one of its own; a run
    held to fewer GiB (--memory-gib) has its own too."""
    heading = SECTION if shape == DEFAULT_SHAPE else f"{SECTION}, {shape} shape"
    return heading if memory_gib is None else f"{heading}, a card of {memory_gib:g} GiB"


def report(result: Result, info: dict[str, str], args: argparse.Namespace) -> Report:
    """The headline row, the figures beside it, and each variant against the worker's plan."""
    device = device_name(args.device)
    flops = flops_per_token(SHAPES[result.shape], result.seq, result.lora_params)
    f = figures(result, device)
    shrunk = f" ({result.shrunk_from} × {result.seq} did not fit)" if result.shrunk_from else ""
    held = (
        f", the device held to {result.memory_gib:g} GiB as a worker with "
        f"QT_DEVICE_MEMORY_GIB={result.memory_gib:g} holds it (a card of that size's plan)"
        if result.memory_gib
        else ""
    )
    headline = Table(
        (
            "device", "shape (params, LoRA params)", "batch", "forward_backward ms",
            "optim_step ms", "tokens/s (forward_backward)", "tokens/s (with optim_step)",
            "TFLOPS (LoRA count)", "MFU (LoRA count)", "MFU (6N)", "peak memory GiB",
        ),
        [(
            device, f"{result.shape} ({result.params:,}, {result.lora_params:,})",
            f"{result.batch} × {result.seq}{shrunk}",
            f"{statistics.median(result.fb_s) * 1000:,.1f}",
            f"{statistics.median(result.optim_s) * 1000:,.1f}", f"{result.tokens_per_s():,.0f}",
            f"{result.tokens_per_s(with_optim=True):,.0f}", f"{f['tflops_lora']:,.1f}",
            f"**{pct(f['mfu_lora'])}**", pct(f["mfu_6N"]),
            "–" if result.peak_gib is None else f"{result.peak_gib:.1f}",
        )],
        caption=f"The worker's plan with its default kernels ({result.kernels}){held}:",
    )  # fmt: skip
    body: list[Table | str] = [
        f"FLOPs per token at this shape: LoRA count {flops['lora'] / 1e9:,.2f} GFLOP, 6N "
        f"convention {flops['6N'] / 1e9:,.2f} GFLOP.",
        headline,
        *figure_lines(result),
    ]
    if len(result.variants) > 1:
        body.append(variant_table(result))
    facts = [f"{args.warmup} warm-up steps, then the median of {args.steps}; rank {result.rank}."]
    results = {"result": asdict(result), "figures": f, "flops_per_token": flops}
    command = COMMAND if args.shape == DEFAULT_SHAPE else RL_COMMAND
    if args.memory_gib is not None:
        command = f"{command} --memory-gib {args.memory_gib:g}"
    return Report(section(args.shape, args.memory_gib), command, info, facts, (), body, results)


def figure_lines(result: Result) -> list[str]:
    """The measured figures beside the headline: plain PEFT, shared passes, loss paths, one
    long row, the activation bytes a layer keeps."""
    lines = [f"The worker's fit check on this card: {result.fit}"] if result.fit else []
    if (bare := result.bare_tokens_per_s()) is not None:
        how = "without checkpointing"
        if result.bare_checkpointing:
            how = "with its own checkpointing of every layer"
        lines.append(
            f"Plain transformers + PEFT on the same model, adapter and batch ({how}: SDPA, "
            f"whole logits): forward_backward {ms(statistics.median(result.bare_fb_s))}, "
            f"{bare:,.0f} tokens/s; the engine ÷ plain: **{result.tokens_per_s() / bare:.2f}×** "
            "the tokens/s."
        )
    for times, what in (
        (result.multi, f"{result.adapters} adapters' ops on the same {result.tokens:,} tokens"),
        (result.rl, f"RL-sized ops, {result.rl_shape}"),
    ):
        if times:
            blocks, apart = times["one pass"], times["one at a time"]
            stacked, grouped = times["one pass, stacked"], times["one pass, grouped"]
            lines.append(
                f"{what}: one at a time {ms(apart)}; one cross-adapter pass with its LoRA "
                f"grouped (`PassPlan.lora_form`, the worker's form for these ops) {ms(grouped)} "
                f"(**{apart / grouped:.2f}×** one at a time), in row blocks {ms(blocks)} "
                f"({apart / blocks:.2f}×), stacked {ms(stacked)} ({apart / stacked:.2f}×)."
            )
    if paths := result.loss_paths:
        joined, apart = paths["joined"], paths["datum by datum"]
        lines.append(
            f"One ppo op of {result.loss_paths_shape}: its loss over all the datums' tokens at "
            f"once {ms(joined)}, datum by datum {ms(apart)} (**{apart / joined:.2f}×**)."
        )
    if (v := result.long_pass) is not None:
        how = v.error or (
            f"{v.median_ms():,.1f} ms ({v.checkpointed}), peak {v.peak_gib or 0:.1f} GiB"
        )
        lines.append(f"One row of {v.name.split(' ', 2)[2]}: {how}.")
    if result.layer_bytes is not None:
        measured, planned = result.layer_bytes
        plain = result.layer_bytes_plain
        before = "" if plain is None else f" ({plain:,.0f} with transformers' own kernels)"
        lines.append(
            f"Activation bytes a token keeps per decoder layer (1 × 2,048 tokens, nothing "
            f"checkpointed): measured {measured:,.0f}{before}, the checkpointing plan's estimate "
            f"{planned:,} ({measured / planned:.2f}×)."
        )
    return lines


def variant_table(result: Result) -> Table:
    """Each variant's forward_backward on the headline batch, against the worker's plan."""
    first = statistics.median(result.variants[0].fb_s) if result.variants[0].fb_s else None
    rows = []
    for v in result.variants:
        if v.error is not None:
            rows.append((v.name, v.checkpointed, v.error, "–", "–", "–", "–"))
            continue
        median = statistics.median(v.fb_s)
        rows.append((
            v.name, v.checkpointed, f"{v.median_ms():,.1f}", f"{result.tokens / median:,.0f}",
            "–" if first is None else f"{first / median:.2f}×", f"{v.first_s or 0:.1f}",
            "–" if v.peak_gib is None else f"{v.peak_gib:.1f}",
        ))  # fmt: skip
    columns = (
        "plan", "layers checkpointed", "forward_backward ms", "tokens/s", "÷ the worker's plan",
        "first call s", "peak memory GiB",
    )  # fmt: skip
    return Table(columns, rows)


def not_measured_block(reason: str) -> str:
    """The block a run without a GPU leaves: what would be measured, and how to run it."""
    what = (
        f"{NOT_MEASURED}: {reason}. On a CUDA machine this times the engine's `forward_backward` "
        "on a Llama-3.1-8B-shaped model with random bf16 weights and a rank-32 LoRA (8 × 2048 "
        "tokens, halved until it fits): training tokens/s and MFU. Run it there with:"
    )
    return "\n".join([what, "", *reproduce(COMMAND)])


KNOBS = {
    "--batch": (8, "datums (halved while they do not fit)"),
    "--rank": (32, "LoRA rank"),
    "--warmup": (2, "steps before the timed ones"),
    "--steps": (5, "timed steps"),
    "--adapters": (8, "K adapters sharing one pass against one at a time (1: skip)"),
    "--rl-adapters": (8, "adapters of the RL-sized case, an op each (1: skip it)"),
    "--rl-rows": (4, "datums of each RL-sized op"),
    "--datums": (64, "datums of the op whose loss paths are compared (1: skip it)"),
}
# Options whose default depends on the device: (on CUDA, on the CPU, help).
BY_DEVICE: dict[str, tuple[int, int, str]] = {
    "--seq": (2048, 64, "tokens of each datum"),
    "--rl-seq": (512, 64, "tokens of each RL-sized datum"),
    "--datum-seq": (32, 16, "tokens of each datum of the loss-paths op"),
    "--long-seq": (32768, 256, "one row this long (0: skip it)"),
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser("bench.mfu", __doc__, knobs=KNOBS, quick="few steps")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=list(SHAPES), help="default: llama-3.1-8b; CPU small")
    for flag, (cuda, cpu, help_text) in BY_DEVICE.items():
        parser.add_argument(flag, type=int, default=None, help=f"{help_text} ({cuda}; CPU {cpu})")
    parser.add_argument(
        "--no-variants", dest="variants", action="store_false", help="the worker's plan alone"
    )
    parser.add_argument(
        "--count",
        action="store_true",
        help="count the kernels of a pass of 1 and 8 adapters on meta tensors (no GPU)",
    )
    parser.add_argument(
        "--memory-gib",
        type=float,
        default=None,
        help="plan and run as on a card of this many GiB (QT_DEVICE_MEMORY_GIB): an 80 GiB "
        "card's plan measured on an H200",
    )
    args = cli.parse(parser, argv, quick={"warmup": 1, "steps": 2})
    cuda = args.device.startswith("cuda")
    args.shape = args.shape or (DEFAULT_SHAPE if cuda or args.count else "small")
    for flag, defaults in BY_DEVICE.items():
        name = flag.removeprefix("--").replace("-", "_")
        if getattr(args, name) is None:
            setattr(args, name, defaults[0 if cuda else 1])
    # Only GPU numbers belong in the docs: a CPU run is a smoke test of the code path. A
    # count is no timing: it is the same on any machine.
    args.no_docs = args.no_docs or not (cuda or args.count)
    return args


FORM_NAMES: dict[LoraForm, str] = {
    "blocks": "row blocks", "stacked": "stacked", "grouped": "grouped"
}  # fmt: skip
WIDE_LOGIT_CHUNKS = 1 << 30


def counted(args: argparse.Namespace) -> Report:
    """--count: the kernels (and bytes) of one forward_backward pass at the shape, on meta
    tensors (bench/harness/kernel_count.py), of 1 and of COUNT_ADAPTERS adapters' ops of
    COUNT_ROWS x COUNT_SEQ tokens each in one pass, nothing recomputed, bf16 with LoRA's
    matmuls in bf16 (a CUDA worker's defaults); the adapters' LoRA in each form
    (PassPlan.lora_form)."""
    shape, meta = SHAPES[args.shape], torch.device("meta")
    pool = lora_pool(build_model(shape, "meta", torch.bfloat16), BASE_NAME, COUNT_ADAPTERS + 1)
    engine.set_lora_matmuls(pool, "auto")  # as QT_LORA_MATMUL_DTYPE's default makes it
    with meta:  # PEFT leaves a new adapter's weights where they are made, beside a meta base
        adapters = add_adapters(pool, LoraConfig(rank=args.rank), seeds=range(COUNT_ADAPTERS))
    ops = [(a, random_data(shape, COUNT_ROWS, COUNT_SEQ)) for a in adapters]
    rows = []

    def count(n: int, plan: PassPlan) -> Counts:
        pass_ = partial(engine.forward_backward, pool, ops[:n], meta, plan)
        if plan.lora_form == "grouped":  # stacks the adapters: once, at their first such pass
            count_kernels(pass_)
        engine.clear_grads(adapters)  # a first forward_backward since the step: none pending
        return count_kernels(pass_)

    # The last form again with logits in chunks of 2^30 elements: with 8x the tokens a pass
    # makes 8x the default's chunks (QT_LOGIT_CHUNK_ELEMENTS), each a few dozen kernels.
    default = PassPlan().logit_chunk_elements
    forms = [(f, default) for f in FORM_NAMES] + [("grouped", WIDE_LOGIT_CHUNKS)]
    for form, chunk in forms:
        plan = PassPlan(activation_checkpointing="off", lora_form=form, logit_chunk_elements=chunk)
        one = count(1, plan)
        name = FORM_NAMES[form] + (", 2^30-element logit chunks" if chunk > default else "")
        for n in (1, COUNT_ADAPTERS):
            got = one if n == 1 else count(n, plan)
            rows.append((
                name, n, f"{got.total:,}",
                f"{got.total / one.total:.2f}×", got.host_reads,
                f"{got.bytes_moved / 2**30:,.1f}",
                ", ".join(f"{k} {v:,}" for k, v in got.kernels.most_common(4)),
            ))  # fmt: skip
    columns = (
        "LoRA of several adapters", "adapters", "kernels", "÷ 1 adapter", "host reads",
        "GiB read + written", "most launched",
    )  # fmt: skip
    caption = (
        f"One forward_backward pass at the {args.shape} shape, rank {args.rank}, each adapter's "
        f"op {COUNT_ROWS} × {COUNT_SEQ} tokens, nothing recomputed, counted on meta tensors:"
    )
    facts = ["No GPU: a count, not a timing; attention counted as one fused kernel each way."]
    body: list[Table | str] = [Table(columns, rows, caption=caption)]
    body.append(recomputation_table(pool, adapters[0], args))
    command = f"{COMMAND.replace('--device cuda', '--count')} --shape {args.shape}"
    return Report(COUNT_SECTION, command, engine_machine("cpu"), facts, (), body, {})


# What --count's recomputation table compares: nothing, every layer whole, every one selective.
RECOMPUTATIONS: dict[Checkpointing, str] = {
    "off": "nothing recomputed",
    "on": "every layer whole (QT_ACTIVATION_CHECKPOINTING=on)",
    "selective": "every layer selective (QT_ACTIVATION_CHECKPOINTING=selective)",
}


def recomputation_table(pool: AdapterPool, adapter: Adapter, args: argparse.Namespace) -> Table:
    """One adapter's pass of 1 x 2,048 tokens with each recomputation: what backward does
    again, in kernels, GEMM FLOPs and bytes."""
    meta, shape = torch.device("meta"), SHAPES[args.shape]
    ops = [(adapter, random_data(shape, 1, 2048))]
    counts = {}
    for mode in RECOMPUTATIONS:
        plan = PassPlan(activation_checkpointing=mode)
        engine.clear_grads([adapter])
        counts[mode] = count_kernels(partial(engine.forward_backward, pool, ops, meta, plan))
    plain = counts["off"]
    rows = [
        (
            name, f"{c.total:,}", f"+{c.total - plain.total:,}",
            f"{c.gemm_flops / 1e12:,.2f}", f"+{(c.gemm_flops - plain.gemm_flops) / 1e12:,.2f}",
            f"{c.gemm_flops / plain.gemm_flops:.3f}×", f"{c.bytes_moved / 2**30:,.1f}",
        )
        for name, c in ((RECOMPUTATIONS[m], counts[m]) for m in RECOMPUTATIONS)
    ]  # fmt: skip
    columns = (
        "recomputation", "kernels", "more", "GEMM TFLOP", "more", "÷ nothing recomputed",
        "GiB read + written",
    )  # fmt: skip
    caption = (
        f"What recomputation costs: one forward_backward pass at the {args.shape} shape, one "
        f"adapter's op of 1 × 2,048 tokens, rank {args.rank}, counted on meta tensors:"
    )
    return Table(columns, rows, caption=caption)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_transformers()
    if args.count:
        emit(counted(args), docs_of(args), args.json)
        return 0
    info = announce(engine_machine(args.device))
    emit(report(run(args), info, args), docs_of(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
