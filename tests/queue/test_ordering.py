"""1,000 ops over 20 models, from threads and two client processes, run by 3 worker processes."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from procs import REPO, child_env, running_workers

from queue_tinker.client import ServiceClient, TrainingClient
from queue_tinker.settings import Settings
from queue_tinker.store.db import make_engine, session_factory
from queue_tinker.store.queries import requests_for_model

MODELS, THREADS, PROCESSES = 20, 4, 2
THREAD_OPS, PROCESS_OPS = 5, 15  # per model: 4*5 + 2*15 = 50; 20 models -> 1,000 ops


def submit_from_thread(clients: list[TrainingClient], tag: str) -> list[dict[str, Any]]:
    futures = [(c.model_id, c.ping([tag, i])) for i in range(THREAD_OPS) for c in clients]
    return [
        {
            "model": m,
            "request_id": f.request_id,
            "data": f.result(120)["data"],
            "seq": f.result()["seq"],
        }
        for m, f in futures
    ]


async def wait_for_record(database_url: str, model_ids: list[str], expected: int) -> dict:
    """The Postgres rows of these models, once the recorder has written them all terminal."""
    engine = make_engine(database_url)
    sessions = session_factory(engine)
    try:
        deadline = time.monotonic() + 60
        while True:
            rows = {m: await requests_for_model(sessions, m) for m in model_ids}
            total = sum(len(r) for r in rows.values())
            terminal = sum(
                1 for r in rows.values() for row in r if row.status in ("done", "failed")
            )
            if (total == terminal == expected) or time.monotonic() > deadline:
                return rows
            await asyncio.sleep(0.2)
    finally:
        await engine.dispose()


def test_thousand_ops_run_in_submission_order_once(
    settings: Settings, service: ServiceClient, tmp_path: Path
) -> None:
    """Each model's ops run in exactly seq order, none twice, none lost; every row terminal."""
    with running_workers(settings, 3, tmp_path):
        clients = [service.create_lora_training_client("tiny", rank=4) for _ in range(MODELS)]
        model_ids = [c.model_id for c in clients]
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(REPO / "tests/scripts/submit_pings.py"),
                    f"p{p}",
                    str(PROCESS_OPS),
                    *model_ids,
                ],
                env=child_env(settings),
                stdout=subprocess.PIPE,
                text=True,
            )
            for p in range(PROCESSES)
        ]
        with ThreadPoolExecutor(THREADS) as pool:
            threads = [pool.submit(submit_from_thread, clients, f"t{t}") for t in range(THREADS)]
            results = [r for t in threads for r in t.result(timeout=180)]
        for proc in procs:
            out, _ = proc.communicate(timeout=180)
            assert proc.returncode == 0
            results += [json.loads(line) for line in out.splitlines()]

    assert len(results) == 1000
    assert len({r["request_id"] for r in results}) == 1000
    by_model: dict[str, list[dict[str, Any]]] = {m: [] for m in model_ids}
    for r in results:
        by_model[r["model"]].append(r)
    for model_id, ops in by_model.items():
        # seq 1 is create_model; the 50 pings took seqs 2..51, each executed exactly once
        assert sorted(r["seq"] for r in ops) == list(range(2, 52)), model_id
        # each submitter's ops kept their submission order
        for tag in {r["data"][0] for r in ops}:
            mine = [r for r in ops if r["data"][0] == tag]
            assert [r["data"][1] for r in sorted(mine, key=lambda r: r["seq"])] == sorted(
                r["data"][1] for r in mine
            )

    record = asyncio.run(wait_for_record(settings.database_url or "", model_ids, 1020))
    for model_id, rows in record.items():
        assert [row.seq for row in rows] == list(range(1, 52)), model_id
        assert all(row.status == "done" and row.attempts == 1 for row in rows), model_id
        for before, after in itertools.pairwise(rows):
            assert before.finished_at <= after.started_at, (model_id, before.seq)
