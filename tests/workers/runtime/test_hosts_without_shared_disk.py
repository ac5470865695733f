"""Two worker hosts that share nothing but Redis, Postgres and the object store, each in a
network namespace of its own with an empty data directory (tests/two_hosts.py): a run survives
its owning host's worker killed three times, and a host cut off the network mid-run is fenced:
the other host carries the run on, and when the link comes back the cut-off worker writes
nothing."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import netns
import pytest
import redis
import torch
from object_store import AWS_ENV, S3Server
from procs import assert_nothing_dead_lettered
from safetensors.torch import load_file
from training_runs import ADAM, BATCHES, TINY
from two_hosts import TwoHosts, WorkerHost, two_hosts, wait_for

import queue_tinker as tinker
from queue_tinker.client.future import APIFuture
from queue_tinker.settings import Settings
from queue_tinker.storage.s3 import S3Store
from queue_tinker.types.service.checkpoints import CheckpointPath

UNAVAILABLE = netns.why_not_available()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))

KILLED_STEPS = 100
KILLS_AFTER_STEPS = (20, 50, 80)  # between snapshots (every 7 steps): each kill replays
CUT_STEPS = 30
CUT_AFTER_STEPS = 10


@pytest.fixture(scope="module")
def hosts(
    redis_url: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TwoHosts]:
    """One deployment for the module (two torch workers take 20-40 s to load on 2 cores)."""
    logs = tmp_path_factory.mktemp("two-hosts")
    prefix = f"qt-test-{uuid.uuid4().hex[:10]}"
    with pytest.MonkeyPatch.context() as env:
        for name, value in {**AWS_ENV, "OMP_NUM_THREADS": "1"}.items():
            env.setenv(name, value)
        s3 = S3Server()
        client = Settings(
            redis_url=redis_url,
            database_url=database_url,
            key_prefix=prefix,
            data_dir=logs / "client",
            s3_endpoint_url=s3.url,
            lease_ttl_ms=1_500,
            heartbeat_ms=300,
            linger_ms=60_000,
            snapshot_every_steps=7,
        )
        try:
            with two_hosts(s3, client, logs) as deployment:
                yield deployment
            assert_nothing_dead_lettered(redis_url, prefix)
        finally:
            s3.stop()
            with redis.Redis.from_url(redis_url) as r:
                for key in r.scan_iter(match=f"{prefix}:*", count=1000):
                    r.delete(key)


def pipelined(tc: tinker.TrainingClient, steps: int) -> list[APIFuture[Any]]:
    """Every step sent at once: forward_backward then optim_step, `steps` times."""
    futures = []
    for step in range(steps):
        futures.append(tc.forward_backward(BATCHES[step % len(BATCHES)], "cross_entropy"))
        futures.append(tc.optim_step(ADAM))
    return futures


def losses(futures: list[APIFuture[Any]], timeout: float) -> list[float]:
    """The forward_backward losses of pipelined() futures."""
    return [f.result(timeout=timeout).loss for f in futures[::2]]


def final_weights(
    deployment: TwoHosts, tc: tinker.TrainingClient, cache: Path
) -> dict[str, torch.Tensor]:
    path = tc.save_weights_for_sampler("end").result(timeout=60).path
    store = S3Store(deployment.client.storage_location, cache, endpoint_url=deployment.s3.url)
    directory = store.fetch(CheckpointPath.parse(path).storage_key)
    assert directory is not None, path
    return load_file(directory / "adapter_model.safetensors")


def uninterrupted(
    deployment: TwoHosts, service: tinker.ServiceClient, steps: int, cache: Path
) -> tuple[list[float], dict[str, torch.Tensor]]:
    straight = service.create_lora_training_client(TINY, rank=4, seed=11)
    return losses(pipelined(straight, steps), 120), final_weights(deployment, straight, cache)


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-8, msg=key)


def other(deployment: TwoHosts, host: WorkerHost) -> WorkerHost:
    return next(h for h in deployment.hosts if h is not host)


@pytest.mark.timeout(300)
def test_a_hundred_pipelined_steps_survive_three_kills_of_the_owning_hosts_worker(
    hosts: TwoHosts, tmp_path: Path
) -> None:
    """100 steps sent at once; at steps 20, 50 and 80 the worker of the host that owns the run
    is SIGKILLed (and started again): the other host restores the snapshot from the bucket
    and replays the log after it each time. No step is lost or run twice: the losses and the
    final weights equal an uninterrupted run's."""
    with tinker.ServiceClient(hosts.client) as service, hosts.explained():
        run = service.create_lora_training_client(TINY, rank=4, seed=11)
        start = hosts.meta(run.model_id, "done_seq")
        futures = pipelined(run, KILLED_STEPS)
        owners = []
        for step in KILLS_AFTER_STEPS:
            wait_for(
                lambda s=step: hosts.meta(run.model_id, "done_seq") >= start + 2 * s,
                120,
                f"step {step}",
            )
            owner = hosts.wait_owner(run.model_id, hosts.hosts, 60)
            owner.kill_worker()
            owner.start_worker()  # loads while the other host carries the run on
            owners.append(owner.label)
        got = losses(futures, 180)
        assert hosts.meta(run.model_id, "done_seq") == start + 2 * KILLED_STEPS
        got_weights = final_weights(hosts, run, tmp_path / "reader")
        want, want_weights = uninterrupted(hosts, service, KILLED_STEPS, tmp_path / "reader")
    assert got == want
    assert_same_weights(got_weights, want_weights)
    assert set(owners) == {"a", "b"}  # the run went back and forth between the hosts
    replays = hosts.logs(tail=10**9).count("replaying")
    assert replays >= len(KILLS_AFTER_STEPS), hosts.logs()
    for host in hosts.hosts:  # nothing written beside a host's own data directory
        assert not (host.settings.data_dir / "checkpoints").exists()


