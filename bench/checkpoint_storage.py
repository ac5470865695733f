"""Checkpoints in an object store against local disk: the time and bytes of what
save_weights_for_sampler, save_state and a snapshot write, and of reading each back (a
load_state, a sampler's load, a new owner's restore), for a LoRA adapter of the built-in 100M
model (rank 32 on every linear layer, with AdamW's moments after a step).

Both stores are the worker's own (`queue_tinker/storage/`), driven through the same calls the
worker makes (`workers/model/checkpoints.py` write_state and stored_state): a local directory,
and an S3 bucket on moto's standalone server in a process of its own on loopback (MinIO is not
installed where this runs). Each read starts from an empty cache, as on a host that has never
seen the checkpoint; the directory's reads come from the page cache (it was just written).

    .venv/bin/python -m bench.checkpoint_storage           # the 100M model; writes its section
    .venv/bin/python -m bench.checkpoint_storage --quick   # the tiny model, docs left alone
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.harness import cli
from bench.harness.machine import commit, cpu_model, now
from bench.harness.models import frozen_base, lora_pool
from bench.harness.report import publish, reproduce, table
from queue_tinker.storage.base import CheckpointStore
from queue_tinker.storage.local import LocalStore
from queue_tinker.storage.s3 import S3Store
from queue_tinker.types.requests.training import LoraConfig
from queue_tinker.workers.model.adapters import Adapter, AdapterPool
from queue_tinker.workers.model.checkpoints import CheckpointMeta, stored_state, write_state

SECTION = "## Checkpoints: object store against local disk"
COMMAND = ".venv/bin/python -m bench.checkpoint_storage"
MIB = 2**20
# Credentials moto accepts (any will do); only this process and its server see them.
FAKE_AWS = {
    "AWS_ACCESS_KEY_ID": "qt-bench",
    "AWS_SECRET_ACCESS_KEY": "qt-bench-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass(frozen=True)
class Kind:
    """What one save writes and its load reads back."""

    name: str
    optimizer: bool
    grads: bool


KINDS = (
    Kind("sampler weights (save_weights_for_sampler)", optimizer=False, grads=False),
    Kind("state (save_state / load_state)", optimizer=True, grads=False),
    Kind("snapshot (a hand-over: + gradients)", optimizer=True, grads=True),
)


@dataclass
class Measured:
    kind: Kind
    store: str  # "local" or "s3"
    bytes: int
    save_s: list[float]
    load_s: list[float]


@contextmanager
def moto_server() -> Iterator[str]:
    """moto's S3 server in its own process on a free loopback port; its endpoint URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("moto's server did not start")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def trained_adapter(model: str, models_dir: Path) -> tuple[AdapterPool, Adapter, int]:
    """The model's adapter after one AdamW step on random gradients, its gradients kept: every
    file a snapshot holds is full-sized. And the base model's parameter count."""
    base = frozen_base(model, "cpu", models_dir)
    params = sum(p.numel() for p in base.parameters())
    pool = lora_pool(base, model, adapters=1)
    adapter = pool.add("bench-checkpoints", "bench", LoraConfig(rank=32), seed=0)
    torch.manual_seed(0)
    for param in adapter.params.values():
        param.grad = torch.randn_like(param)
    adapter.optimizer.step()
    return pool, adapter, params


def measure(
    pool: AdapterPool,
    adapter: Adapter,
    kind: Kind,
    name: str,
    open_store: Callable[[Path], CheckpointStore],
    scratch: Path,
    repeats: int,
) -> Measured:
    """Save the kind `repeats` times (each replacing the last, as snapshots do), then read it
    back `repeats` times, each through a store with an empty cache."""
    key = f"bench/{uuid.uuid4().hex[:8]}/{'snapshot' if kind.grads else 'weights'}"
    writer = open_store(scratch / "writer-cache")
    meta = CheckpointMeta(
        model_id="bench",
        tenant_id="bench",
        base_model=pool.base_model,
        lora_config=adapter.config.model_dump(),
        seq=1,
        step=1,
        created_at=float(int(time.time())),  # whole seconds: the same bytes in both stores
    )
    config = pool.peft_adapter_config(adapter)
    save_s, load_s, size = [], [], 0
    for _ in range(repeats):
        state = pool.export(adapter, meta)  # as the worker does before each write
        began = time.perf_counter()
        size = write_state(writer, key, state, config, optimizer=kind.optimizer, grads=kind.grads)
        save_s.append(time.perf_counter() - began)
    for i in range(repeats):
        reader = open_store(scratch / f"reader-cache-{uuid.uuid4().hex[:8]}-{i}")
        began = time.perf_counter()
        stored_state(reader, key, optimizer=kind.optimizer, grads=kind.grads)
        load_s.append(time.perf_counter() - began)
    return Measured(kind, name, size, save_s, load_s)


