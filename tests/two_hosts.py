"""A deployment of two worker hosts, each in a network namespace of its own with its own empty
data directory, sharing nothing but one Redis, one Postgres and one S3 server (tests/netns.py
carries their connections); and the run state the tests compare before and after a host's
link comes back."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import netns
import redis
from object_store import S3Server
from procs import WorkerProcess, wait_for_workers
from sqlalchemy import text
from training_runs import TINY

from queue_tinker.queue.keys import Keys
from queue_tinker.settings import Settings
from queue_tinker.storage.s3 import FILES
from queue_tinker.store.db import make_engine
from queue_tinker.types.service.checkpoints import META_FILE

GENERATION_NAMED = re.compile(r"^[0-9a-f]{32}\.")  # a replacing commit's data file
WORKER_START_S = 120  # torch and the tiny model on a busy 2-core machine: 10-40 s


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


@dataclass
class WorkerHost:
    """One host: its namespace, its settings (services through its gateway), its worker."""

    label: str
    net: netns.Host
    settings: Settings
    logs: Path
    worker: WorkerProcess | None = None
    started: list[WorkerProcess] = field(default_factory=list)

    def start_worker(self) -> WorkerProcess:
        log = self.logs / f"{self.label}-{len(self.started)}.log"
        self.worker = WorkerProcess(
            self.settings, TINY, log, engine="lora", wrapper=self.net.command()
        )
        self.started.append(self.worker)
        return self.worker

    def wait_serving(self, timeout: float = WORKER_START_S) -> None:
        """Until the host's worker has loaded its model and serves (its log says so)."""
        worker = self.worker
        assert worker is not None
        wait_for(lambda: " serving " in worker.log(), timeout, f"host {self.label}'s worker")

    def kill_worker(self) -> None:
        """kill -9 of the host's worker; it is gone when this returns."""
        assert self.worker is not None
        os.kill(self.worker.pid, signal.SIGKILL)
        self.worker.proc.wait(timeout=10)


