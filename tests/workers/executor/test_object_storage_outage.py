"""The object store away in the middle of a run: a save fails with a clear, retryable error;
training goes on (its snapshots wait, so the log is not trimmed past what is durable); a new
model, whose first snapshot cannot land, is refused the same way; once the store is back, the
same save succeeds and the run ends where an uninterrupted run ends."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_driver import EXACT, Driver, assert_tensors
from object_store import S3Server

from queue_tinker.config.engine import EngineConfig
from queue_tinker.errors import ErrorCategory, StorageUnavailableError
from queue_tinker.workers.executor.lora import LoraExecutor
from queue_tinker.workers.model.checkpoints import stored_state

BASE = "queue-tinker/tiny-llama"


def test_a_save_while_the_store_is_away_fails_retryably_and_the_run_goes_on(
    s3_server: S3Server, models_dir: Path, tmp_path: Path
) -> None:
    store = s3_server.store(s3_server.bucket(), tmp_path / "cache", max_attempts=2)
    run = Driver(
        LoraExecutor(BASE, "cpu", store, models_dir, EngineConfig(snapshot_every_steps=1)), tmp_path
    )
    local = tmp_path / "local"
    local.mkdir()
    straight = Driver(LoraExecutor(BASE, "cpu", local, models_dir), local)
    for driver in (run, straight):
        driver.create("m")
        driver.train("m", 1)
    durable = run.engine.durability.durable_seq("m")

    s3_server.stop()
    with pytest.raises(StorageUnavailableError, match="retry") as away:
        run.save("m", "during")
    assert away.value.category is ErrorCategory.SERVER  # the client may retry it
    run.train("m", 1)  # its snapshot waits for the store
    assert run.engine.durability.durable_seq("m") == durable
    with pytest.raises(StorageUnavailableError):  # no other worker could ever restore it
        run.create("new")
    assert "new" not in run.engine.pool.adapters

    s3_server.start()
    path = run.save("m", "during")  # the name was never taken: the save is simply retried
    run.train("m", 1)
    assert run.engine.durability.durable_seq("m") == run.seqs["m"]  # snapshots resume
    straight.train("m", 2)
    assert_tensors(run.weights("m"), straight.weights("m"), **EXACT)
    saved = stored_state(store, path.removeprefix("tinker://"), optimizer=True)
    assert saved.meta.step == 2
