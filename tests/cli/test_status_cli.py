"""`queue-tinker status` and `queue-tinker limits`, run as the real command against Redis and
real workers."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from procs import REPO, child_env, queue_pings, running_workers

from queue_tinker.cli.status import quantile_bound, render
from queue_tinker.client import ServiceClient
from queue_tinker.queue.connection import connect
from queue_tinker.queue.control.limits import DEFAULT_TENANT_KEY, Limits, read_limits, set_limits
from queue_tinker.queue.keys import Keys
from queue_tinker.settings import Settings


def run_cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "queue_tinker.cli", *args],
        cwd=REPO,
        env=child_env(settings),
        capture_output=True,
        text=True,
        timeout=30,
    )


def queue_waiting_model(settings: Settings, model_id: str, ops: int, tenant: str = "acme") -> None:
    """A model of `tenant` on a base model no worker serves, with `ops` pings queued."""
    asyncio.run(queue_pings(settings, "absent", {model_id: ops}, tenant=tenant))


def test_status_shows_workers_queues_and_totals(
    settings: Settings, service: ServiceClient, tmp_path: Path
) -> None:
    """The text names the live worker and the waiting queue with its state; --json carries
    the same overview and the op counters."""
    with running_workers(settings, 1, tmp_path):
        client = service.create_lora_training_client("tiny", rank=4)
        for future in [client.ping(i) for i in range(3)]:
            future.result(timeout=20)
        # The workers' recorders write it to Postgres: a tenant that exists there.
        queue_waiting_model(settings, "m-waiting", ops=2, tenant="default")

        shown = run_cli(settings, "status")
        assert shown.returncode == 0, shown.stderr
        data = json.loads(run_cli(settings, "status", "--json").stdout)

    (worker,) = data["overview"]["workers"]
    assert worker["base_model"] == "tiny"
    text = shown.stdout
    worker_line = next(line for line in text.splitlines() if worker["id"] in line)
    assert "tiny" in worker_line and "cpu" in worker_line
    queue_line = next(line for line in text.splitlines() if "m-waiting" in line)
    assert "default" in queue_line and "absent" in queue_line
    assert "paused_capacity: no live worker serves base model absent" in queue_line
    assert " 2 " in queue_line  # its depth
    ping_line = next(line for line in text.splitlines() if line.strip().startswith("ping"))
    assert ping_line.split()[1] == "3"  # done

    (queue,) = [q for q in data["overview"]["queues"] if q["model_id"] == "m-waiting"]
    assert (queue["depth"], queue["state"], queue["tenant_id"]) == (2, "paused_capacity", "default")
    ops = {(o["kind"], o["status"]): o["count"] for o in data["metrics"]["ops"]}
    assert ops[("ping", "done")] == 3
    (ping_latency,) = [h for h in data["metrics"]["latency"] if h["kind"] == "ping"]
    assert ping_latency["count"] == 3 and ping_latency["buckets"][-1] == ["+Inf", 3]


def test_status_watch_redraws_until_interrupted(settings: Settings) -> None:
    """--watch prints the screen again every interval; Ctrl-C (SIGINT) ends it with status 0."""
    queue_waiting_model(settings, "m-watched", ops=1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "queue_tinker.cli", "status", "--watch", "0.2"],
        cwd=REPO,
        env=child_env(settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A runner started in the background has SIGINT ignored, and children inherit that:
        # give this one a terminal's default, as a user at a terminal has.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # Read screens as they come (a loaded machine may take seconds to start the process), then
    # interrupt; a watch that stopped redrawing would time the test out at the deadline.
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    seen: list[str] = []
    # Three whole screens: the model's row comes after its section's header.
    while sum("m-watched" in line for line in seen) < 3:
        assert time.monotonic() < deadline, "".join(seen)
        line = proc.stdout.readline()
        assert line, f"status --watch ended early: {proc.stderr.read() if proc.stderr else ''}"
        seen.append(line)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert sum("QUEUES (1 model, 1 op unfinished)" in line for line in seen) >= 3


def test_status_and_limits_need_redis_url() -> None:
    """Without QT_REDIS_URL both commands say so and exit 2."""
    env = {"PATH": "/usr/bin:/bin"}
    for args in (["status"], ["limits", "show"]):
        result = subprocess.run(
            [sys.executable, "-m", "queue_tinker.cli", *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == 2
        assert "QT_REDIS_URL is not set" in result.stderr


def test_limits_round_trip_through_redis(settings: Settings) -> None:
    """set writes what the queue reads (read_limits), show lists it, clear falls back to the
    default; a negative limit is refused with the field's name."""
    keys = Keys(settings.key_prefix)

    def limits_of(tenant: str) -> Limits:
        async def go() -> Limits:
            client = connect(settings.redis_url or "")
            try:
                return await read_limits(client, keys, tenant)
            finally:
                await client.aclose()

        return asyncio.run(go())

    result = run_cli(
        settings,
        "limits",
        "set",
        "--tenant",
        "acme",
        "--training-runs",
        "2",
        "--inflight-ops",
        "5",
        "--tokens-per-s",
        "1500.5",
    )
    assert result.returncode == 0, result.stderr
    assert limits_of("acme") == Limits(training_runs=2, inflight_ops=5, tokens_per_s=1500.5)
    assert run_cli(settings, "limits", "set", "--default", "--inflight-ops", "3").returncode == 0
    assert (
        run_cli(settings, "limits", "set", "--tenant", "acme", "--inflight-ops", "7").returncode
        == 0
    )  # only that field changes
    assert limits_of("acme") == Limits(training_runs=2, inflight_ops=7, tokens_per_s=1500.5)
    assert limits_of("other") == Limits(inflight_ops=3)

    shown = run_cli(settings, "limits", "show").stdout.splitlines()
    assert shown[0].split() == ["tenant", "training", "runs", "inflight", "ops", "tokens/s"]
    assert shown[1].split() == ["(default)", "unlimited", "3", "unlimited"]
    assert shown[2].split() == ["acme", "2", "7", "1500.5"]

    refused = run_cli(settings, "limits", "set", "--tenant", "acme", "--training-runs", "-1")
    assert refused.returncode == 2 and "training_runs" in refused.stderr
    assert run_cli(settings, "limits", "set", "--tenant", "acme").returncode == 2  # nothing to set

    assert run_cli(settings, "limits", "clear", "--tenant", "acme").returncode == 0
    assert limits_of("acme") == Limits(inflight_ops=3)
    assert [
        line.split()[0] for line in run_cli(settings, "limits", "show").stdout.splitlines()
    ] == ["tenant", "(default)"]