@dataclass
class TwoHosts:
    client: Settings  # the client's view: the services on 127.0.0.1
    hosts: list[WorkerHost]
    s3: S3Server
    bucket: str
    notes: list[str] = field(default_factory=list)  # the test's moments, for its failures

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.client.redis_url or "")

    @property
    def keys(self) -> Keys:
        return Keys(self.client.key_prefix)

    def meta(self, model_id: str, name: str) -> int:
        with self.redis() as r:
            return int(r.hget(self.keys.model_meta(model_id), name) or 0)

    def any_running(self, job_ids: list[str]) -> bool:
        with self.redis() as r, r.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hget(self.keys.job(job_id), "status")
            return b"running" in pipe.execute()

    def owner(self, model_id: str) -> WorkerHost | None:
        """The host whose live worker holds the model's lease; None between owners."""
        with self.redis() as r:
            token = r.get(self.keys.model_lease(model_id))
            if not token:
                return None
            pid = r.hget(self.keys.worker(token.decode().split("|")[0]), "pid")
        for host in self.hosts:
            if host.worker is not None and pid is not None and host.worker.pid == int(pid):
                return host
        return None

    def wait_owner(self, model_id: str, among: list[WorkerHost], timeout: float) -> WorkerHost:
        found: list[WorkerHost] = []

        def owned() -> bool:
            host = self.owner(model_id)
            found[:] = [host] if host in among else []
            return bool(found)

        wait_for(owned, timeout, f"one of {[h.label for h in among]} to own {model_id}")
        return found[0]

    def note(self, what: str) -> None:
        """A moment of the test, for a failure's message (worker logs carry wall times)."""
        now = time.time()
        stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f"{now % 1:.3f}"[1:]
        self.notes.append(f"{stamp} {what}")

    @contextlib.contextmanager
    def explained(self) -> Iterator[None]:
        """A failure inside carries the test's notes and every worker's log."""
        try:
            yield
        except Exception as exc:
            raise AssertionError(f"{exc}\n{chr(10).join(self.notes)}{self.logs()}") from exc

    def logs(self, tail: int = 4000) -> str:
        """Every worker's log (its last `tail` characters), each under its file name."""
        return "".join(
            f"\n--- {w.log_path.name} ---\n{w.log()[-tail:]}" for h in self.hosts for w in h.started
        )

    def run_state(self, model_id: str) -> dict[str, Any]:
        """Everything of the run's that a worker writes: job hashes, the model's meta and log
        (Redis), its objects in the bucket (name, size, ETag), its request and checkpoint
        rows (Postgres)."""
        with self.redis() as r:
            ops = r.xrange(self.keys.model_ops(model_id))
            job_ids = [fields[b"job"] for _, fields in ops]
            jobs = {
                job_id: r.hgetall(self.keys.job(job_id.decode()))
                for job_id in sorted(set(job_ids) | set(self._job_ids(r, model_id)))
            }
            meta = r.hgetall(self.keys.model_meta(model_id))
            lease = r.get(self.keys.model_lease(model_id))
        return {
            "jobs": jobs,
            "meta": meta,
            "log": ops,
            "lease": lease,
            "objects": self._visible_objects(model_id),
            "rows": asyncio.run(self._rows(model_id)),
        }

    def _visible_objects(self, model_id: str) -> dict[str, tuple[int, str]]:
        """The run's objects a reader can see: every meta and the files it names (size, ETag).
        Left out: data files a replacing commit put up under its own generation's name whose
        meta never landed. S3 cannot refuse an upload already on the wire when a worker's link
        goes down; the bucket refuses its meta (storage/s3.py), no reader ever takes such a
        file, and the next commit of the set deletes it."""
        client = self.s3.client()
        listing = client.list_objects_v2(Bucket=self.bucket, Prefix="").get("Contents", [])
        ours = {o["Key"]: (o["Size"], o["ETag"]) for o in listing if f"/{model_id}/" in o["Key"]}
        visible = {}
        for key in ours:
            folder, _, name = key.rpartition("/")
            if name == META_FILE:
                head = client.head_object(Bucket=self.bucket, Key=key)["Metadata"]
                named = [f"{folder}/{n}" for n in head.get(FILES, "").split(",") if n]
                visible |= {k: ours[k] for k in (key, *named) if k in ours}
            elif not GENERATION_NAMED.match(name):
                visible[key] = ours[key]  # a marker (unloaded), or a file of a first commit
        return visible

    def _job_ids(self, r: redis.Redis, model_id: str) -> list[bytes]:
        found = []
        for key in r.scan_iter(match=self.keys.job("*"), count=1000):
            if r.hget(key, "model_id") == model_id.encode():
                found.append(key.decode().rsplit(":", 1)[1].encode())
        return found

    async def _rows(self, model_id: str) -> dict[str, list[tuple[Any, ...]]]:
        engine = make_engine(self.client.database_url or "")
        try:
            async with engine.connect() as conn:
                requests = await conn.execute(
                    text(
                        "SELECT id, seq, status, worker_id, attempts, started_at, finished_at,"
                        " error FROM requests WHERE model_id = :m ORDER BY seq"
                    ),
                    {"m": model_id},
                )
                checkpoints = await conn.execute(
                    text("SELECT id, path, size_bytes FROM checkpoints WHERE model_id = :m"),
                    {"m": model_id},
                )
                return {
                    "requests": [tuple(row) for row in requests],
                    "checkpoints": [tuple(row) for row in checkpoints],
                }
        finally:
            await engine.dispose()


@contextlib.contextmanager
def two_hosts(s3: S3Server, client: Settings, logs: Path, **options: object) -> Iterator[TwoHosts]:
    """Two namespaced hosts with a worker each, registered; torn down (workers stopped,
    forwarder closed, namespaces and veths deleted) however the test ends."""
    bucket = s3.bucket()
    storage = f"s3://{bucket}/deployment"
    forwarder = netns.Forwarder()
    forwarder.start()
    targets = [
        (netns.port_of(client.redis_url or "", 6379)),
        (netns.port_of(client.database_url or "", 5432)),
        s3.port,
    ]
    hosts: list[WorkerHost] = []
    with contextlib.ExitStack() as stack:
        stack.callback(forwarder.stop)
        for label in ("a", "b"):
            net = stack.enter_context(netns.host(label))
            for port in targets:
                forwarder.listen(net.gateway, port, port)
            settings = client.model_copy(
                update={
                    "redis_url": netns.through(client.redis_url or "", net.gateway),
                    "database_url": netns.through(client.database_url or "", net.gateway),
                    "s3_endpoint_url": netns.through(s3.url, net.gateway),
                    "storage": storage,
                    "data_dir": logs / f"host-{label}",
                    **options,
                }
            )
            hosts.append(WorkerHost(label, net, settings, logs))
        stack.callback(_stop_all, hosts)
        for host in hosts:
            host.start_worker()
        wait_for_workers(client, 2, timeout=WORKER_START_S)
        yield TwoHosts(client.model_copy(update={"storage": storage}), hosts, s3, bucket)


def _stop_all(hosts: list[WorkerHost]) -> None:
    for host in hosts:
        host.net.restore()  # a worker behind a cut link could not hand its models back
        for worker in host.started:
            worker.stop()
