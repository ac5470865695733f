"""Hosts that share no disk: with QT_STORAGE=s3://..., checkpoints, snapshots and sampler
weights one worker writes are found by a worker with an empty data directory of its own, a run
moves between them exactly as it moves between workers on one host, and the gateway (a third
host) hands out download URLs the bucket signs."""

from __future__ import annotations

import io
import tarfile
import time
import urllib.request
from pathlib import Path

import httpx
import pytest
import torch
from object_store import S3Server
from procs import WorkerProcess, gateway_process, make_key, wait_for_workers
from safetensors.torch import load_file
from training_runs import TINY, train

import queue_tinker as tinker
from queue_tinker import types
from queue_tinker.settings import Settings
from queue_tinker.storage.s3 import S3Store
from queue_tinker.types.service.checkpoints import CheckpointPath

PROMPT = types.ModelInput.from_ints(list(b"the cat "))
SEEDED = types.SamplingParams(max_tokens=12, seed=7, temperature=1.0)


def host(s3: S3Server, bucket: str, root: Path, name: str, **common: object) -> Settings:
    """One host's settings: the deployment's Redis, Postgres and bucket; its own data dir."""
    return Settings(
        data_dir=root / name,
        storage=f"s3://{bucket}/deployment",
        s3_endpoint_url=s3.url,
        **common,  # type: ignore[arg-type]
    )


def wait_serving(worker: WorkerProcess, timeout: float = 150) -> None:
    """Until the worker has loaded its model and serves (its log says so)."""
    deadline = time.monotonic() + timeout
    while " serving " not in worker.log():
        assert worker.proc.poll() is None, worker.log()[-3000:]
        assert time.monotonic() < deadline, "the second host's worker did not start"
        time.sleep(0.2)


def check_downloads(settings: Settings, tmp_path: Path, exported: str, sampler: str) -> None:
    """The gateway, on a host of its own: external weights URLs are the bucket's presigned
    GETs (fetched with no credentials); an archive is built from its cached copy."""
    run, segment, name = exported.removeprefix("tinker://").split("/")
    api = {"X-API-Key": make_key(settings, settings.tenant)}
    gateway_settings = settings.model_copy(update={"data_dir": tmp_path / "gateway-host"})
    with gateway_process(gateway_settings, tmp_path / "gateway.log") as url:
        base = f"{url}/api/v1/training_runs/{run}/checkpoints"
        answer = httpx.get(f"{base}/{segment}/{name}/external_weights_urls", headers=api)
        assert answer.status_code == 200, answer.text
        urls = answer.json()["urls"]
        assert set(urls) == {"adapter_config.json", "adapter_model.safetensors"}
        for file, signed in urls.items():
            assert signed.startswith(f"{settings.s3_endpoint_url}/"), signed  # not the gateway
            with urllib.request.urlopen(signed, timeout=30) as response:
                assert len(response.read()) > 0, file
        sampler_name = sampler.rsplit("/", 1)[1]
        archive = httpx.get(
            f"{base}/sampler_weights/{sampler_name}/archive", headers=api, follow_redirects=True
        )
        assert archive.status_code == 200, archive.text
        with tarfile.open(fileobj=io.BytesIO(archive.content)) as tar:
            assert "adapter_model.safetensors" in tar.getnames()


def stored_weights(store: S3Store, path: str) -> dict[str, torch.Tensor]:
    directory = store.fetch(CheckpointPath.parse(path).storage_key)
    assert directory is not None, path
    return load_file(directory / "adapter_model.safetensors")


# Two worker processes start one after the other (each loads torch and the model): past the
# suite's 120 s on two busy cores.
@pytest.mark.timeout(300)
def test_a_run_moves_between_hosts_through_the_bucket(
    s3_server: S3Server,
    redis_url: str,
    database_url: str,
    key_prefix: str,
    tmp_path: Path,
) -> None:
    """Host one trains, saves its state and sampler weights, and hands the run back when it
    stops; host two, with an empty data dir, takes the run over from its snapshot in the
    bucket (no op replayed) and continues, starts a run from the saved state, and samples the
    sampler weights as host one did: every result equals an uninterrupted run's."""
    bucket = s3_server.bucket()
    common = {
        "redis_url": redis_url,
        "database_url": database_url,
        "key_prefix": key_prefix,
        "lease_ttl_ms": 3_000,
        "heartbeat_ms": 400,
        "linger_ms": 60_000,
        "snapshot_every_steps": 100,  # only creation and the hand-over write snapshots
    }
    one = host(s3_server, bucket, tmp_path, "host-one", **common)
    two = host(s3_server, bucket, tmp_path, "host-two", **common)
    first = WorkerProcess(one, TINY, tmp_path / "one.log", engine="lora")
    second: WorkerProcess | None = None
    try:
        wait_for_workers(one, 1, timeout=90)
        with tinker.ServiceClient(one) as service:
            run = service.create_lora_training_client(TINY, rank=4, seed=11)
            losses = train(run, 2)
            state = run.save_state("mid").result(timeout=60).path
            sampler = run.save_weights_for_sampler("mid-sampler").result(timeout=60).path
            sampled_on_one = (
                service.create_sampling_client(sampler).sample(PROMPT, 2, SEEDED).result(timeout=60)
            )
            assert first.stop() == 0, first.log()[-3000:]  # hands the run back, persisted

            second = WorkerProcess(two, TINY, tmp_path / "two.log", engine="lora")
            wait_serving(second)
            losses += train(run, 2, start=2)  # host two restores the run from the bucket
            resumed = service.create_training_client_from_state_with_optimizer(state)
            resumed_losses = train(resumed, 2, start=2)
            sampled_on_two = (
                service.create_sampling_client(sampler).sample(PROMPT, 2, SEEDED).result(timeout=60)
            )
            straight = service.create_lora_training_client(TINY, rank=4, seed=11)
            assert train(straight, 4) == losses
            assert losses[2:] == resumed_losses
            assert [s.tokens for s in sampled_on_two.sequences] == [
                s.tokens for s in sampled_on_one.sequences
            ]
            exported = run.save_weights_external("export").result(timeout=60).path
            ends = {
                name: tc.save_weights_for_sampler("end").result(timeout=60).path
                for name, tc in (("run", run), ("resumed", resumed), ("straight", straight))
            }
            check_downloads(two, tmp_path, exported, sampler)
        assert "replaying" not in second.log()  # the snapshot in the bucket held every step
        assert not (tmp_path / "host-two" / "checkpoints").exists()  # nothing on a shared disk
        reader = S3Store(one.storage_location, tmp_path / "reader", endpoint_url=s3_server.url)
        want = stored_weights(reader, ends["straight"])
        for name in ("run", "resumed"):
            got = stored_weights(reader, ends[name])
            for key, value in want.items():
                torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=f"{name} {key}")
        assert sorted(want) == sorted(stored_weights(reader, sampler))
    finally:
        first.stop()
        if second is not None:
            assert second.stop() == 0, second.log()[-3000:]
