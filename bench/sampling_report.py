"""What bench.sampling measures, as data, and how it is shown: the `## Sampling` section of
docs/benchmarks.md and the tables on stdout."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from bench.harness.report import machine_line, reproduce
from bench.harness.report import table as markdown_table

SECTION = "## Sampling"
COMMAND = ".venv/bin/python -m bench.sampling"
TARGET = 1.0  # service tokens/s over generate() tokens/s, base model
REQUESTS, ADAPTERS = 32, 4
SIDES = ("service", "generate", "loop")
CASES = ("base", "mixed")


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

    @property
    def pattern(self) -> str:
        return "+".join(map(str, self.batches))


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


# --- tables ------------------------------------------------------------------------------------
def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:,.0f}"


def batch_text(splits: list[Split]) -> str:
    """Each batch pattern the worker ran, with the median time of each of its batches."""
    patterns = {x.pattern: [y for y in splits if y.pattern == x.pattern] for x in splits}
    return "; ".join(
        f"{p}: "
        + " + ".join(
            f"{statistics.median(col) * 1000:,.0f}"
            for col in zip(*(y.batch_s for y in group), strict=True)
        )
        + f" ms ({len(group)} of {len(splits)} calls)"
        for p, group in sorted(patterns.items(), key=lambda kv: -len(kv[1]))
    )


TABLE = (
    "model (params)",
    "case",
    "requests × max_tokens",
    "rounds",
    "generate() tok/s",
    "service tok/s",
    "service / generate()",
    "worker loop in-process tok/s",
    "loop / generate()",
    "other processes, cores (service / generate / loop)",
)
SPLIT = (
    "model",
    "case",
    "service total",
    "submit → first op started",
    "on the worker (first started → last finished)",
    "last finished → last result in hand",
    "worker loop in-process",
    "generate()",
    "worker batches: requests, time each",
    "service sequences equal to the in-process loop's",
)


def table(results: list[SizeResult]) -> list[str]:
    rows = []
    for res in results:
        t = res.size.tokens
        for case, c in res.cases.items():
            rows.append(
                (
                    f"`{res.size.model}` ({res.params / 1e6:,.1f}M)",
                    "base model" if case == "base" else f"{ADAPTERS} adapters, mixed batch",
                    f"{REQUESTS} × {t}",
                    len(c.times["service"]),
                    f"{c.tok_s('generate', t):,.0f}",
                    f"{c.tok_s('service', t):,.0f}",
                    f"**{c.ratio():.2f}×**",
                    f"{c.tok_s('loop', t):,.0f}",
                    f"{c.ratio('loop'):.2f}×",
                    " / ".join(f"{statistics.mean(c.foreign[s]):.2f}" for s in SIDES),
                )
            )
    return [*markdown_table(TABLE, rows), ""]


def split_lines(results: list[SizeResult]) -> list[str]:
    rows = [
        (
            f"`{res.size.model}`",
            case,
            ms(c.times["service"]),
            ms([x.queue_in for x in c.split]),
            ms([x.worker for x in c.split]),
            ms([x.queue_out for x in c.split]),
            ms(c.times["loop"]),
            ms(c.times["generate"]),
            batch_text(c.split),
            f"{sum(c.same_as_loop)} of {REQUESTS * len(c.same_as_loop)}",
        )
        for res in results
        for case, c in res.cases.items()
    ]
    return [
        "Where the service's time goes (medians over rounds, ms per call of 32 requests; "
        "the split uses the Redis-clock `started_at` / `finished_at` of the sample jobs "
        "and the client's clock):",
        "",
        *markdown_table(SPLIT, rows),
        "",
    ]


# --- docs --------------------------------------------------------------------------------------
INTRO = (
    "Generated tokens per second for {n} concurrent sample requests through the service, "
    "against transformers' batched `generate()` on the same model in the same run. Service: a "
    "real LoRA worker process (`python -m queue_tinker.cli worker --engine lora --device "
    "{device}`, production defaults: up to 64 sequences per generation batch), a Redis and a "
    "scratch Postgres database; {n} `sample_async` calls (prompts of 8–48 random byte tokens, "
    "`num_samples=1`, temperature 1, `stop=[]` so every request generates exactly `max_tokens`, "
    "a seed each) are sent at once and timed from the first submit to the last result in hand, "
    "so the time includes the client's validation and msgpack encoding, {n} enqueue scripts, "
    "the worker's pick-up, its generation loop, the publish scripts and the results' way back. "
    "generate(): the same prompts left-padded into one `model.generate(input_ids, "
    "attention_mask, max_new_tokens=T, min_new_tokens=T, do_sample=True, temperature=1.0, "
    "top_k=0, top_p=1.0)` call on the same model loaded in the benchmark process. A third "
    "side, the worker's own generation function "
    "(`queue_tinker.workers.sampling.decode_loop.generate`) on "
    "the same "
    "{n} requests in the benchmark process, splits the service's cost into loop and queue. "
    "Mixed adapters: {a} sampler checkpoints of one rank-32 LoRA run (2 training steps apart, "
    "lr 1e-2, trained through the service), {per} requests on each through one sampling "
    "session per checkpoint, against PEFT `generate(..., adapter_names=[...])` on a PeftModel "
    "holding the same {a} checkpoint directories (one mixed-adapter batch). The base-model "
    "rounds run first, while the worker holds no adapter. After a warm-up of every side, "
    "rounds rotate the order of the three sides; one computes at a time (the worker idles "
    "while nothing is queued). Every service response is checked: `max_tokens` tokens, "
    "stop reason `length`."
)


def findings(results: list[SizeResult]) -> list[str]:
    """Per model: the service's time split into queue, the worker's batches and its loop."""
    lines = []
    for r in results:
        for case, c in r.cases.items():
            service, loop = c.median("service") * 1000, c.median("loop") * 1000
            queue = statistics.median(x.queue_in + x.queue_out for x in c.split) * 1000
            first = c.first_batch()
            split = (
                f"the worker ran the 32 as {batch_text(c.split)}"
                if first is None
                else f"the worker started generating on the first request to arrive, so the 32 "
                f"ran as {batch_text(c.split)}; that first batch alone took "
                f"{first * 1000:,.0f} ms, and without it the service would have reached "
                f"about {c.ratio() * service / (service - first * 1000):.2f}× generate()"
            )
            lines.append(
                f"- `{r.size.model}`, {case}: service {service:,.0f} ms per call vs generate() "
                f"{c.median('generate') * 1000:,.0f} ms; the queue itself (submit → first op "
                f"started, last finished → last result) took {queue:,.0f} ms; {split}. The "
                f"worker's loop on all 32 in one batch, in-process: {loop:,.0f} ms "
                f"({c.ratio('loop'):.2f}× generate())."
            )
    return [*lines, ""]


HOW_TO_READ = (
    "How to read it. The queue proper (client validation and msgpack encoding, 32 enqueue "
    "scripts, the worker's pick-up, the publish scripts, the results' way back) costs 20-30 ms "
    "per call at either size. Before it starts a generation loop the worker waits while sample "
    "ops keep arriving (each gap under 5 ms, 50 ms at most), so requests sent together share "
    "one prefill; when the client's submits come further apart than that (a busy machine), "
    "the later arrivals join the running loop at its next step (continuous batching; the "
    "worker batches column groups the requests by when they started). "
    "The loop itself is the loop / generate() column: it prefills each prompt once (prompts "
    "of similar length together, so less of the prefill is padding), writes each step's keys "
    "and values into its cache in place (generate()'s cache copies itself every step: "
    "`workers/sampling/kv_cache.py`), samples without sorting the vocabulary when no top-k / top-p "
    "applies, and draws each "
    "request's uniforms in blocks from the request's own seeded generator, which keeps a "
    "request's samples independent of its batch. With adapters, PEFT's "
    "`generate(adapter_names=...)` registers and removes forward hooks on every LoRA module at "
    "every step ({hooks}) and gathers and scatters each adapter's rows by index in every LoRA "
    "layer; the worker's loop keeps each adapter's rows together and adds each block's update "
    "in place (`workers/model/row_blocks.py`).{linger} {machine}"
)
CPU_MACHINE = (
    "These are CPU numbers from a shared 2-core machine: compare figures from the same run only."
)
GPU_MACHINE = (
    "These are GPU numbers: the model runs on the GPU, while the client, the worker's Python, "
    "Redis and Postgres share the machine's CPU cores; a decode step of these small models is "
    "bound by the host (Python and kernel launches), not by the GPU."
)
LINGER = (
    " Calls with more than two batches found some sampling sessions released: a session idle "
    "for longer than `linger_ms` (30 s, the default; a 100M round takes longer than that) is "
    "handed back, and a busy worker re-claims a waiting one only once its offer is 200 ms old, "
    "so those requests wait for yet another batch."
)


def render(
    info: dict[str, str],
    results: list[SizeResult],
    threads: dict[str, int],
    omp: int,
    total_s: float,
    device: str = "cpu",
) -> str:
    """The whole `## Sampling` section (`## Sampling on a GPU` for a CUDA run), in Markdown."""
    intro = INTRO.format(n=REQUESTS, a=ADAPTERS, per=REQUESTS // ADAPTERS, device=device)
    gpu = device != "cpu"
    verdicts = "; ".join(
        f"`{r.size.model}` {r.cases['base'].ratio():.2f}× "
        f"(**{'met' if r.cases['base'].ratio() >= TARGET else 'not met'}**)"
        for r in results
    )
    mixed = "; ".join(f"`{r.size.model}` {r.cases['mixed'].ratio():.2f}×" for r in results)
    hooks = ", ".join(f"{r.hook_ms:.1f} ms per step at `{r.size.model}`" for r in results)
    thread_text = ", ".join(f"{k} {v}" for k, v in threads.items())
    linger = any(len(x.batches) > 2 for r in results for c in r.cases.values() for x in c.split)
    return "\n".join(
        [
            f"{SECTION} on a GPU" if gpu else SECTION,
            "",
            intro,
            "",
            "Reproduce (`--quick` is a smoke run that leaves this file alone; `--models` picks "
            "the models, `--big-tokens` the 100M model's `max_tokens`):",
            "",
            *reproduce(COMMAND + (f" --device {device}" if gpu else "")),
            "",
            machine_line(info)
            + f"; torch threads, set explicitly (OMP_NUM_THREADS={omp} in the worker's "
            f"environment, `torch.set_num_threads({omp})` here): {thread_text}. The run took "
            f"{total_s:.0f} s; the 100M model runs fewer rounds and shorter requests to keep it "
            "near 10 minutes. Client, worker, Redis and Postgres share this machine's cores.",
            "",
            f"Target: service ≥ {TARGET:.1f}× generate() tokens/s for the base model (median call "
            f"over median call): {verdicts}. Mixed adapters: {mixed}.",
            "",
            *table(results),
            *split_lines(results),
            *findings(results),
            HOW_TO_READ.format(
                hooks=hooks,
                linger=LINGER if linger else "",
                machine=GPU_MACHINE if gpu else CPU_MACHINE,
            ),
            "",
        ]
    )