@contextmanager
def fake_credentials() -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in FAKE_AWS}
    os.environ.update(FAKE_AWS)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run(model: str, repeats: int, scratch: Path) -> tuple[list[Measured], int]:
    """Every kind in both stores; and the base model's parameter count."""
    pool, adapter, params = trained_adapter(model, scratch / "models")
    results = []
    with fake_credentials(), moto_server() as endpoint:
        import boto3

        bucket = f"qt-bench-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        stores: dict[str, Callable[[Path], CheckpointStore]] = {
            "local": lambda _cache: LocalStore(scratch / "local-disk"),
            "s3": lambda cache: S3Store(f"s3://{bucket}/ckpt", cache, endpoint_url=endpoint),
        }
        for kind in KINDS:
            for name, open_store in stores.items():
                results.append(measure(pool, adapter, kind, name, open_store, scratch, repeats))
                print(f"{kind.name}, {name}: done", flush=True)
    return results, params


def render(results: list[Measured], model: str, repeats: int, params: int) -> str:
    by = {(m.kind.name, m.store): m for m in results}
    rows = []
    for kind in KINDS:
        local, s3 = by[(kind.name, "local")], by[(kind.name, "s3")]
        save = [statistics.median(m.save_s) for m in (local, s3)]
        load = [statistics.median(m.load_s) for m in (local, s3)]
        rows.append(
            [
                kind.name,
                f"{s3.bytes / MIB:.1f}",
                f"{save[0]:.3f} s ({local.bytes / MIB / save[0]:.0f} MiB/s)",
                f"{save[1]:.3f} s ({s3.bytes / MIB / save[1]:.0f} MiB/s)",
                f"{save[1] / save[0]:.1f}x",
                f"{load[0]:.3f} s ({local.bytes / MIB / load[0]:.0f} MiB/s)",
                f"{load[1]:.3f} s ({s3.bytes / MIB / load[1]:.0f} MiB/s)",
                f"{load[1] / load[0]:.1f}x",
            ]
        )
    columns = [
        "what",
        "MiB",
        "save, local disk",
        "save, object store",
        "ratio",
        "load, local disk",
        "load, object store",
        "ratio",
    ]
    lines = [
        SECTION,
        "",
        *reproduce(COMMAND),
        "",
        f"Measured on {cpu_model()} ({os.cpu_count()} cores), commit {commit()}, {now()}: "
        f"a LoRA adapter of {model} ({params:,} parameters), rank 32 on every linear "
        f"layer, median of {repeats} saves and {repeats} loads each (bench/checkpoint_storage.py "
        "says how). The object store is moto's S3 server on loopback (one process, Python): "
        "a real S3 or MinIO moves bytes faster, and a network between host and store adds "
        "its own latency and bandwidth. A save is write_state (safetensors into a staging "
        "directory, then the store's commit: a rename on disk; uploads, meta last, in the "
        "bucket); a load is stored_state from an empty cache (the download, then safetensors).",
        "",
        *table(columns, rows),
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_quick(parser, "the tiny model, one save and load of each")
    parser.add_argument("--model", default="queue-tinker/llama-100m")
    cli.add_knobs(parser, {"--repeats": (5, "saves and loads of each kind in each store")})
    cli.add_report(parser, json=False)
    args = cli.parse(parser, argv, quick={"model": "queue-tinker/tiny-llama", "repeats": 1})
    with tempfile.TemporaryDirectory(prefix="qt-bench-ckpt-") as tmp:
        results, params = run(args.model, args.repeats, Path(tmp))
    text = render(results, args.model, args.repeats, params)
    print(text, end="")
    publish(args.docs, args.no_docs, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