@pytest.mark.timeout(300)
def test_a_host_cut_off_mid_run_is_fenced_and_writes_nothing_when_it_returns(
    hosts: TwoHosts, tmp_path: Path
) -> None:
    """The owning host's link goes down 10 steps into 30 pipelined ones: its lease lapses,
    the other host claims the run and finishes it. The link comes back; the cut-off worker
    finds its lease gone and drops the run, then stops: the run's job hashes, meta and log
    in Redis, the objects of it in the bucket a reader takes and its rows in Postgres are
    exactly as the other host left them (no op run twice, no stale result or snapshot), and
    the run equals an uninterrupted one."""
    for host in hosts.hosts:  # after the kills: both hosts' workers up again
        host.wait_serving()
    with tinker.ServiceClient(hosts.client) as service, hosts.explained():
        run = service.create_lora_training_client(TINY, rank=4, seed=11)
        start = hosts.meta(run.model_id, "done_seq")
        futures = pipelined(run, CUT_STEPS)
        wait_for(
            lambda: hosts.meta(run.model_id, "done_seq") >= start + 2 * CUT_AFTER_STEPS,
            120,
            f"step {CUT_AFTER_STEPS}",
        )
        cut = hosts.wait_owner(run.model_id, hosts.hosts, 60)
        # Cut while an op runs, so the cut-off worker most likely has a result in hand when
        # its link returns (ops it had started show attempts 2: the other host ran them).
        jobs = [f.request_id for f in futures]
        wait_for(lambda: hosts.any_running(jobs), 60, "an op of the run to run")
        cut.net.cut()
        hosts.note(f"host {cut.label}'s link cut")
        survivor = hosts.wait_owner(run.model_id, [other(hosts, cut)], 60)
        got = losses(futures, 120)
        wait_for(lambda: _recorded(hosts, run.model_id, start + 2 * CUT_STEPS), 60, "the record")
        before = hosts.run_state(run.model_id)

        cut.net.restore()
        hosts.note(f"host {cut.label}'s link restored")
        fenced = cut.worker
        assert fenced is not None
        dropped = (f"lost the lease on {run.model_id}", f"lease on {run.model_id} lapsed")
        # Its requests sent into the cut are retransmitted on TCP's backoff (doubling up to
        # tens of seconds after a long cut): it may hear back that long after the link.
        wait_for(lambda: any(d in fenced.log() for d in dropped), 120, "the cut-off to drop it")
        assert fenced.stop() == 0, fenced.log()[-3000:]  # every write it had left is done
        after = hosts.run_state(run.model_id)
        assert hosts.owner(run.model_id) is survivor
        want, want_weights = uninterrupted(hosts, service, CUT_STEPS, tmp_path / "reader")
        got_weights = final_weights(hosts, run, tmp_path / "reader")
    changed = {part for part in before if after[part] != before[part]}
    assert not changed, f"the cut-off worker wrote to {changed}:{hosts.logs()}"
    assert all(job[b"status"] == b"done" for job in after["jobs"].values())
    reruns = sum(job[b"attempts"] == b"2" for job in after["jobs"].values())
    print(f"cut mid-op: {reruns} ops started by the cut-off worker, run again by the other")
    assert got == want
    assert_same_weights(got_weights, want_weights)


def _recorded(deployment: TwoHosts, model_id: str, done_seq: int) -> bool:
    """Postgres holds every request of the run up to `done_seq`, finished."""
    rows = deployment.run_state(model_id)["rows"]["requests"]
    return len(rows) >= done_seq and all(row[2] in ("done", "failed") for row in rows)