def test_status_shows_tenant_limits_in_use(settings: Settings) -> None:
    """A tenant's limits appear as in use/limit beside its paused models."""

    async def limit() -> None:
        client = connect(settings.redis_url or "")
        try:
            await set_limits(
                client, Keys(settings.key_prefix), "acme", training_runs=4, tokens_per_s=250
            )
            await set_limits(client, Keys(settings.key_prefix), DEFAULT_TENANT_KEY, inflight_ops=9)
        finally:
            await client.aclose()

    asyncio.run(limit())
    queue_waiting_model(settings, "m-limited", ops=1)
    result = run_cli(settings, "status")
    assert result.returncode == 0, result.stderr
    tenant_line = next(line for line in result.stdout.splitlines() if line.split()[:1] == ["acme"])
    assert tenant_line.split()[1:4] == ["0/4", "0/9", "250"]


def test_latency_quantiles_and_empty_screen() -> None:
    """Quantiles come from the cumulative buckets' bounds; an empty deployment says so."""
    buckets = [[0.1, 2], [0.5, 9], [1.0, 10], ["+Inf", 10]]
    assert quantile_bound(buckets, 10, 0.5) == "<=0.5s"
    assert quantile_bound(buckets, 10, 0.95) == "<=1s"
    assert quantile_bound([[1.0, 0], ["+Inf", 4]], 4, 0.5) == ">1s"
    empty = {
        "overview": {"workers": [], "queues": [], "tenants": []},
        "metrics": {"ops": [], "latency": [], "tokens": {}, "tenant_tokens": {}},
    }
    assert render(empty).splitlines() == [
        "WORKERS (0)",
        "  (no live worker)",
        "",
        "QUEUES (0 models, 0 ops unfinished)",
        "  (nothing queued)",
        "",
        "TENANTS (0; in use/limit, no limit shown when unlimited)",
        "  (none)",
        "",
        "OPS (since the deployment began; 0 tokens)",
        "  (no op finished yet)",
    ]
