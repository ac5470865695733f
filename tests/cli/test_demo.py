"""The demo task, the demo command and the manual-training-loop example, on real services
with a real LoRA worker (CPU).

The must-show: on the demo task, training loss falls by at least 90% within 100 steps.
"""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from procs import REPO, WorkerProcess, child_env, wait_for_workers

from queue_tinker.builtin_models import EOS_ID
from queue_tinker.cli import demo_task
from queue_tinker.cli.demo import run_demo
from queue_tinker.client import ServiceClient
from queue_tinker.settings import Settings
from queue_tinker.types import CheckpointPath

EXAMPLE = REPO / "examples" / "manual_training_loop.py"


@pytest.fixture(scope="module")
def module_settings(
    redis_url: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Settings]:
    """One deployment for the module (the conftest `settings` is per test), keys removed after."""
    prefix = f"qt-test-{uuid.uuid4().hex[:10]}"
    yield Settings(
        redis_url=redis_url,
        database_url=database_url,
        key_prefix=prefix,
        data_dir=tmp_path_factory.mktemp("demo") / "data",
        lease_ttl_ms=3_000,
        heartbeat_ms=500,
        linger_ms=2_000,
    )
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    for start in range(0, len(keys), 500):
        client.delete(*keys[start : start + 500])
    client.close()


@pytest.fixture(scope="module")
def lora_worker(module_settings: Settings) -> Iterator[WorkerProcess]:
    log_path = module_settings.data_dir.parent / "worker.log"
    with pytest.MonkeyPatch.context() as env:
        # One torch thread: the tiny model gains nothing from more, and on a busy CI machine
        # its threads wait on each other (the demo's worker does the same).
        env.setenv("OMP_NUM_THREADS", "1")
        worker = WorkerProcess(module_settings, demo_task.DEMO_BASE_MODEL, log_path, engine="lora")
    try:
        wait_for_workers(module_settings, 1, timeout=60)
        yield worker
    finally:
        code = worker.stop()
        assert code == 0, f"worker exited with {code}:\n{worker.log()[-3000:]}"


def test_demo_batch_is_shifted_and_weights_only_the_completion() -> None:
    examples = demo_task.demo_examples()
    encode = lambda text: list(text.encode())  # noqa: E731 (the tiny model's byte tokenizer)
    batch = demo_task.demo_batch(encode, examples)
    assert 8 <= len(batch) <= 16
    for datum, example in zip(batch, examples, strict=True):
        tokens = encode(example.prompt) + encode(example.completion)
        assert datum.model_input.to_ints() == tokens[:-1]
        targets = datum.loss_fn_inputs["target_tokens"].to_numpy()
        weights = datum.loss_fn_inputs["weights"].to_numpy()
        assert targets.tolist() == tokens[1:]
        # Weight 1 exactly where the target is a completion token.
        expected = [0.0] * (len(encode(example.prompt)) - 1) + [1.0] * len(example.completion)
        assert weights.tolist() == expected
        assert EOS_ID not in tokens
    assert demo_task.completion_token_count(batch) == sum(len(e.completion) for e in examples)
    assert all(d.model_input.length <= 256 for d in batch)  # the tiny model's context


def test_demo_task_loss_falls_by_90_percent_within_100_steps(
    module_settings: Settings, lora_worker: WorkerProcess
) -> None:
    with ServiceClient(module_settings) as service:
        training = service.create_lora_training_client(
            demo_task.DEMO_BASE_MODEL, rank=demo_task.DEMO_RANK, seed=0
        )
        seen: list[int] = []
        losses = demo_task.train(training, 100, on_step=lambda step, _: seen.append(step))
        sampler = training.save_weights_and_get_sampling_client("trained")
        answers = demo_task.answers(sampler, demo_task.demo_examples())
        untrained = demo_task.answers(
            service.create_sampling_client(base_model=demo_task.DEMO_BASE_MODEL),
            demo_task.demo_examples(),
        )
    assert seen == list(range(100))
    assert len(losses) == 100 and all(np.isfinite(losses))
    assert losses[-1] <= 0.1 * losses[0], f"first {losses[0]:.2f}, last {losses[-1]:.2f}"
    # Sampling from the trained weights gives the answers it was taught; the base model not.
    assert answers == [e.completion for e in demo_task.demo_examples()]
    assert untrained != answers


def test_manual_training_loop_example_runs_against_the_deployment(
    module_settings: Settings, lora_worker: WorkerProcess
) -> None:
    argv = [
        sys.executable,
        str(EXAMPLE),
        "--num-steps",
        "6",
        "--save-every",
        "3",
        "--learning-rate",
        "5e-3",
    ]
    proc = subprocess.run(
        argv, env=child_env(module_settings), cwd=REPO, capture_output=True, text=True, timeout=90
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = [float(x) for x in re.findall(r"^Step \d+, Loss: (\S+)$", proc.stdout, re.M)]
    assert len(losses) == 6 and all(np.isfinite(losses)), proc.stdout
    saved = re.search(r"^Saved sampler weights: (\S+)$", proc.stdout, re.M)
    assert saved is not None, proc.stdout
    path = CheckpointPath.parse(saved.group(1))
    assert path.kind.path_segment == "sampler_weights"
    assert re.search(
        r"^Sample: 'Question: What is 2\+2\?\\nAnswer:' -> '.*'$", proc.stdout, re.M
    ), proc.stdout
    assert proc.stdout.rstrip().endswith("Training complete!")


def test_demo_command_trains_saves_and_shows_the_record(
    settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    """`queue-tinker demo` on the test's Redis/Postgres (no embedded servers): its own worker."""
    assert run_demo(settings) == 0
    out = capsys.readouterr().out
    drop = re.search(r"down (\d+\.\d)%", out)
    assert drop is not None and float(drop.group(1)) >= 90.0, out
    assert re.search(r"saved state .*: tinker://m-\w+/weights/demo-final$", out, re.M), out
    assert re.search(
        r"saved sampler weights: +tinker://m-\w+/sampler_weights/demo-final$", out, re.M
    ), out
    for kind, count in (("forward_backward", 100), ("optim_step", 100), ("save_state", 1)):
        assert re.search(rf"^ +{kind} +done +{count}$", out, re.M), out
    assert re.search(r"^ +state +demo-final ", out, re.M), out
    assert re.search(r"^ +sampler +demo-final ", out, re.M), out
    assert re.search(r"^answered 12 of 12 as trained$", out, re.M), out
    # Every request the demo made has finished, and the record says so: nothing still queued
    # or running once the write-behind has caught up.
    statuses = re.search(r"^  the demo's requests by status: (.*)$", out, re.M)
    assert statuses is not None and re.fullmatch(r"done \d+", statuses.group(1)), out
    assert re.search(r"^ +capital of France\? +' ?Paris' +ok ", out, re.M), out
    assert Path(settings.data_dir / "demo-worker.log").is_file()
