"""`queue-tinker probe`: a worker's and the housekeeper's health file (QT_HEALTH_FILE) says
whether they serve; the probe passes while they do and fails, saying why, once they stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from procs import REPO, WorkerProcess, child_env, housekeeper_process

from queue_tinker.health import MIN_BOUND_S, HealthFile, default_max_age_s, judge
from queue_tinker.settings import Settings

BOUND_S = 1.5  # three of the test settings' 500 ms heartbeats


def probe(settings: Settings) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "queue_tinker.cli", "probe", "--max-age-s", str(BOUND_S)],
        cwd=REPO,
        env=child_env(settings),
        capture_output=True,
        text=True,
        timeout=30,
    )


def wait_for(condition: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not within the time given"
        time.sleep(0.1)


def touched_within(path: Path, seconds: float) -> bool:
    return path.exists() and time.time() - path.stat().st_mtime < seconds


def assert_probe_follows(settings: Settings, pid: int) -> None:
    """The probe passes while `pid` serves, fails while it is stopped longer than the bound,
    and passes again once it goes on."""
    assert settings.health_file is not None
    wait_for(lambda: touched_within(settings.health_file, 0.5))
    passed = probe(settings)
    assert passed.returncode == 0, passed.stderr
    assert passed.stdout.startswith(f"healthy: {settings.health_file} touched ")
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(BOUND_S + 0.5)
        failed = probe(settings)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert failed.returncode == 1
    assert f"unhealthy: {settings.health_file} was last touched " in failed.stderr
    assert f"> {BOUND_S:g} s" in failed.stderr
    wait_for(lambda: touched_within(settings.health_file, 0.5))
    assert probe(settings).returncode == 0


@pytest.fixture
def probed(settings: Settings, tmp_path: Path) -> Settings:
    """The test's settings with a health file, an hour old (left by an earlier run), so the
    probe passes only once the process has touched it."""
    health_file = tmp_path / "health" / "alive"
    health_file.parent.mkdir()
    health_file.touch()
    an_hour_ago = time.time() - 3600
    os.utime(health_file, (an_hour_ago, an_hour_ago))
    return settings.model_copy(update={"health_file": health_file})


def test_the_probe_follows_a_worker(probed: Settings, tmp_path: Path) -> None:
    """A worker touches the file at each heartbeat: the probe passes while it runs, fails
    while it is SIGSTOPped past the bound and after it exits."""
    worker = WorkerProcess(probed, "tiny", tmp_path / "worker.log")
    try:
        assert_probe_follows(probed, worker.pid)
    finally:
        assert worker.stop() == 0, worker.log()[-3000:]
    assert probed.health_file is not None
    wait_for(lambda: not touched_within(probed.health_file, BOUND_S))
    assert probe(probed).returncode == 1


def test_the_probe_follows_the_housekeeper(probed: Settings, tmp_path: Path) -> None:
    """The housekeeper touches the file while it reaches Redis, even with rq's loop blocked in
    a dequeue: the probe passes while it runs and fails while it is SIGSTOPped."""
    with housekeeper_process(probed, tmp_path / "housekeeper.log") as housekeeper:
        assert_probe_follows(probed, housekeeper.pid)


def test_a_process_that_never_reached_redis_fails_the_probe(
    settings: Settings, tmp_path: Path
) -> None:
    """No file (a process still loading, or one that cleared it at start) fails, naming it;
    without QT_HEALTH_FILE the probe has nothing to judge and says so."""
    missing = settings.model_copy(update={"health_file": tmp_path / "alive"})
    result = probe(missing)
    assert result.returncode == 1
    assert f"{tmp_path / 'alive'} is missing" in result.stderr
    assert probe(settings).returncode == 2


def test_the_default_bound_is_three_heartbeats_and_five_seconds_at_least(tmp_path: Path) -> None:
    """3 x QT_HEARTBEAT_MS, never under MIN_BOUND_S; judged on the file's modification time."""
    assert default_max_age_s(2_000) == 6.0
    assert default_max_age_s(500) == MIN_BOUND_S
    health = HealthFile(tmp_path / "deep" / "alive")
    health.touch()
    touched = (tmp_path / "deep" / "alive").stat().st_mtime
    assert judge(tmp_path / "deep" / "alive", 6.0, now=touched + 5.9).healthy
    assert not judge(tmp_path / "deep" / "alive", 6.0, now=touched + 6.1).healthy
    health.clear()
    assert not (tmp_path / "deep" / "alive").exists()
