"""A worker killed mid-op costs time, not steps: the next owner replays the log; and a stop
asked of a running sample outlives the worker it was asked of."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import torch
from procs import WorkerProcess, failover_settings, wait_for_workers
from test_worker_behaviour import job_fields, lease_holder, wait_until
from training_runs import ADAM, BATCHES, TINY, adapter_weights, train

import queue_tinker as tinker
from queue_tinker import types
from queue_tinker.errors import RequestFailedError
from queue_tinker.queue.connection import connect
from queue_tinker.queue.control.actions import cancel_job
from queue_tinker.queue.keys import Keys
from queue_tinker.settings import Settings


def test_kill_9_mid_training_loses_no_step(
    redis_url: str, database_url: str, tmp_path: Path, key_prefix: str
) -> None:
    """After kill -9 of the owner, a second worker restores the model's snapshot, replays the
    ops published after it, and the run ends exactly where an uninterrupted run ends."""
    settings = failover_settings(
        redis_url, database_url, key_prefix, tmp_path, snapshot_every_steps=3
    )
    first = WorkerProcess(settings, TINY, tmp_path / "w1.log", engine="lora")
    second: WorkerProcess | None = None
    try:
        wait_for_workers(settings, 1, timeout=90)
        with tinker.ServiceClient(settings) as service:
            interrupted = service.create_lora_training_client(TINY, rank=4, seed=11)
            before = train(interrupted, 5)  # snapshot after step 3; steps 4-5 only in the log
            interrupted.forward_backward(  # accumulated, not yet stepped: must survive too
                BATCHES[1], "cross_entropy"
            ).result(timeout=60)
            os.kill(first.pid, signal.SIGKILL)
            first.proc.wait(timeout=10)

            second = WorkerProcess(settings, TINY, tmp_path / "w2.log", engine="lora")
            interrupted.optim_step(ADAM).result(timeout=90)
            after = train(interrupted, 3, start=6)

            straight = service.create_lora_training_client(TINY, rank=4, seed=11)
            expected = train(straight, 5)
            straight.forward_backward(BATCHES[1], "cross_entropy").result(timeout=60)
            straight.optim_step(ADAM).result(timeout=60)
            assert train(straight, 3, start=6) == after
            assert expected == before
            got = adapter_weights(service, interrupted, "end")
            want = adapter_weights(service, straight, "end")
            for key, value in want.items():
                torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-8, msg=key)
        assert "replaying" in second.log()
    finally:
        first.stop()  # already dead after the kill; this closes its log
        if second is not None:
            assert second.stop() == 0, second.log()[-3000:]


def test_a_failed_persist_is_logged_releases_the_model_and_loses_no_step(
    redis_url: str, database_url: str, tmp_path: Path, key_prefix: str
) -> None:
    """The owner cannot write the model's snapshot when it hands the idle model back (a file
    stands where its storage directory belongs): the failure is logged with the model id, the
    lease is released all the same, and the next claim replays the steps the snapshot missed,
    so the run ends where an uninterrupted one ends."""
    settings = Settings(
        redis_url=redis_url,
        database_url=database_url,
        key_prefix=key_prefix,
        data_dir=tmp_path / "data",
        lease_ttl_ms=3_000,
        heartbeat_ms=500,
        linger_ms=500,
        snapshot_every_steps=100,  # only creation and hand-back write snapshots
    )
    worker = WorkerProcess(settings, TINY, tmp_path / "w.log", engine="lora")
    try:
        wait_for_workers(settings, 1, timeout=90)
        with tinker.ServiceClient(settings) as service:
            run = service.create_lora_training_client(TINY, rank=4, seed=11)
            before = train(run, 2)  # in the log only: the snapshot is creation's
            model_dir = settings.storage_dir / run.model_id
            kept = model_dir.with_name(f"{run.model_id}.kept")
            model_dir.rename(kept)
            model_dir.write_text("not a directory")  # the snapshot cannot be written
            wait_until(lambda: lease_holder(settings, run.model_id) is None, what="the release")
            assert f"persisting {run.model_id} failed" in worker.log()
            model_dir.unlink()
            kept.rename(model_dir)  # storage back: the next claim restores and replays

            after = train(run, 2, start=2)
            straight = service.create_lora_training_client(TINY, rank=4, seed=11)
            assert train(straight, 2) == before
            assert train(straight, 2, start=2) == after
            got = adapter_weights(service, run, "end")
            want = adapter_weights(service, straight, "end")
            for key, value in want.items():
                torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-8, msg=key)
        assert "replaying 4 ops" in worker.log()
    finally:
        assert worker.stop() == 0, worker.log()[-3000:]


# --- samples when their worker dies ------------------------------------------------------
PROMPT = types.ModelInput.from_ints(list(b"stop me"))
# 256 x 200 tokens (four batches of the CPU loop's 64 rows): still running when its worker
# is frozen a few milliseconds after it starts.
LONG = types.SamplingParams(max_tokens=200, seed=5, stop=[])


@dataclass
class SamplingFailover:
    """A sampling session on one LoRA worker, which the test kills and replaces."""

    settings: Settings
    sampler: tinker.SamplingClient
    first: WorkerProcess
    logs: Path
    second: WorkerProcess | None = None

    def job(self, job_id: str) -> dict[str, str]:
        return job_fields(self.settings, job_id)

    def meta(self, field: str) -> int:
        """A field of the session's meta hash (last_seq, done_seq)."""
        with redis.Redis.from_url(self.settings.redis_url or "") as client:
            meta = Keys(self.settings.key_prefix).model_meta(self.sampler.sampler_id)
            return int(client.hget(meta, field) or 0)

    def logged_seqs(self) -> list[int]:
        with redis.Redis.from_url(self.settings.redis_url or "") as client:
            ops = Keys(self.settings.key_prefix).model_ops(self.sampler.sampler_id)
            return [int(entry_id.split(b"-")[0]) for entry_id, _ in client.xrange(ops)]

    def wait_running(self, job_id: str) -> None:
        wait_until(lambda: self.job(job_id).get("status") == "running", 60, f"{job_id} to run")

    def cancel(self, job_id: str) -> str:
        """cancel_job as the dashboard and cancel_future call it: "queued" or "running"."""

        async def cancel() -> str:
            client = connect(self.settings.redis_url or "")
            try:
                keys = Keys(self.settings.key_prefix)
                return await cancel_job(client, keys, job_id, None, reason="stopped")
            finally:
                await client.aclose()

        return asyncio.run(cancel())

    def kill_and_replace(self) -> None:
        os.kill(self.first.pid, signal.SIGKILL)
        self.first.proc.wait(timeout=10)
        self.second = WorkerProcess(self.settings, TINY, self.logs / "w2.log", engine="lora")


