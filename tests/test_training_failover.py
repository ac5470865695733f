"""A worker killed mid-training costs time, not steps: the next owner replays the log."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
from procs import WorkerProcess, wait_for_workers
from test_training_service import ADAM, BATCHES, TINY, adapter_weights, train
from test_worker_behaviour import lease_holder, wait_until

import queue_tinker as tinker
from queue_tinker.settings import Settings


def test_kill_9_mid_training_loses_no_step(
    redis_url: str, database_url: str, tmp_path: Path, key_prefix: str
) -> None:
    """After kill -9 of the owner, a second worker restores the model's snapshot, replays the
    ops published after it, and the run ends exactly where an uninterrupted run ends."""
    settings = Settings(
        redis_url=redis_url,
        database_url=database_url,
        key_prefix=key_prefix,
        data_dir=tmp_path / "data",
        lease_ttl_ms=2_000,
        heartbeat_ms=400,
        linger_ms=60_000,
        snapshot_every_steps=3,
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
