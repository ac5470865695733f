"""A sharded worker group (`queue-tinker worker --ranks 2`, gloo on the CPU) serves as one
worker: its samples are one process's, and a rank killed mid-training ends the group, whose
replacement replays the run to exactly where an uninterrupted run ends."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
from engine_driver import Driver
from group_ranks import greedy_base_sample, make_engine
from procs import WorkerProcess, failover_settings, wait_for_workers
from training_runs import ADAM, BATCHES, TINY, adapter_weights, train

import queue_tinker as tinker
from queue_tinker import types

PROMPT = [72, 101, 108]
CLOSE = {"rtol": 1e-5, "atol": 1e-5}


def test_kill_9_of_one_rank_replaces_the_group_and_loses_no_step(
    redis_url: str, database_url: str, tmp_path: Path, key_prefix: str
) -> None:
    """Rank 1 of a 2-rank group is killed mid-training (a forward_backward accumulated, not
    stepped): the launcher ends rank 0 too, the lease lapses, a new group restores the
    snapshot and replays the log, and losses and weights equal an uninterrupted run's on it.
    A greedy sample through the group's runtime is one process's."""
    settings = failover_settings(
        redis_url, database_url, key_prefix, tmp_path, snapshot_every_steps=2
    )
    first = WorkerProcess(settings, TINY, tmp_path / "g1.log", engine="lora", ranks=2)
    second: WorkerProcess | None = None
    try:
        wait_for_workers(settings, 1, timeout=90)
        with tinker.ServiceClient(settings) as service:
            sampler = service.create_sampling_client(base_model=TINY)
            greedy = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
            sampled = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, greedy)
            tokens = sampled.result(timeout=60).sequences[0].tokens

            interrupted = service.create_lora_training_client(TINY, rank=4, seed=11)
            before = train(interrupted, 3)  # snapshot after step 2; step 3 only in the log
            interrupted.forward_backward(BATCHES[1], "cross_entropy").result(timeout=60)
            rank_0, rank_1 = first.children()
            os.kill(rank_1, signal.SIGKILL)
            assert first.proc.wait(timeout=30) != 0  # the launcher ended the group
            assert not Path(f"/proc/{rank_0}").exists() or _zombie(rank_0)

            second = WorkerProcess(settings, TINY, tmp_path / "g2.log", engine="lora", ranks=2)
            interrupted.optim_step(ADAM).result(timeout=120)
            after = train(interrupted, 2, start=4)

            straight = service.create_lora_training_client(TINY, rank=4, seed=11)
            assert train(straight, 3) == before
            straight.forward_backward(BATCHES[1], "cross_entropy").result(timeout=60)
            straight.optim_step(ADAM).result(timeout=60)
            assert train(straight, 2, start=4) == after
            got = adapter_weights(service, interrupted, "end")
            want = adapter_weights(service, straight, "end")
            for key, value in want.items():
                torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-8, msg=key)
        assert "replaying" in second.log()
        # One process, in this one, the same ops: the group's numbers are its numbers.
        alone = Driver(make_engine(tmp_path / "alone", None), tmp_path / "alone" / "storage")
        assert tokens == greedy_base_sample(alone, PROMPT, 8)
        alone.create("m", seed=11, rank=4)
        losses = []
        for step in range(6):
            losses.append(alone.fb("m", BATCHES[step % len(BATCHES)]).loss)
            alone.step("m", ADAM)
        torch.testing.assert_close([*before, *after], losses[:3] + losses[4:], **CLOSE)
        for key, value in alone.weights("m").items():
            torch.testing.assert_close(got[key], value, **CLOSE, msg=key)
    finally:
        first.stop()  # already ended after the kill; this closes its log
        if second is not None:
            assert second.stop() == 0, second.log()[-3000:]


def _zombie(pid: int) -> bool:
    time.sleep(0.1)
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def test_a_group_refuses_a_model_it_cannot_split_naming_why(
    redis_url: str, database_url: str, tmp_path: Path, key_prefix: str
) -> None:
    """A mixture-of-experts base model on 2 ranks: each rank refuses to start, naming the
    model type and the reason, and the group exits 1."""
    settings = failover_settings(redis_url, database_url, key_prefix, tmp_path)
    group = WorkerProcess(settings, "queue-tinker/tiny-moe", tmp_path / "g.log", "lora", ranks=2)
    try:
        assert group.proc.wait(timeout=90) == 1
        ranks = [line for line in group.log().splitlines() if "refuses to start" in line]
        assert ranks and all(
            "base model type 'qwen3_moe': mixture-of-experts models are not served by a "
            "sharded worker group" in line
            for line in ranks
        )
    finally:
        group.stop()
