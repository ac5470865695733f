"""Redis failing over under load loses nothing acknowledged: a primary and two replicas watched
by three Sentinels (real processes on loopback), the deployment on the Sentinel URL with
`replicas=1`. During pipelined training steps, a sampler's requests and a second tenant's ops,
the primary is killed (-9): every op a client was told was accepted runs once, no future
hangs, and the run ends where an uninterrupted run on the same deployment ends, bit for bit.
Then the old primary comes back (Sentinel makes it a replica of the new one) and the new
primary is killed in turn, with the same outcome."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from procs import WorkerProcess, wait_for_workers
from redis_ha import RedisSet, redis_set
from test_redis_restart import recorded, wait_until
from training_runs import ADAM, BATCHES, TINY, adapter_weights

import queue_tinker as tinker
from queue_tinker import types
from queue_tinker.queue.keys import Keys
from queue_tinker.settings import Settings

pytestmark = pytest.mark.slow

STEPS = 50  # per phase: 100 in all, each a forward_backward and an optim_step
PROMPT = types.ModelInput.from_ints(list(b"the cat"))
SEEDED = types.SamplingParams(max_tokens=8, seed=7, stop=[])


@dataclass
class Traffic:
    """What the clients were told was accepted in one phase, and its outcomes."""

    steps: list[tuple[Any, Any]] = field(default_factory=list)  # (forward_backward, optim_step)
    samples: list[Any] = field(default_factory=list)
    pings: list[Any] = field(default_factory=list)

    def futures(self) -> list[Any]:
        return [f for pair in self.steps for f in pair] + self.samples + self.pings


def submit_while(
    kill: Callable[[], None],
    trainer: tinker.TrainingClient,
    sampler: tinker.SamplingClient,
    other: tinker.TrainingClient,
    start: int,
) -> Traffic:
    """STEPS pipelined steps from `start`, a sample every fifth and a ping of the other
    tenant every step, with `kill` run a fifth of the way in: the submits after it ride the
    failover out."""
    traffic = Traffic()
    for step in range(start, start + STEPS):
        if step == start + STEPS // 5:
            kill()
        traffic.steps.append(
            (
                trainer.forward_backward(BATCHES[step % len(BATCHES)], "cross_entropy"),
                trainer.optim_step(ADAM),
            )
        )
        if step % 5 == 0:
            traffic.samples.append(sampler.sample(PROMPT, 1, SEEDED))
        traffic.pings.append(other.ping(f"other-{step}"))
    return traffic


def outcomes(traffic: Traffic) -> tuple[list[float], list[list[int]], list[Any]]:
    """Every future's result within a bound (none hangs): losses, sampled tokens, pings."""
    losses = [fb.result(timeout=120).loss for fb, _ in traffic.steps]
    for _, opt in traffic.steps:
        opt.result(timeout=120)
    tokens = [s.result(timeout=120).sequences[0].tokens for s in traffic.samples]
    pings = [p.result(timeout=120) for p in traffic.pings]
    return losses, tokens, pings


def published_ops(ha: RedisSet, prefix: str) -> int:
    """Ops published since the start, counted once each by the publish script, on the primary
    the Sentinels name now."""
    with redis.Redis(port=ha.primary().port) as client:
        counts = client.hgetall(Keys(prefix).metrics_ops())
        return sum(int(n) for n in counts.values())  # type: ignore[union-attr]


@pytest.fixture
def ha(tmp_path: Path) -> Iterator[RedisSet]:
    with redis_set(tmp_path / "redis", replicas=2, sentinels=3) as found:
        yield found


@pytest.mark.timeout(420)
def test_kill_9_of_the_primary_loses_no_acknowledged_op(
    ha: RedisSet, database_url: str, tmp_path: Path, key_prefix: str
) -> None:
    settings = Settings(
        redis_url=ha.url(replicas=1, timeout_ms=500),
        database_url=database_url,
        key_prefix=key_prefix,
        data_dir=tmp_path / "data",
        lease_ttl_ms=5_000,
        heartbeat_ms=500,
        linger_ms=120_000,
        snapshot_every_steps=20,
    )
    worker = WorkerProcess(settings, TINY, tmp_path / "worker.log", engine="lora")
    try:
        wait_for_workers(settings, 1, timeout=90)
        with (
            tinker.ServiceClient(settings) as service,
            tinker.ServiceClient(settings.model_copy(update={"tenant": "other"})) as second,
        ):
            trainer = service.create_lora_training_client(TINY, rank=4, seed=11)
            sampler = service.create_sampling_client(base_model=TINY)
            other = second.create_lora_training_client(TINY, rank=4)
            expected_samples = [
                sampler.sample(PROMPT, 1, SEEDED).result(timeout=60).sequences[0].tokens
            ]
            published_before = published_ops(ha, key_prefix)

            first = ha.primary()
            first_phase = submit_while(first.kill, trainer, sampler, other, start=0)
            second_primary = ha.wait_for_failover(first)
            phase_one = outcomes(first_phase)

            first.start()  # back with its own data; Sentinel makes it a replica
            ha.wait_until_replicated(2, timeout=60)
            assert ha.primary() is second_primary
            second_phase = submit_while(second_primary.kill, trainer, sampler, other, STEPS)
            ha.wait_for_failover(second_primary)
            phase_two = outcomes(second_phase)

            # Published once each: every op accepted, none twice (a repeat would count again).
            accepted = len(first_phase.futures()) + len(second_phase.futures())
            assert published_ops(ha, key_prefix) - published_before == accepted
            for phase in (phase_one, phase_two):
                assert phase[1] == expected_samples * len(phase[1])
            assert [p["data"] for p in phase_one[2] + phase_two[2]] == [
                f"other-{step}" for step in range(2 * STEPS)
            ]
            assert [p["seq"] for p in phase_one[2] + phase_two[2]] == list(range(2, 2 + 2 * STEPS))

            straight = service.create_lora_training_client(TINY, rank=4, seed=11)
            steps = [
                (
                    straight.forward_backward(BATCHES[step % len(BATCHES)], "cross_entropy"),
                    straight.optim_step(ADAM),
                )
                for step in range(2 * STEPS)
            ]
            assert outcomes(Traffic(steps))[0] == phase_one[0] + phase_two[0]
            # The recorders resumed on each new primary: every op reached Postgres.
            ids = [f.request_id for f in first_phase.futures() + second_phase.futures()]
            wait_until(
                lambda: recorded(database_url, ids) == dict.fromkeys(ids, "done"),
                "the record in Postgres",
                timeout=60,
            )
            got = adapter_weights(service, trainer, "end")
            want = adapter_weights(service, straight, "end")
            for key, value in want.items():
                torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
        log = worker.log()
        assert log.count("reconnected to Redis") >= 2, log[-5000:]
    finally:
        assert worker.stop() == 0, worker.log()[-5000:]
