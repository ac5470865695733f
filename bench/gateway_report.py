"""The `## Gateway: the official SDK against the Python client` section of docs/benchmarks.md,
from the tables bench.gateway_round_trip prints (its `markdown`) and the headline gaps."""

from __future__ import annotations

from dataclasses import dataclass

from bench.harness.report import machine_line, reproduce

SECTION = "## Gateway: the official SDK against the Python client"
COMMAND = ".venv/bin/python -m bench.gateway_round_trip"


@dataclass(frozen=True)
class Gap:
    """What the SDK and gateway add to one shape's round trip."""

    shape: str
    calls: str
    ratio: float  # SDK p50 / client p50
    paired_ms: float  # median of the per-round SDK − client differences


INTRO = (
    "One training round trip through each door onto the same queue, same worker, same run: the "
    "official `tinker` SDK (`tinker.ServiceClient(base_url, api_key)`, its defaults: its own "
    "background loop, long-polled `retrieve_future`, telemetry as shipped) through a "
    "`queue-tinker serve` process, against `queue_tinker.ServiceClient` talking to Redis "
    "directly. A round trip is the Tinker loop's `fb = tc.forward_backward(batch, "
    '"cross_entropy"); opt = tc.optim_step(adam); fb.result(); opt.result()`; "ping" is one '
    "`forward` of 1 datum × 2 tokens, the least model work a door can carry. One LoRA worker "
    "process (`--engine lora --device cpu`, production defaults) on `{model}`, rank 32; a "
    "fresh training client per door and shape; {warmup} warm-up round trips per door, then "
    "{rounds} per door, alternating client / SDK so drift hits both alike."
)
READING = (
    "Reading it: SDK − client is what the HTTP door adds (the SDK's own work, the gateway's, "
    "and the extra hops), so read it as absolute milliseconds per call; the ratio shrinks as "
    "the model work grows. The paired median (each SDK round trip against the client round "
    "trip next to it) is the figure drift from other jobs disturbs least. The CPU columns say "
    "who pays: on a machine where the caller, the gateway and the worker share the cores, "
    "their CPU also slows the worker's ops; with the gateway elsewhere that part goes away."
)


def render(
    info: dict[str, str],
    model: str,
    rounds: int,
    warmup: int,
    tables: str,
    gaps: list[Gap],
    total_s: float,
) -> str:
    """The docs section, in Markdown."""
    headline = "; ".join(
        f"{g.shape} ({g.calls}): **{g.paired_ms:+.1f} ms** per round trip "
        f"({g.ratio:.2f}× the client's p50)"
        for g in gaps
    )
    return "\n".join(
        [
            SECTION,
            "",
            INTRO.format(model=model, warmup=warmup, rounds=rounds),
            "",
            "Reproduce (`--quick` is a smoke run that leaves this file alone; `--out` writes every "
            "round trip as JSON):",
            "",
            *reproduce(COMMAND),
            "",
            machine_line(info)
            + f". The run took {total_s:.0f} s. The SDK or client, the gateway, the worker, Redis "
            "and Postgres share this machine's cores.",
            "",
            f"What the SDK and gateway add (paired median): {headline}.",
            "",
            tables,
            "",
            READING,
            "",
        ]
    )
