"""Checkpoints in an object store against local disk: the time and bytes of each kind of save and
of reading it back, through the worker's own stores and calls on a directory and on moto's S3
server. How and what to make of it: the `## Checkpoints` section of docs/benchmarks.md.

    .venv/bin/python -m bench.checkpoint_storage           # the 100M model; writes its section
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

import torch

from bench.harness import cli
from bench.harness.machine import cpu_machine
from bench.harness.models import frozen_base, lora_pool
from bench.harness.report import Report, Table, docs_of, emit
from queue_tinker.local.embedded import free_port, listening
from queue_tinker.storage.base import CheckpointStore
from queue_tinker.storage.local import LocalStore
from queue_tinker.storage.s3 import S3Store
from queue_tinker.types.requests.training import LoraConfig
from queue_tinker.workers.model.adapters import Adapter, AdapterPool
from queue_tinker.workers.model.checkpoints import CheckpointMeta, stored_state, write_state

SECTION = "## Checkpoints: object store against local disk"
COMMAND = ".venv/bin/python -m bench.checkpoint_storage"
MIB = 2**20
KNOBS = {"--repeats": (5, "saves and loads of each kind in each store")}
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
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not listening("127.0.0.1", port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("moto's server did not start")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def trained_adapter(model: str, models_dir: Path) -> tuple[AdapterPool, Adapter, int]:
    """The model's adapter after one AdamW step, its gradients kept; the base's parameters."""
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
    """Save the kind `repeats` times (each replacing the last), then load it as often, cold."""
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


def run(model: str, repeats: int, scratch: Path) -> tuple[list[Measured], int]:
    """Every kind in both stores; and the base model's parameter count."""
    pool, adapter, params = trained_adapter(model, scratch / "models")
    results = []
    with mock.patch.dict(os.environ, FAKE_AWS), moto_server() as endpoint:
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


def report(
    results: list[Measured], model: str, repeats: int, params: int, info: dict[str, str]
) -> Report:
    """A row a kind: its size, and each store's median save and load with its rate."""
    by = {(m.kind.name, m.store): m for m in results}

    def timed(m: Measured, median: float) -> str:
        return f"{median:.3f} s ({m.bytes / MIB / median:.0f} MiB/s)"

    rows = []
    for kind in KINDS:
        local, s3 = by[(kind.name, "local")], by[(kind.name, "s3")]
        row = [kind.name, f"{s3.bytes / MIB:.1f}"]
        for on_disk, in_bucket in ((local.save_s, s3.save_s), (local.load_s, s3.load_s)):
            disk, bucket = statistics.median(on_disk), statistics.median(in_bucket)
            row += [timed(local, disk), timed(s3, bucket), f"{bucket / disk:.1f}x"]
        rows.append(row)
    columns = ("what", "MiB", "save, local disk", "save, object store", "ratio",
               "load, local disk", "load, object store", "ratio")  # fmt: skip
    facts = [
        f"A LoRA adapter of {model} ({params:,} parameters), rank 32 on every linear layer, "
        f"median of {repeats} saves and {repeats} loads each."
    ]
    raw = {"model": model, "params": params, "measured": [asdict(m) for m in results]}
    return Report(SECTION, COMMAND, info, facts, (), [Table(columns, rows)], raw)


def main(argv: Sequence[str] | None = None) -> int:
    """Every kind in both stores; hand back the report."""
    quick = "the tiny model, one save and load of each"
    parser = cli.parser("bench.checkpoint_storage", __doc__, knobs=KNOBS, quick=quick)
    parser.add_argument("--model", default="queue-tinker/llama-100m")
    args = cli.parse(parser, argv, quick={"model": "queue-tinker/tiny-llama", "repeats": 1})
    info = cpu_machine()
    with tempfile.TemporaryDirectory(prefix="qt-bench-ckpt-") as tmp:
        results, params = run(args.model, args.repeats, Path(tmp))
    emit(report(results, args.model, args.repeats, params, info), docs_of(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