@contextmanager
def sampling_failover(
    redis_url: str, database_url: str, key_prefix: str, tmp_path: Path
) -> Iterator[SamplingFailover]:
    settings = failover_settings(redis_url, database_url, key_prefix, tmp_path)
    first = WorkerProcess(settings, TINY, tmp_path / "w1.log", engine="lora")
    failover: SamplingFailover | None = None
    try:
        wait_for_workers(settings, 1, timeout=90)
        with tinker.ServiceClient(settings) as service:
            sampler = service.create_sampling_client(base_model=TINY)
            failover = SamplingFailover(settings, sampler, first, tmp_path)
            yield failover
    finally:
        first.stop()  # already dead after the kill; this closes its log
        if failover is not None and failover.second is not None:
            assert failover.second.stop() == 0, failover.second.log()[-3000:]


def test_a_stop_asked_of_a_worker_that_then_dies_is_kept(
    redis_url: str, database_url: str, key_prefix: str, tmp_path: Path
) -> None:
    """The sample's worker is frozen (SIGSTOP) when the stop is asked, so the stop waits unread
    on its control stream, then killed: the next owner fails the sample with the reason asked
    instead of running it again, and the session goes on."""
    with sampling_failover(redis_url, database_url, key_prefix, tmp_path) as run:
        long = run.sampler.sample(PROMPT, 256, LONG)
        run.wait_running(long.request_id)
        first_owner = run.job(long.request_id)["worker_id"]
        os.kill(run.first.pid, signal.SIGSTOP)
        assert run.cancel(long.request_id) == "running"
        run.kill_and_replace()

        with pytest.raises(RequestFailedError, match="stopped while it ran"):
            long.result(timeout=120)
        failed = run.job(long.request_id)
        assert failed["status"] == "failed" and failed["error_category"] == "user"
        assert failed["worker_id"] != first_owner and failed["attempts"] == "2"
        assert "metrics" not in failed  # a sample that ran would report its tokens

        after = run.sampler.sample(PROMPT, 1, types.SamplingParams(max_tokens=3, stop=[]))
        assert len(after.result(timeout=60).sequences[0].tokens) == 3


def test_an_op_cancelled_behind_a_running_one_does_not_settle_it(
    redis_url: str, database_url: str, key_prefix: str, tmp_path: Path
) -> None:
    """A sample cancelled while it waits behind a running one is found finished when its turn
    comes; the session's done_seq must not move past the running one for it (a new owner
    reads the log from done_seq): killed then, the worker's successor still runs and
    publishes the earlier sample."""
    with sampling_failover(redis_url, database_url, key_prefix, tmp_path) as run:
        # 768 samples: 256 once finished within the second below (CI, 2 cores).
        long = run.sampler.sample(PROMPT, 768, LONG)
        run.wait_running(long.request_id)
        os.kill(run.first.pid, signal.SIGSTOP)  # the next sample waits in the queue meanwhile
        later = run.sampler.sample(PROMPT, 1, LONG)
        wait_until(lambda: run.meta("last_seq") == 3, what="it to queue")
        assert run.cancel(later.request_id) == "queued"
        os.kill(run.first.pid, signal.SIGCONT)  # it reads the cancelled sample and skips it
        time.sleep(1.0)
        assert run.job(long.request_id)["status"] == "running"
        assert run.meta("done_seq") < 2  # the long sample is seq 2
        run.kill_and_replace()

        assert len(long.result(timeout=120).sequences) == 768
        with pytest.raises(RequestFailedError, match="stopped before it ran"):
            later.result(timeout=10)
        wait_until(lambda: run.meta("done_seq") == 3, what="done_seq 3")


def test_samples_in_flight_when_their_worker_dies_run_again(
    redis_url: str, database_url: str, key_prefix: str, tmp_path: Path
) -> None:
    """Two samples of one session run together and the short one is published first: the log
    is trimmed up to it, not past the long one still running (dispatch._publish_call), so when
    the worker is killed its successor finds the long one in the log, runs it again and
    publishes it."""
    with sampling_failover(redis_url, database_url, key_prefix, tmp_path) as run:
        short = run.sampler.sample(PROMPT, 1, types.SamplingParams(max_tokens=10, stop=[]))
        long = run.sampler.sample(PROMPT, 512, LONG)  # seq 3: a burst, they join together
        short.result(timeout=60)
        logged = run.logged_seqs()
        assert run.job(long.request_id)["status"] == "running"
        assert 3 in logged, logged
        run.kill_and_replace()

        assert len(long.result(timeout=180).sequences) == 512
        assert run.job(long.request_id)["attempts"] == "2"
