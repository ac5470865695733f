"""`queue-tinker demo`: the whole service on this machine, training a LoRA through the client.

Starts the embedded Redis and Postgres (or uses QT_REDIS_URL / QT_DATABASE_URL) and one LoRA
worker serving the built-in tiny model on the CPU, then trains it on the demo task
(queue_tinker.cli.demo_task) with the ordinary client: 100 steps of forward_backward + optim_step,
a state checkpoint and sampler weights. It prints the loss as it falls, asks the trained
weights (and, for contrast, the base model) the training questions, reads the Postgres record
back, and stops everything. Exit code 1 if the loss did not fall by 90%, an answer is wrong,
or the record is incomplete, so the demo doubles as a smoke test.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import func, select

from queue_tinker.cli import demo_task
from queue_tinker.cli.demo_task import DEMO_BASE_MODEL
from queue_tinker.client import ServiceClient, TrainingClient
from queue_tinker.local.processes import Child, ProcessGroup, spawn
from queue_tinker.local.up import child_env, start_backends, stop_children
from queue_tinker.settings import Settings
from queue_tinker.store.db import make_engine, session_factory
from queue_tinker.store.models import CheckpointRow, RequestRow

REQUIRED_DROP = 0.9  # the promise: the loss falls by at least 90% within 100 steps
WORKER_READY_TIMEOUT_S = 180.0  # first start builds the tiny model's files and imports torch
RECORD_TIMEOUT_S = 20.0  # the recorder writes Postgres behind the hot path
LOG_EVERY = 10


def _err(line: str = "") -> None:
    print(line, file=sys.stderr, flush=True)


def _out(line: str = "") -> None:
    print(line, flush=True)  # flushed, so it stays in order with stderr when both are piped


class Progress:
    """One line every LOG_EVERY steps, and a live bar in between when stderr is a terminal."""

    def __init__(self, total: int, tokens: int) -> None:
        self.total = total
        self.tokens = tokens
        self.started = time.monotonic()
        self.live = sys.stderr.isatty()

    def __call__(self, step: int, loss: float) -> None:
        done = step + 1
        rate = done / max(time.monotonic() - self.started, 1e-9)
        if done == 1 or done % LOG_EVERY == 0 or done == self.total:
            self._clear()
            _err(
                f"  step {done:>4}/{self.total}  loss {loss:>8.2f}  "
                f"({loss / self.tokens:.3f} per token)  {rate:5.1f} steps/s"
            )
        if self.live and done < self.total:
            width = 30
            filled = width * done // self.total
            sys.stderr.write(
                f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total}"
                f"  loss {loss:8.2f}"
            )
            sys.stderr.flush()

    def _clear(self) -> None:
        if self.live:
            sys.stderr.write("\r\033[K")


def _start_worker(group: ProcessGroup, settings: Settings) -> Path:
    """One LoRA worker on the CPU, its log in a file so it does not interleave with ours."""
    log_path = settings.data_dir / "demo-worker.log"
    argv = [
        sys.executable,
        "-m",
        "queue_tinker.cli",
        "worker",
        "--engine",
        "lora",
        "--base-model",
        DEMO_BASE_MODEL,
        "--device",
        "cpu",
    ]
    env = child_env(settings)
    # The tiny model's ops are far too small to gain from intra-op threads, and on a busy
    # machine torch's threads wait on each other: measured 15 ms vs up to 1 s a step.
    env.setdefault("OMP_NUM_THREADS", "1")
    with log_path.open("wb") as log:  # the child keeps its own descriptor
        proc = spawn(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    group.children.append(Child("worker", proc))
    return log_path


def _wait_for_worker(service: ServiceClient, group: ProcessGroup, log_path: Path) -> bool:
    deadline = time.monotonic() + WORKER_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        served = service.get_server_capabilities().supported_models
        if any(m.model_name == DEMO_BASE_MODEL for m in served):
            return True
        dead = group.first_exited()
        if dead is not None:
            _err(
                f"the worker exited with code {dead.proc.returncode}; its log "
                f"({log_path}) ends with:\n{_tail(log_path)}"
            )
            return False
        time.sleep(0.2)
    _err(f"no worker came up within {WORKER_READY_TIMEOUT_S:.0f} s; see {log_path}")
    return False


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _train(training: TrainingClient, steps: int) -> list[float]:
    tokens = demo_task.completion_token_count(
        demo_task.demo_batch(training, demo_task.demo_examples())
    )
    _err(
        f"training {steps} steps: forward_backward + optim_step on all "
        f"{len(demo_task.demo_examples())} examples ({tokens} completion tokens) per step, "
        f"AdamW lr {demo_task.DEMO_LEARNING_RATE:g}"
    )
    progress = Progress(steps, tokens)
    losses = demo_task.train(training, steps, on_step=progress)
    first, last = losses[0], losses[-1]
    drop = 1 - last / first
    _out(
        f"loss: {first:.2f} at step 1 -> {last:.2f} at step {steps}, down {100 * drop:.1f}% "
        f"(per completion token {first / tokens:.3f} -> {last / tokens:.4f})"
    )
    return losses


def _ask(service: ServiceClient, sampler_path: str) -> bool:
    """The training questions to the sampler weights and to the base model; True if the
    trained weights answer every one as taught."""
    examples = demo_task.demo_examples()
    trained = demo_task.answers(service.create_sampling_client(model_path=sampler_path), examples)
    base = demo_task.answers(service.create_sampling_client(base_model=DEMO_BASE_MODEL), examples)
    _out(f"sampling (greedy) from {sampler_path}, base model for contrast:")
    right = 0
    for example, answer, untrained in zip(examples, trained, base, strict=True):
        question = example.prompt.splitlines()[0].removeprefix("Q: ")
        ok = answer == example.completion
        right += ok
        _out(
            f"  {question:<26} {answer.strip()!r:<12} {'ok' if ok else 'WRONG':<6}"
            f"base model: {untrained.strip()!r}"
        )
    _out(f"answered {right} of {len(examples)} as trained")
    return right == len(examples)


@dataclass
class RecordView:
    demo_by_status: dict[str, int]  # every request the demo made (its run and its samplers)
    model_by_kind: list[tuple[str, str, int]]  # (kind, status, count)
    checkpoints: list[CheckpointRow]

    def complete(self, expected_requests: int, expected_checkpoints: int) -> bool:
        """The record holds every request the demo made, each finished (the demo has their
        results: one still queued or running is only the write-behind not there yet)."""
        done = sum(n for _, status, n in self.model_by_kind if status == "done")
        unfinished = any(self.demo_by_status.get(s, 0) for s in ("queued", "running"))
        return (
            done == expected_requests
            and len(self.checkpoints) == expected_checkpoints
            and not unfinished
        )


async def _read_record(database_url: str, model_id: str, tenant: str, since: float) -> RecordView:
    engine = make_engine(database_url)
    try:
        sessions = session_factory(engine)
        async with sessions() as session:
            by_status = await session.execute(
                select(RequestRow.status, func.count())
                .where(
                    RequestRow.tenant_id == tenant,
                    RequestRow.queued_at >= datetime.fromtimestamp(since, tz=UTC),
                )
                .group_by(RequestRow.status)
            )
            demo_by_status = {status: n for status, n in by_status}
            by_kind = await session.execute(
                select(RequestRow.kind, RequestRow.status, func.count())
                .where(RequestRow.model_id == model_id)
                .group_by(RequestRow.kind, RequestRow.status)
                .order_by(func.min(RequestRow.seq))
            )
            checkpoints = await session.scalars(
                select(CheckpointRow)
                .where(CheckpointRow.model_id == model_id)
                .order_by(CheckpointRow.created_at)
            )
            return RecordView(demo_by_status, [(k, s, n) for k, s, n in by_kind], list(checkpoints))
    finally:
        await engine.dispose()


def _show_record(
    settings: Settings, model_id: str, since: float, requests: int, checkpoints: int
) -> bool:
    """Wait for the write-behind record to hold the demo's requests, each finished, print it;
    False if it never did. `since`: when the demo started (a second of clock skew spared)."""
    deadline = time.monotonic() + RECORD_TIMEOUT_S
    args = (settings.database_url or "", model_id, settings.tenant, since - 1.0)
    view = asyncio.run(_read_record(*args))
    while not view.complete(requests, checkpoints) and time.monotonic() < deadline:
        time.sleep(0.25)
        view = asyncio.run(_read_record(*args))
    _out("Postgres record:")
    _out(
        "  the demo's requests by status: "
        + ", ".join(f"{status} {n}" for status, n in sorted(view.demo_by_status.items()))
    )
    _out(f"  requests of {model_id}:")
    for kind, status, n in view.model_by_kind:
        _out(f"    {kind:<26} {status:<8} {n:>5}")
    _out(f"  checkpoints of {model_id}:")
    for row in view.checkpoints:
        _out(f"    {row.kind:<8} {row.name:<12} {row.size_bytes:>9,} bytes  {row.path}")
    if not view.complete(requests, checkpoints):
        _out(
            f"  expected {requests} done requests and {checkpoints} checkpoints within "
            f"{RECORD_TIMEOUT_S:.0f} s"
        )
        return False
    return True


def _session(settings: Settings, group: ProcessGroup, log_path: Path, steps: int, seed: int) -> int:
    began = time.time()
    with ServiceClient(settings) as service:
        _err(f"starting a LoRA worker for {DEMO_BASE_MODEL} on cpu (log: {log_path}) ...")
        if not _wait_for_worker(service, group, log_path):
            return 1
        training = service.create_lora_training_client(
            DEMO_BASE_MODEL, rank=demo_task.DEMO_RANK, seed=seed
        )
        _err(
            f"created model {training.model_id}: LoRA rank {demo_task.DEMO_RANK} on "
            f"{DEMO_BASE_MODEL}"
        )
        losses = _train(training, steps)
        state = training.save_state("demo-final").result()
        sampler = training.save_weights_for_sampler("demo-final").result()
        _out(f"saved state (weights + optimizer): {state.path}")
        _out(f"saved sampler weights:             {sampler.path}")
        answered = _ask(service, sampler.path)
        # create_model, a forward_backward and an optim_step per step, the two saves.
        recorded = _show_record(
            settings, training.model_id, began, requests=1 + 2 * steps + 2, checkpoints=2
        )
    learned = losses[-1] <= (1 - REQUIRED_DROP) * losses[0]
    if not learned:
        _out(f"FAILED: the loss fell by less than {100 * REQUIRED_DROP:.0f}% in {steps} steps")
    return 0 if learned and answered and recorded else 1


def run_demo(
    settings: Settings,
    *,
    steps: int = demo_task.DEMO_STEPS,
    seed: int = 0,
) -> int:
    """The exit code of `queue-tinker demo`."""
    with ExitStack() as stack:
        _err("starting Redis and Postgres (embedded unless QT_*_URL are set) ...")
        settings = start_backends(settings, stack)
        group = ProcessGroup()
        stack.callback(stop_children, group)
        log_path = _start_worker(group, settings)
        code = _session(settings, group, log_path, steps, seed)
        _err("stopping ...")
    return code
